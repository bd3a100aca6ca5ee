"""A run's policy: its tokenizer, architecture and initial weights, from random init or a
checkpoint (GGUF, Hugging Face safetensors, orbax)."""
from __future__ import annotations

import os

from magistral_jax.model.char_tokenizer import char_tokenizer
from magistral_jax.model.config import InitConfig, ModelConfig
from magistral_jax.model.gguf_checkpoint import gguf_config, load_gguf
from magistral_jax.model.gguf_file import default_gguf_path, read_gguf
from magistral_jax.model.hf_checkpoint import load_hf_safetensors
from magistral_jax.model.hf_sharded import load_hf_sharded
from magistral_jax.model.orbax_params import read_orbax_config, restore_params_orbax
from magistral_jax.model.tokenizer import HFTokenizer, load_tokenizer
from magistral_jax.model import transformer
from magistral_jax.parallel.config import DEFAULT_RULES


# The fields of the run's `model` section a checkpoint's architecture does not replace: the
# run's dtypes, remat and head / attention knobs.
RUN_MODEL_FIELDS = ("param_dtype", "dtype", "remat", "logits_chunk", "logits_vocab_pieces",
                    "attention_impl", "attention_block_q", "attention_block_k",
                    "decode_attention")

def load_policy(model: ModelConfig, init: InitConfig, tokenizer: str = "char",
                load_weights: bool = True, mesh=None, rules=None):
  """(tokenizer, ModelConfig, initial params or None) of a run's policy: its `model`, `init` and
  `tokenizer` sections.

  init.source: random (`model`), gguf, hf or orbax (architecture from the checkpoint; the
  run's dtype/remat/logits_chunk/logits_vocab_pieces/attention_* kept). With load_weights=False
  only metadata is read (params is None): enough to build engines or abstract params, e.g. for
  analysing a run's checkpoints.

  mesh (and rules, default parallel.config.DEFAULT_RULES): where the params will live. An hf
  checkpoint is then loaded straight onto it, laid out by `rules` as train/step.py's init_state
  takes them, with no host copy of the whole model (model/hf_sharded.py); an orbax one is
  restored onto it by the processes that hold it (in a run of many, the trainer's: a generator
  process restores nothing); gguf returns its params as it does without a mesh.
  """
  src, path = init.source, init.path
  model_cfg = model
  keep = {f: getattr(model_cfg, f) for f in RUN_MODEL_FIELDS}
  params, tok = None, None
  if src == "gguf":   # architecture and vocabulary come from the file's metadata
    if load_weights:
      cfg_g, params, tok = load_gguf(path or None)
    else:
      gpath = path or default_gguf_path()
      gf = read_gguf(gpath)
      cfg_g, tok = gguf_config(gf, gpath), HFTokenizer.from_gguf_metadata(gf.metadata, gpath)
    model_cfg = cfg_g.replace(**keep)
  elif src == "hf":
    if load_weights and mesh is not None:
      cfg_h, params = load_hf_sharded(path, mesh, DEFAULT_RULES if rules is None else rules)
    elif load_weights:
      cfg_h, params = load_hf_safetensors(path)
    else:
      cfg_h = ModelConfig.from_hf_config(path)
    model_cfg = cfg_h.replace(**keep)
  elif src == "orbax":
    model_cfg = read_orbax_config(path).replace(**keep)
    if load_weights:
      sub = os.path.join(path, "params")
      params = restore_params_orbax(sub if os.path.isdir(sub) else path,
                                    **_onto(mesh, rules, model_cfg))
  if tok is None:
    tok = char_tokenizer() if tokenizer == "char" else load_tokenizer(tokenizer)
  if model_cfg.vocab_size < tok.vocab_size:
    raise ValueError(f"model vocab_size={model_cfg.vocab_size} < tokenizer vocab "
                     f"{tok.vocab_size} ({tokenizer})")
  model_cfg = model_cfg.replace(eos_token_id=tok.eos_id, bos_token_id=tok.bos_id)
  return tok, model_cfg, params


def _onto(mesh, rules, cfg: ModelConfig) -> dict:
  """restore_params_orbax's arguments that lay a checkpoint onto `mesh` by `rules` (none without a
  mesh: the default device)."""
  if mesh is None:
    return {}
  shardings = transformer.params_on(cfg, mesh, DEFAULT_RULES if rules is None else rules)
  return {"target_shardings": shardings,
          "processes": tuple(sorted({d.process_index for d in mesh.devices.flat}))}
