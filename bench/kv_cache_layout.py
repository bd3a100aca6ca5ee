"""Benchmark: one SmolLM2-135M decode step with the engine's per-layer KV cache against the
stacked [L, B, K, S, Dh] cache (the same jitted step; init_cache per_layer), per cache length S.

  python bench/kv_cache_layout.py

Last line, one JSON object: per-S step times and per_layer_speedup at the largest S.
"""
import common
import jax
import jax.numpy as jnp


def main():
  from magistral_jax.model import named
  args = common.argument_parser(
      __doc__, batch=16, lengths=("136,288,528", "cache lengths S to measure"), rounds=6,
      steps=(4, "decode steps timed per round")).parse_args()

  from magistral_jax.generate import xla_cpu as E
  from magistral_jax.model import transformer as T
  cfg, params, _, _ = named.load_model("smollm2", "float32", "gguf")
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

    def one(st):   # rewinds the slots, so that every step attends at S // 2
      st = f(p, st[0], st[1]._replace(lengths=pos()))
      return st, None
    stepper = lambda per_layer: common.Carry(
        (jnp.zeros((b,), jnp.int32), T.init_cache(cfg, b, s, per_layer=per_layer))).step(one)
    times = common.time_rounds({"stacked": stepper(False), "per_layer": stepper(True)},
                               args.rounds, calls=args.steps)
    r = {f"{k}_step_ms": 1e3 * v.median for k, v in times.items()}
    r["per_layer_speedup"] = r["stacked_step_ms"] / r["per_layer_step_ms"]
    results[s] = r
    common.emit({"S": s, **r})

  last = results[max(results)]
  common.emit({
      **common.host_info(),
      "jax_backend": jax.default_backend(), "model": "SmolLM2-135M-Instruct fp32", "batch": b,
      "per_layer_speedup": last["per_layer_speedup"],
      "by_cache_length": {str(k): v for k, v in results.items()}})


if __name__ == "__main__":
  main()
