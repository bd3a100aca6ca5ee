"""Our parameter tree and how it maps onto HF tensor names; shared by every checkpoint format.

The tree (the contract with model/transformer.py, whose `param_shapes` is its definition) is a
plain nested dict; every leaf under 'layers' is stacked over layers on axis 0 so the model can
`scan` over them:

    embed/embedding              (V, D)
    layers/attn_norm/scale       (L, D)
    layers/attn/q_proj/kernel    (L, D, H, Dh)     HF q_proj.weight (H*Dh, D), transposed
    layers/attn/k_proj/kernel    (L, D, K, Dh)
    layers/attn/v_proj/kernel    (L, D, K, Dh)
    layers/attn/o_proj/kernel    (L, H, Dh, D)     HF o_proj.weight (D, H*Dh), transposed
    layers/attn/q_proj/bias      (L, H, Dh)        only with cfg.attention_bias (Qwen2)
    layers/attn/{k,v}_proj/bias  (L, K, Dh)
    layers/attn/o_proj/bias      (L, D)            only with cfg.o_proj_bias (Llama/Qwen3)
    layers/attn/{q,k}_norm/scale (L, Dh)           only with cfg.qk_norm (Qwen3)
    layers/mlp_norm/scale        (L, D)
    layers/mlp/{gate,up}_proj/kernel (L, D, F); layers/mlp/down_proj/kernel (L, F, D)
    final_norm/scale             (D,)
    lm_head/kernel               (D, V)            absent when cfg.tie_word_embeddings

Every conversion here is a transpose/reshape (a permutation of elements), so HF -> ours -> HF
gives back the same bytes in the same dtype. The formats (model/hf_checkpoint.py,
model/gguf_checkpoint.py) name their tensors the HF way, or map their names onto HF's, and
validate them here before any tensor is read, so bad input fails with one error that lists
every problem.
"""
from __future__ import annotations

import re
from typing import Any, Callable, Mapping

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy before any load)
import numpy as np

from magistral_jax.model.config import ModelConfig
from magistral_jax.model.transformer import param_shapes

CONFIG_JSON = "config.json"
# Buffers some older HF checkpoints carry; they are recomputed, not learned.
_IGNORED_HF_TENSORS = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


class CheckpointError(ValueError):
  """A checkpoint that does not match the model config (or cannot be read)."""


# Per-layer tensors of every architecture: (our path under 'layers', HF name suffix after
# 'model.layers.{i}.').
_BASE_LAYER_TENSORS = (
    (("attn_norm", "scale"), "input_layernorm.weight"),
    (("attn", "q_proj", "kernel"), "self_attn.q_proj.weight"),
    (("attn", "k_proj", "kernel"), "self_attn.k_proj.weight"),
    (("attn", "v_proj", "kernel"), "self_attn.v_proj.weight"),
    (("attn", "o_proj", "kernel"), "self_attn.o_proj.weight"),
    (("mlp_norm", "scale"), "post_attention_layernorm.weight"),
    (("mlp", "gate_proj", "kernel"), "mlp.gate_proj.weight"),
    (("mlp", "up_proj", "kernel"), "mlp.up_proj.weight"),
    (("mlp", "down_proj", "kernel"), "mlp.down_proj.weight"),
)
# Qwen2 (and Llama/Qwen3 with attention_bias): biases on q/k/v.
_BIAS_LAYER_TENSORS = (
    (("attn", "q_proj", "bias"), "self_attn.q_proj.bias"),
    (("attn", "k_proj", "bias"), "self_attn.k_proj.bias"),
    (("attn", "v_proj", "bias"), "self_attn.v_proj.bias"),
)
# Llama/Qwen3 with attention_bias: a bias on o_proj as well (Qwen2 has none there).
_O_BIAS_LAYER_TENSORS = ((("attn", "o_proj", "bias"), "self_attn.o_proj.bias"),)
# Qwen3: an RMSNorm over head_dim on every query and key head, before RoPE.
_QK_NORM_LAYER_TENSORS = (
    (("attn", "q_norm", "scale"), "self_attn.q_norm.weight"),
    (("attn", "k_norm", "scale"), "self_attn.k_norm.weight"),
)


