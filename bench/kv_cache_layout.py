"""Benchmark: one decode step with a per-layer KV cache (what the generation engine holds) vs the
stacked [L, B, K, S, Dh] cache, on SmolLM2-135M (fp32, decode-layout weights).

Both sides run the same jitted program text, `transformer.decode` + `logits` + argmax for one new
token per slot, compiled with the engine's generate options for B slots, the cache donated; only
the cache's form differs (`init_cache(..., per_layer=False/True)`; the per-layer form also stores
each layer's keys transposed, [B, K, Dh, S], for the T = 1 score product). Every slot sits at position
S // 2 (the step attends over the whole cache buffer either way; the mask hides the rest). For
each cache length S, the two programs run in alternating rounds in one process (a shared host
drifts in speed over minutes) and the median round is reported.

Why it matters: with the stacked cache, each layer's attention reads a slice of the stack, and
XLA:CPU materialises that slice (a copy of the layer's whole cache) every step, so the step grows
with S at more than the cost of attention itself.

Last line: one JSON object; `per_layer_speedup` is at the largest S.
"""
import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--batch", type=int, default=16)
  ap.add_argument("--lengths", default="136,288,528", help="cache lengths S to measure")
  ap.add_argument("--rounds", type=int, default=6)
  ap.add_argument("--steps", type=int, default=4, help="decode steps timed per round")
  args = ap.parse_args()

  from magistral_jax.generate import engine as E
  from magistral_jax.model.gguf_checkpoint import load_gguf
  from magistral_jax.model.gguf_file import default_gguf_path
  from magistral_jax.model import transformer as T
  cfg, params, _ = load_gguf(default_gguf_path(), with_tokenizer=False)
  p = jax.jit(T.to_decode_layout)(params)
  b = args.batch

  def step(p, tok, cache):
    x, cache = T.decode(p, cfg, tok[:, None], cache)
    return jnp.argmax(T.logits(p, cfg, x[:, 0]), -1).astype(jnp.int32), cache

  opts = E.generate_compiler_options(jax.default_backend(), b)
  f = jax.jit(step, donate_argnums=(2,), compiler_options=opts)
  results = {}
  for s in [int(x) for x in args.lengths.split(",")]:
    pos = lambda: jnp.full((b,), s // 2, jnp.int32)   # a fresh array: the cache is donated
    state = {}
    for form, per_layer in (("stacked", False), ("per_layer", True)):
      c = T.init_cache(cfg, b, s, per_layer=per_layer)._replace(lengths=pos())
      tok, c = f(p, jnp.zeros((b,), jnp.int32), c)
      jax.block_until_ready(c)
      state[form] = [tok, c]
    times = {k: [] for k in state}
    for _ in range(args.rounds):
      for form, st in state.items():
        t = time.perf_counter()
        for _ in range(args.steps):   # rewind each slot so every step attends at S // 2
          st[0], st[1] = f(p, st[0], st[1]._replace(lengths=pos()))
        jax.block_until_ready(st[1])
        times[form].append((time.perf_counter() - t) / args.steps)
    r = {f"{k}_step_ms": 1e3 * float(np.median(v)) for k, v in times.items()}
    r["per_layer_speedup"] = r["stacked_step_ms"] / r["per_layer_step_ms"]
    results[s] = r
    print(json.dumps({"S": s, **r}), flush=True)

  last = results[max(results)]
  print(json.dumps({
      "machine": f"cpu x{os.cpu_count()}", "loadavg": open("/proc/loadavg").read().split()[:3],
      "jax_backend": jax.default_backend(), "model": "SmolLM2-135M-Instruct fp32", "batch": b,
      "per_layer_speedup": last["per_layer_speedup"],
      "by_cache_length": {str(k): v for k, v in results.items()}}))


if __name__ == "__main__":
  main()
