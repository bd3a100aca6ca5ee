"""Benchmark: the trainer -> generator weight push on one device against a plain copy of the
same bytes.

SmolLM2-135M and Llama-3.2-1B shapes (random init), `--param_dtype` trainer weights, a generator
Engine with `--gen_dtype` weights on the same device. push = Rollouts.push (transfer_params, then
Engine.load_params); copy = device_put(may_alias=False) of the bytes received. Alternating,
median of `--reps` after a warm-up.

  python bench/weight_push.py [--models smollm2,llama1b]

Last line, one JSON object: push_over_copy_time, push_GBps, both times per model.
"""
from __future__ import annotations

import common
import jax
import jax.numpy as jnp

from magistral_jax.generate.config import SamplingConfig
from magistral_jax.generate.engine import Engine
from magistral_jax.model import transformer as T
from magistral_jax.parallel.sharding import make_mesh, param_shardings
from magistral_jax.parallel.config import TRAINER_RULES
from magistral_jax.generate.weights import transfer_params


def tree_bytes(tree) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def bench_model(name: str, args) -> dict:
  from magistral_jax.model import named
  cfg, _, source, _ = named.load_model(name, args.param_dtype, weights="random")
  dev = jax.devices()[0]
  trainer_sh = param_shardings(T.param_logical_axes(cfg), make_mesh({"fsdp": 1}, [dev]),
                               TRAINER_RULES, T.param_shapes(cfg))
  master = named.random_params(cfg, trainer_sh)
  gen_cfg = cfg.replace(param_dtype=args.gen_dtype, dtype=args.gen_dtype)
  eng = Engine(gen_cfg, make_mesh({"tensor": 1}, [dev]), max_concurrent_decodes=8,
               max_prefill_length=64, max_decode_length=64, prefill_buckets=(64,),
               sampling=SamplingConfig(greedy=True, max_new_tokens=64, eos_id=None),
               compact_sizes=())
  received = jax.jit(lambda p: jax.tree.map(lambda x: x.astype(gen_cfg.jnp_param_dtype), p),
                     out_shardings=eng.param_shardings)(master)
  jax.block_until_ready(received)
  # A push as Rollouts.push does it for one generator: transfer_params, then update_params's
  # Engine.load_params (finiteness check, per-layer decode layout) on the generator's devices.
  t = common.time_rounds({"push": lambda: eng.load_params(transfer_params(master, eng)),
                          "copy": lambda: jax.device_put(received, eng.param_shardings,
                                                         may_alias=False)},
                         args.reps, warmup=2)
  p, c = t["push"].median, t["copy"].median
  nbytes = tree_bytes(received)
  return {"model": source, "params": cfg.num_params(), "master_bytes": tree_bytes(master),
          "pushed_bytes": nbytes, "push_s": p, "copy_s": c, "push_over_copy_time": p / c,
          "push_GBps": nbytes / p / 1e9, "copy_GBps": 2 * nbytes / c / 1e9}


def main(argv=None):
  ap = common.argument_parser(__doc__)
  ap.add_argument("--models", default="smollm2,llama1b")
  ap.add_argument("--param_dtype", default="float32", help="the trainer's master weights")
  ap.add_argument("--gen_dtype", default="bfloat16", help="the generator's weights")
  ap.add_argument("--reps", type=int, default=10)
  args = ap.parse_args(argv)
  dev = jax.devices()[0]
  result = {"device": dev.device_kind, "platform": dev.platform, "jax": jax.__version__,
            "param_dtype": args.param_dtype, "gen_dtype": args.gen_dtype}
  for name in args.models.split(","):
    r = bench_model(name, args)
    print(f"[{name}] push {r['push_s'] * 1e3:.2f} ms vs copy {r['copy_s'] * 1e3:.2f} ms "
          f"({r['pushed_bytes'] / 1e6:.0f} MB): {r['push_over_copy_time']:.2f}x", flush=True)
    result.update({f"{name}_{k}": v for k, v in r.items()})
  if dev.platform == "cpu":
    result.update(common.host_info())
  common.emit(result, ndigits=6)


if __name__ == "__main__":
  main()
