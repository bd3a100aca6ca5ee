"""Benchmark: the trainer -> generator weight push (Rollouts.push for one generator:
transfer_params, then Engine.load_params) against a device_put copy of the bytes received.
One shared device, or `--reshard`: trainer FSDP over 4 of 8 devices, two generators tensor-parallel
over 2 each (the push reshards onto generator 0, the copy moves its params onto generator 1).

  python bench/weight_push.py [--models smollm2,llama1b] [--reshard]

Last line, one JSON object, per model: push_over_copy_time, push_GBps, push_s, copy_s.
"""
import sys

import common

if "--reshard" in sys.argv:
  common.use_cpu_devices(8)   # no-op where XLA_FLAGS already sets a count

import jax  # noqa: E402

from magistral_jax.generate.config import SamplingConfig  # noqa: E402
from magistral_jax.generate.engine import Engine  # noqa: E402
from magistral_jax.model import named  # noqa: E402
from magistral_jax.model import transformer as T  # noqa: E402
from magistral_jax.parallel.sharding import make_mesh  # noqa: E402
from magistral_jax.parallel.config import TRAINER_RULES  # noqa: E402
from magistral_jax.generate.weights import transfer_params  # noqa: E402


def tree_bytes(tree) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def bench_model(name: str, args) -> dict:
  cfg, _, source, _ = named.load_model(name, args.param_dtype, weights="random")
  devs = jax.devices()
  if args.reshard and len(devs) < 8:
    raise SystemExit(f"--reshard needs 8 devices (trainer 4, two generators 2 each), "
                     f"{len(devs)} here")
  tdev, gdevs = (devs[:4], [devs[4:6], devs[6:8]]) if args.reshard else (devs[:1], [devs[:1]])
  trainer_sh = T.params_on(cfg, make_mesh({"fsdp": len(tdev)}, tdev), TRAINER_RULES)
  master = named.random_params(cfg, trainer_sh)
  gen_cfg = cfg.replace(param_dtype=args.gen_dtype, dtype=args.gen_dtype)
  engs = [Engine(gen_cfg, make_mesh({"tensor": len(d)}, d), max_concurrent_decodes=8,
                 max_prefill_length=64, max_decode_length=64, prefill_buckets=(64,),
                 sampling=SamplingConfig(greedy=True, max_new_tokens=64, eos_id=None),
                 compact_sizes=()) for d in gdevs]
  eng, other = engs[0], engs[-1]
  received = jax.block_until_ready(transfer_params(master, eng))   # what the generator gets
  # A push as Rollouts.push does it for one generator: transfer_params, then update_params's
  # Engine.load_params (finiteness check, per-layer decode layout) on the generator's devices.
  t = common.time_rounds({"push": lambda: eng.load_params(transfer_params(master, eng)),
                          "copy": lambda: jax.device_put(received, other.param_shardings,
                                                         may_alias=False)},
                         args.reps, warmup=2)
  p, c = t["push"].median, t["copy"].median
  nbytes = tree_bytes(received)
  return {"model": source, "params": cfg.num_params(), "master_bytes": tree_bytes(master),
          "pushed_bytes": nbytes, "push_s": p, "copy_s": c, "push_over_copy_time": p / c,
          "push_GBps": nbytes / p / 1e9, "copy_GBps": 2 * nbytes / c / 1e9}


def main(argv=None):
  args = common.argument_parser(
      __doc__, models="smollm2,llama1b", param_dtype=("float32", "the trainer's master weights"),
      gen_dtype=("bfloat16", "the generator's weights"), reps=10,
      reshard=(False, "trainer FSDP-4 -> generators TP-2")).parse_args(argv)
  dev = jax.devices()[0]
  result = {"device": dev.device_kind, "platform": dev.platform, "jax": jax.__version__,
            "param_dtype": args.param_dtype, "gen_dtype": args.gen_dtype,
            "reshard": args.reshard}
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
