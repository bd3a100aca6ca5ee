"""Policy checkpoints converted between HF safetensors, GGUF and orbax: what
launch/convert_checkpoint.py runs.

An orbax output directory holds `params/` (the orbax checkpoint) and `config.json` (HF format),
so orbax_to_hf can rebuild the config; its input is that directory (or its params/). gguf_to_hf
and gguf_to_orbax also write the GGUF's tokenizer (tokenizer.json, tokenizer_config.json).
"""
from __future__ import annotations

import json
import logging
import os

import jax
import numpy as np

from magistral_jax.model.config import ModelConfig
from magistral_jax.model.gguf_checkpoint import load_gguf
from magistral_jax.model.hf_checkpoint import load_hf_safetensors, save_hf_safetensors
from magistral_jax.model.orbax_params import (read_orbax_config, restore_params_orbax,
                                              save_params_orbax, to_numpy_tree)

log = logging.getLogger(__name__)

DIRECTIONS = ("hf_to_orbax", "orbax_to_hf", "gguf_to_hf", "gguf_to_orbax")
ORBAX_PARAMS = "params"


def _orbax_params_dir(path: str) -> str:
  sub = os.path.join(path, ORBAX_PARAMS)
  return sub if os.path.isdir(sub) else path


def _save_tokenizer(tokenizer, output: str) -> None:
  tokenizer.tokenizer.save(os.path.join(output, "tokenizer.json"))
  conf = {"bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token,
          "pad_token": tokenizer.tokenizer.id_to_token(tokenizer.pad_id),
          "add_bos_token": tokenizer.add_bos_default, "chat_template": tokenizer.chat_template}
  with open(os.path.join(output, "tokenizer_config.json"), "w") as f:
    json.dump(conf, f, indent=2)


def convert(direction: str, input: str | None, output: str, dtype: str | None = None,
            max_shard_bytes: int | None = None) -> ModelConfig:
  """Runs one conversion; returns the model config. Nothing is written if the input is bad."""
  if direction not in DIRECTIONS:
    raise ValueError(f"unknown direction {direction!r}; choose one of {DIRECTIONS}")
  if input is None and not direction.startswith("gguf_"):
    raise ValueError(f"--input is required for {direction}")
  tokenizer = None
  if direction == "hf_to_orbax":
    cfg, params = load_hf_safetensors(input, dtype=dtype)
  elif direction == "orbax_to_hf":
    cfg = read_orbax_config(_orbax_params_dir(input))
    params = to_numpy_tree(restore_params_orbax(_orbax_params_dir(input)))
    if dtype is not None:
      params = jax.tree.map(lambda x: x.astype(np.dtype(dtype)), params)
      cfg = cfg.replace(param_dtype=np.dtype(dtype).name)
  else:
    cfg, params, tokenizer = load_gguf(input, dtype=dtype)

  os.makedirs(output, exist_ok=True)
  if direction.endswith("_hf"):
    files = save_hf_safetensors(params, cfg, output, max_shard_bytes=max_shard_bytes)
    log.info("wrote %d safetensors file(s) to %s", len(files), output)
  else:
    save_params_orbax(os.path.join(output, ORBAX_PARAMS), params, cfg)
    log.info("wrote orbax checkpoint %s/%s (+ config.json)", output, ORBAX_PARAMS)
  if tokenizer is not None:
    _save_tokenizer(tokenizer, output)
  return cfg
