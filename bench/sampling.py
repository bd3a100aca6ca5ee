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
  ap = common.argument_parser(__doc__)
  common.add_flags(ap, batches="16,64", vocab=49152, rounds=7, skip_engine=False)
  args = ap.parse_args()
  settings = [(0, 1.0), (0, 0.95), (0, 0.7), (50, 1.0), (50, 0.95), (1000, 1.0)]
  runs = []
  for b in [int(x) for x in args.batches.split(",")]:
    rs = np.random.RandomState(b)
    # Gaussian logits, std 2.5: a wide nucleus, as an RL policy's at temperature 1.
    lg = jnp.asarray((rs.randn(b, args.vocab) * 2.5).astype(np.float32))
    keys = jax.vmap(jax.random.PRNGKey)(jnp.arange(b))
    for top_k, top_p in settings:
      fns = {"ours": sampler(xla_cpu.truncate, xla_cpu.draw, top_k, top_p),
             "sort": sampler(S.truncate, gumbel_draw, top_k, top_p)}
      t = common.time_rounds({k: (lambda f=f: f(lg, keys)) for k, f in fns.items()}, args.rounds,
                             calls=3, alternate=True)
      outs = {k: v.result for k, v in t.items()}
      equal = bool((np.asarray(outs["ours"][1]) == np.asarray(outs["sort"][1])).all())
      med = {k: 1e3 * v.median for k, v in t.items()}
      r = {"batch": b, "top_k": top_k, "top_p": top_p, "ours_ms": med["ours"],
           "sort_ms": med["sort"], "speedup_vs_sort": med["sort"] / med["ours"],
           "masks_equal": equal, "kept_mean": float(np.asarray(outs["ours"][1]).sum(-1).mean())}
      runs.append(r)
      common.emit(r)
    # Greedy: the blocked argmax against jnp.argmax (XLA:CPU's (value, index) pair reduction).
    fns = {"ours": jax.jit(xla_cpu.argmax), "jnp": jax.jit(lambda x: jnp.argmax(x, -1))}
    t = common.time_rounds({k: (lambda f=f: f(lg)) for k, f in fns.items()}, args.rounds,
                           calls=3, alternate=True)
    same = bool((np.asarray(t["ours"].result) == np.asarray(t["jnp"].result)).all())
    r = {"batch": b, "argmax": True, "ours_ms": 1e3 * t["ours"].median,
         "sort_ms": 1e3 * t["jnp"].median, "speedup_vs_sort": t["jnp"].median / t["ours"].median,
         "masks_equal": same}
    runs.append(r)
    common.emit(r)
  result = {"machine": f"{jax.default_backend()} x{os.cpu_count()}", "vocab": args.vocab,
            "runs": runs,
            "speedup_vs_sort_min": min(r["speedup_vs_sort"] for r in runs),
            "masks_equal": all(r["masks_equal"] for r in runs)}
  if not args.skip_engine:
    b = int(args.batches.split(",")[0])
    result["engine_batch"] = b
    result["engine_step_ms"] = engine_steps(b, args.rounds)
  common.emit(result)


if __name__ == "__main__":
  main()
