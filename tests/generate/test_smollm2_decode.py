"""The engine on the real SmolLM2-135M-Instruct weights: greedy equals transformers' greedy.

Kept lean (one prompt, one engine, one slot) because loading both models takes ~30 s.
"""
import os

import jax
import jax.numpy as jnp
import numpy as np
import torch

from magistral_jax.generate.config import SamplingConfig
from magistral_jax.generate.engine import Engine
from magistral_jax.generate.loop import GeneratorLoop
from magistral_jax.generate.requests import Request
from magistral_jax.model.gguf_checkpoint import load_gguf
from magistral_jax.model.gguf_file import default_gguf_path
from magistral_jax.model import transformer as T
from magistral_jax.parallel.sharding import make_mesh


def test_engine_greedy_32_tokens_identical_to_transformers_with_exact_logprobs():
  import transformers
  path = default_gguf_path()
  cfg, params, tok = load_gguf(path)
  ids = tok.encode("The capital of France is")
  eng = Engine(cfg, make_mesh({"tensor": 1}, jax.devices()[:1]), max_concurrent_decodes=1,
               max_prefill_length=16, max_decode_length=32, prefill_buckets=(16,),
               sampling=SamplingConfig(greedy=True, max_new_tokens=32))
  loop = GeneratorLoop(eng, params, sampling=eng.sampling)
  loop.submit(Request("p", ids))
  (c,) = loop.run_until_idle()

  hf = transformers.AutoModelForCausalLM.from_pretrained(
      os.path.dirname(path), gguf_file=os.path.basename(path), torch_dtype=torch.float32)
  hf.eval()
  with torch.no_grad():
    ref = hf.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                      eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
  assert c.tokens == ref

  # π_old from the engine is the trainer's π_θ recomputed by the scoring forward.
  seq = jnp.asarray([ids + c.tokens])
  lp = jax.jit(lambda p, s: T.token_logprobs(p, cfg, T.hidden_states(p, cfg, s)[:, :-1],
                                             s[:, 1:]))(params, seq)
  np.testing.assert_allclose(c.logprobs, np.asarray(lp[0, len(ids) - 1:]), rtol=0, atol=1e-4)
