"""Benchmark: the sampler's CPU truncation and draw (xla_cpu.truncate + draw) against jax's own,
the path off CPU (sampling.truncate's lax.top_k sort and a Gumbel-max draw), on [B, V] fp32
logits per (top_k, top_p); the masks must agree. Unless --skip_engine, SmolLM2-135M's whole
engine step too, greedy and sampled.

  python bench/sampling.py [--batches 8,64]

Last line, one JSON object: ours_ms, sort_ms, masks_equal, kept_mean, engine_step_ms.
"""
import os

import common
import jax
import jax.numpy as jnp
import numpy as np

from magistral_jax.generate import sampling as S, xla_cpu


def sampler(truncate, draw, top_k, top_p):
  def f(lg, keys):
    masked = truncate(lg, top_k, top_p)
    return draw(keys, masked), jnp.isfinite(masked)
  return jax.jit(f)


def gumbel_draw(keys, lg):
  """The baseline's draw, sampling.choose's off CPU: Gumbel-max over the whole row."""
  return jax.vmap(jax.random.categorical)(keys, lg).astype(jnp.int32)


def engine_steps(batch: int, rounds: int):
  from magistral_jax.model import named
  from magistral_jax.generate.config import SamplingConfig
  from magistral_jax.generate.engine import Engine
  from magistral_jax.parallel.sharding import make_mesh
  cfg, params, _, _ = named.load_model("smollm2", "float32", "gguf")
  steps = {}
  for name, samp in (("greedy", SamplingConfig(greedy=True)),
                     ("top_p_1.0", SamplingConfig(temperature=1.0)),
                     ("top_p_0.95", SamplingConfig(temperature=1.0, top_p=0.95))):
    eng = Engine(cfg, make_mesh({"tensor": 1}, jax.devices()[:1]), max_concurrent_decodes=batch,
                 max_prefill_length=128, max_decode_length=160, prefill_buckets=(128,),
                 sampling=samp, cpu_dot_library="ynnpack")
    p = eng.load_params(params)
    steps[name] = common.Carry(eng.set_active(eng.init_decode_state(), np.ones(batch, bool))
                               ).step(lambda s, eng=eng, p=p: eng.generate(p, s))
  # The warm-up call compiles each engine's step.
  times = common.time_rounds(steps, rounds, calls=3, alternate=True)
  return {k: 1e3 * t.median for k, t in times.items()}


def main():
  args = common.argument_parser(__doc__, batches="16,64", vocab=49152, rounds=7,
                                skip_engine=False).parse_args()
  settings = [(0, 1.0), (0, 0.95), (0, 0.7), (50, 1.0), (50, 0.95), (1000, 1.0)]
  runs = []
  for b in [int(x) for x in args.batches.split(",")]:
    rs = np.random.RandomState(b)
    # Gaussian logits, std 2.5: a wide nucleus, as an RL policy's at temperature 1.
    lg = jnp.asarray((rs.randn(b, args.vocab) * 2.5).astype(np.float32))
    keys = jax.vmap(jax.random.PRNGKey)(jnp.arange(b))
    # (ours, the baseline) per case: each (top_k, top_p) sampled; then greedy, the blocked argmax
    # against jnp.argmax (XLA:CPU's (value, index) pair reduction), whose output is the "mask".
    cases = {(k, p): (sampler(xla_cpu.truncate, xla_cpu.draw, k, p),
                      sampler(S.truncate, gumbel_draw, k, p)) for k, p in settings}
    cases["argmax"] = (jax.jit(xla_cpu.argmax), jax.jit(lambda x: jnp.argmax(x, -1)))
    for case, (ours, sort) in cases.items():
      greedy, xs = case == "argmax", (lg,) if case == "argmax" else (lg, keys)
      t = common.time_rounds({"ours": lambda: ours(*xs), "sort": lambda: sort(*xs)}, args.rounds,
                             calls=3, alternate=True)
      mask = {k: np.asarray(v.result if greedy else v.result[1]) for k, v in t.items()}
      r = {"batch": b, **({"argmax": True} if greedy else {"top_k": case[0], "top_p": case[1]}),
           "ours_ms": 1e3 * t["ours"].median, "sort_ms": 1e3 * t["sort"].median,
           "speedup_vs_sort": t["sort"].median / t["ours"].median,
           "masks_equal": bool((mask["ours"] == mask["sort"]).all())}
      if not greedy:
        r["kept_mean"] = float(mask["ours"].sum(-1).mean())
      runs.append(r)
      common.emit(r)
  result = {"machine": f"{jax.default_backend()} x{os.cpu_count()}", "vocab": args.vocab,
            "runs": runs, "speedup_vs_sort_min": min(r["speedup_vs_sort"] for r in runs),
            "masks_equal": all(r["masks_equal"] for r in runs)}
  if not args.skip_engine:
    b = int(args.batches.split(",")[0])
    result.update(engine_batch=b, engine_step_ms=engine_steps(b, args.rounds))
  common.emit(result)


if __name__ == "__main__":
  main()