def layer_tensors(cfg: ModelConfig) -> tuple[tuple[tuple[str, ...], str], ...]:
  """This config's per-layer tensors: (our path under 'layers', HF suffix after
  'model.layers.{i}.'), in a fixed order."""
  table = _BASE_LAYER_TENSORS
  if cfg.attention_bias:
    table += _BIAS_LAYER_TENSORS
  if cfg.o_proj_bias:
    table += _O_BIAS_LAYER_TENSORS
  if cfg.qk_norm:
    table += _QK_NORM_LAYER_TENSORS
  return table


def layer_hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
  """HF suffix -> (torch) shape of one layer's tensor, for every entry of layer_tensors(cfg)."""
  d, f, h, k, dh = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
                    cfg.head_dim)
  shapes = {
      "input_layernorm.weight": (d,), "post_attention_layernorm.weight": (d,),
      "self_attn.q_proj.weight": (h * dh, d), "self_attn.k_proj.weight": (k * dh, d),
      "self_attn.v_proj.weight": (k * dh, d), "self_attn.o_proj.weight": (d, h * dh),
      "mlp.gate_proj.weight": (f, d), "mlp.up_proj.weight": (f, d), "mlp.down_proj.weight": (d, f),
      "self_attn.q_proj.bias": (h * dh,), "self_attn.k_proj.bias": (k * dh,),
      "self_attn.v_proj.bias": (k * dh,), "self_attn.o_proj.bias": (d,),
      "self_attn.q_norm.weight": (dh,), "self_attn.k_norm.weight": (dh,),
  }
  return {suffix: shapes[suffix] for _, suffix in layer_tensors(cfg)}


