"""Benchmark: a HF safetensors checkpoint (random bf16 weights) onto the trainer's FSDP mesh of
8 CPU devices, load + device_put against load_hf_sharded, each in a fresh process: load time and
peak resident memory above the params (VmHWM - VmRSS).

  python bench/hf_load.py [--shape llama1b|smollm2] [--repeats 1] [--dir DIR]

Last line, one JSON object: params_mb, baseline/sharded load_s and *_overhead_mb, speed_ratio.
"""
import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import common

common.use_cpu_devices(8)   # the trainer's mesh in the child processes (they inherit XLA_FLAGS)

SHAPES = ("llama1b", "smollm2")


def child(loader: str, path: str) -> None:
  """One load in this process; prints its figures as one JSON line."""
  import jax
  from magistral_jax.model import transformer as T
  from magistral_jax.model.hf_checkpoint import load_hf_safetensors
  from magistral_jax.model.hf_sharded import load_hf_sharded
  from magistral_jax.parallel.config import TRAINER_RULES
  from magistral_jax.parallel.sharding import make_mesh
  mesh = make_mesh({"fsdp": -1})
  jax.block_until_ready(jax.jit(lambda: jax.numpy.zeros(8))())   # the runtime, before the mark
  before_kb = common.proc_status_kb("VmRSS")
  t = time.perf_counter()
  if loader == "baseline":
    cfg, host = load_hf_safetensors(path)
    shardings = T.params_on(cfg, mesh, TRAINER_RULES)
    params = jax.block_until_ready(jax.device_put(host, shardings))
  else:
    params = jax.block_until_ready(load_hf_sharded(path, mesh, TRAINER_RULES)[1])
  common.emit({"loader": loader, "load_s": time.perf_counter() - t,
               "peak_mb": (common.proc_status_kb("VmHWM") - before_kb) / 1024,
               "params_mb": sum(x.nbytes for x in jax.tree.leaves(params)) / 2**20,
               "devices": len(mesh.devices.flat)})


def write_checkpoint(shape: str, path: str) -> float:
  """Random bf16 weights of `shape` into `path`; returns the weight files' GB."""
  import jax
  import ml_dtypes
  import numpy as np
  from magistral_jax.model import config as model_config
  from magistral_jax.model import transformer as T
  from magistral_jax.model.hf_checkpoint import save_hf_safetensors
  cfg = (model_config.LLAMA_3_2_1B if shape == "llama1b" else model_config.SMOLLM2_135M)
  cfg = cfg.replace(param_dtype="bfloat16")
  rng = np.random.default_rng(0)
  # Finite bf16 of either sign and a modest magnitude: random bits below the exponent's top.
  params = jax.tree.map(lambda s: (rng.integers(0, 1 << 14, s.shape, np.uint16) |
                                   (rng.integers(0, 2, s.shape, np.uint16) << 15)).view(
                                       ml_dtypes.bfloat16), T.param_shapes(cfg))
  files = save_hf_safetensors(params, cfg, path)
  return sum(os.path.getsize(f) for f in files) / 1e9


def main():
  p = common.argument_parser(
      __doc__, shape=list(SHAPES), repeats=1,
      dir=(str, "where to write the checkpoint (kept if given)"), path=(str, argparse.SUPPRESS))
  p.add_argument("--child", choices=("baseline", "sharded"), help=argparse.SUPPRESS)
  args = p.parse_args()
  if args.child:
    return child(args.child, args.path)
  work = args.dir or tempfile.mkdtemp(prefix="hf_load_bench_")
  try:
    path = os.path.join(work, f"{args.shape}_bf16")
    t, checkpoint_gb = common.time_once(lambda: write_checkpoint(args.shape, path), block=False)
    print(f"wrote {checkpoint_gb:.2f} GB to {path} in {t:.1f}s", file=sys.stderr)
    runs = {"baseline": [], "sharded": []}
    for r in range(args.repeats):
      for loader in (("baseline", "sharded") if r % 2 == 0 else ("sharded", "baseline")):
        runs[loader].append(common.run_json([sys.executable, os.path.abspath(__file__),
                                             "--child", loader, "--path", path]))
        print(json.dumps(runs[loader][-1]), file=sys.stderr)
  finally:
    if args.dir is None:
      shutil.rmtree(work, ignore_errors=True)
  med = {k: {f: statistics.median(x[f] for x in v) for f in ("load_s", "peak_mb", "params_mb")}
         for k, v in runs.items()}
  over = {k: m["peak_mb"] - m["params_mb"] for k, m in med.items()}   # beyond the params
  res = {
      "shape": args.shape, "checkpoint_gb": checkpoint_gb, "params_mb": med["sharded"]["params_mb"],
      "mesh": {"fsdp": runs["sharded"][0]["devices"]}, "repeats": args.repeats,
      **{f"{k}_peak_rss_mb": m["peak_mb"] for k, m in med.items()},
      "rss_ratio": med["sharded"]["peak_mb"] / med["baseline"]["peak_mb"],
      **{f"{k}_overhead_mb": v for k, v in over.items()},
      "overhead_ratio": over["sharded"] / over["baseline"],
      **{f"{k}_load_s": m["load_s"] for k, m in med.items()},
      "speed_ratio": med["baseline"]["load_s"] / med["sharded"]["load_s"],
      "goal": "sharded_overhead_mb <= baseline_overhead_mb / 4 and speed_ratio >= 1",
      **common.host_info(),
  }
  res["goal_met"] = bool(res["overhead_ratio"] <= 0.25 and res["speed_ratio"] >= 1)
  common.emit(res, ndigits=3)


if __name__ == "__main__":
  main()
