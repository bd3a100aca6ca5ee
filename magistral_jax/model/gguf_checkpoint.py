"""GGUF checkpoints (llama architecture): metadata -> ModelConfig, tensors -> our param tree.

llama.cpp names tensors its own way (blk.{i}.attn_q.weight, ...); they are mapped onto HF names
and then converted like a HF checkpoint (model/hf_layout.py), after dequantisation and undoing
llama.cpp's q/k row permutation. The file's vocabulary gives the tokenizer.
"""
from __future__ import annotations

import re

import numpy as np

from magistral_jax.model.config import ModelConfig, UnsupportedArchitectureError
from magistral_jax.model.gguf_file import GGUFFile, default_gguf_path, read_gguf
from magistral_jax.model.hf_layout import CheckpointError, hf_to_params, validate_tensor_shapes
from magistral_jax.model.tokenizer import HFTokenizer

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


def gguf_config(gf: GGUFFile, path: str = "") -> ModelConfig:
  """ModelConfig from a GGUF's llama.* metadata (the keys transformers maps the same way)."""
  arch = gf.get("general.architecture")
  if arch != "llama":
    raise UnsupportedArchitectureError(
        f"GGUF {path} has unsupported architecture {arch!r}; supported: 'llama' (Llama/Mistral); "
        "for other architectures (qwen2, qwen3) load the Hugging Face safetensors checkpoint")

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
  cfg = cfg.replace(param_dtype=np.dtype(dtype or np.float32).name)
  tokenizer = HFTokenizer.from_gguf_metadata(gf.metadata, path) if with_tokenizer else None
  return cfg, params, tokenizer