def hf_tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
  """Every tensor name a HF checkpoint of this config holds, with its (torch) shape."""
  shapes = {"model.embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size),
            "model.norm.weight": (cfg.hidden_size,)}
  if not cfg.tie_word_embeddings:
    shapes["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
  per_layer = layer_hf_shapes(cfg)
  for i in range(cfg.num_layers):
    for suffix, shape in per_layer.items():
      shapes[f"model.layers.{i}.{suffix}"] = shape
  return shapes


def hf_to_ours_layer(suffix: str, w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
  """One layer's HF tensor (named by its suffix) -> our per-layer layout (before stacking)."""
  d, h, k, dh = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  if suffix == "self_attn.q_proj.weight":
    return w.T.reshape(d, h, dh)
  if suffix in ("self_attn.k_proj.weight", "self_attn.v_proj.weight"):
    return w.T.reshape(d, k, dh)
  if suffix == "self_attn.o_proj.weight":
    return w.T.reshape(h, dh, d)
  if suffix == "self_attn.q_proj.bias":
    return w.reshape(h, dh)
  if suffix in ("self_attn.k_proj.bias", "self_attn.v_proj.bias"):
    return w.reshape(k, dh)
  if suffix.startswith("mlp."):
    return w.T
  return w


def ours_to_hf_layer(suffix: str, w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
  """The inverse of hf_to_ours_layer: one layer's slice of our tree -> the HF tensor."""
  d, h, dh = cfg.hidden_size, cfg.num_heads, cfg.head_dim
  if suffix in ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                "self_attn.v_proj.weight"):
    return w.reshape(d, -1).T
  if suffix == "self_attn.o_proj.weight":
    return w.reshape(h * dh, d).T
  if suffix.endswith("_proj.bias"):   # o_proj's is (D,) in both layouts
    return w.reshape(-1)
  if suffix.startswith("mlp."):
    return w.T
  return w


def validate_tensor_shapes(found: Mapping[str, tuple[int, ...]], cfg: ModelConfig,
                           where: str, display: Mapping[str, str] | None = None) -> None:
  """Raises CheckpointError listing every missing, unexpected or mis-shaped tensor.

  display: HF name -> the name to report (e.g. the GGUF file's own tensor names).
  """
  show = lambda n: display.get(n, n) if display else n  # noqa: E731
  expected = hf_tensor_shapes(cfg)
  found = {n: tuple(s) for n, s in found.items() if not _IGNORED_HF_TENSORS.fullmatch(n)}
  if cfg.tie_word_embeddings and "lm_head.weight" in found:
    # Some exporters write the tied head anyway; it is checked equal to the embedding on load.
    expected = dict(expected, **{"lm_head.weight": (cfg.vocab_size, cfg.hidden_size)})
  problems = []
  missing = [n for n in expected if n not in found]
  extra = [n for n in found if n not in expected]
  if missing:
    problems.append(f"missing tensor(s): {', '.join(missing)}")
  if extra:
    problems.append(f"unexpected tensor(s) not in the {cfg.architecture} layout: "
                    f"{', '.join(show(n) for n in extra)}")
  for n, shape in expected.items():
    if n in found and found[n] != shape:
      problems.append(f"tensor {show(n)} has shape {found[n]}, expected {shape} from the config")
  if problems:
    raise CheckpointError(f"checkpoint {where} does not match its config:\n  " + "\n  ".join(problems))


def hf_to_params(get: Callable[[str], np.ndarray], cfg: ModelConfig, dtype=None) -> dict:
  """Builds our tree from HF-named tensors. `get(name)` returns one tensor (already validated)."""
  cast = (lambda x: x) if dtype is None else (lambda x: x.astype(np.dtype(dtype), copy=False))
  layers: dict = {}
  for path, suffix in layer_tensors(cfg):
    stacked = np.stack([hf_to_ours_layer(suffix, get(f"model.layers.{i}.{suffix}"), cfg)
                        for i in range(cfg.num_layers)])
    node = layers
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = cast(stacked)
  params = {"embed": {"embedding": cast(np.ascontiguousarray(get("model.embed_tokens.weight")))},
            "layers": layers,
            "final_norm": {"scale": cast(get("model.norm.weight"))}}
  if not cfg.tie_word_embeddings:
    params["lm_head"] = {"kernel": cast(np.ascontiguousarray(get("lm_head.weight").T))}
  return params


def params_to_hf(params: Mapping[str, Any], cfg: ModelConfig) -> dict[str, np.ndarray]:
  """Our tree -> HF-named, contiguous numpy tensors (same dtypes)."""
  _check_param_tree(params, cfg)
  out = {"model.embed_tokens.weight": np.asarray(params["embed"]["embedding"]),
         "model.norm.weight": np.asarray(params["final_norm"]["scale"])}
  if not cfg.tie_word_embeddings:
    out["lm_head.weight"] = np.asarray(params["lm_head"]["kernel"]).T
  for path, suffix in layer_tensors(cfg):
    leaf = params["layers"]
    for key in path:
      leaf = leaf[key]
    leaf = np.asarray(leaf)
    for i in range(cfg.num_layers):
      out[f"model.layers.{i}.{suffix}"] = ours_to_hf_layer(suffix, leaf[i], cfg)
  return {n: np.ascontiguousarray(t) for n, t in out.items()}


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
  flat = {}
  for k, v in tree.items():
    if isinstance(v, Mapping):
      flat.update(_flatten(v, f"{prefix}{k}/"))
    else:
      flat[f"{prefix}{k}"] = v
  return flat


def _check_param_tree(params: Mapping[str, Any], cfg: ModelConfig) -> None:
  expected = {k: tuple(s.shape) for k, s in _flatten(param_shapes(cfg)).items()}
  found = {k: tuple(np.shape(v)) for k, v in _flatten(params).items()}
  problems = [f"missing param {k}" for k in expected if k not in found]
  problems += [f"unexpected param {k}" for k in found if k not in expected]
  problems += [f"param {k} has shape {found[k]}, expected {s}"
               for k, s in expected.items() if k in found and found[k] != s]
  if problems:
    raise CheckpointError("params do not match the config:\n  " + "\n  ".join(problems))
