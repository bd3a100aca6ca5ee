"""The paper's RL ablations (paper §6) at tiny scale: each variant runs launch/train.py from the
same cold-start SFT checkpoint for the same batches, against the paper's default (each ablation's
first variant).

  python bench/ablations.py [--which=clip --batches=20 --seeds=0]

Outputs: ROOT/<ablation>/<variant>-s<seed>/, docs/ablations/<ablation>.png,
docs/ablations/results.json; last line, one JSON object with each ablation's headline figure.
"""
from __future__ import annotations

import json
import os
import sys

import common
import numpy as np

from magistral_jax.analysis.report import load_run_metrics

ROOT = common.ROOT

# Each ablation's headline in the last line: its key, and the per-variant figure it averages.
HEADLINES = {"clip": ("clip_entropy_last_third", "entropy_last_third"),
             "adv_norm": ("adv_norm_reward_last_third", "reward_last_third"),
             "async": ("async_sync_reward_last_third", "reward_last_third"),
             "minibatch": ("minibatch_heldout_after", "heldout_accuracy_after")}
ABLATIONS = {
    "clip": [("eps_high_0.28", "eps_high=0.28"), ("eps_high_0.20", "eps_high=0.2")],
    "adv_norm": [("minibatch", "adv_norm=minibatch"), ("group", "adv_norm=group"),
                 ("none", "adv_norm=none")],
    "async": [("async", "mode=async"), ("sync", "mode=sync")],
    "minibatch": [("1_mini", "n_mini_per_batch=1"), ("2_mini", "n_mini_per_batch=2"),
                  ("8_mini", "n_mini_per_batch=8")],
}


def run(argv, log_path):
  # No persistent compilation cache (config.compilation_cache_dir) unless the caller set one:
  # every variant and seed compiles its own programs, so wall times compare.
  return common.run_logged(argv, log_path,
                           env={"JAX_COMPILATION_CACHE_DIR": "", **os.environ})


def tiny_config(*args: str) -> str:
  """`--config=configs/tiny.py[:a,b]` from the non-empty comma-separated argument lists."""
  joined = ",".join(a for a in args if a)
  return "--config=configs/tiny.py" + (f":{joined}" if joined else "")


def ensure_sft(root: str, sft_steps: int | None, base_arg: str = "") -> str:
  """The shared cold-start checkpoint (ROOT/sft/params), made once."""
  wd = os.path.join(root, "sft")
  if os.path.isdir(os.path.join(wd, "params")):
    return wd
  os.makedirs(wd, exist_ok=True)
  print(f"cold-start SFT -> {wd}", flush=True)
  dt = run([sys.executable, "launch/sft.py",
            tiny_config(base_arg, f"sft_steps={sft_steps}" if sft_steps else ""),
            f"--workdir={wd}"],
           os.path.join(wd, "log.txt"))
  print(f"  done in {dt:.0f}s", flush=True)
  return wd


def read_json(path: str):
  with open(path) as f:
    return json.load(f)


def variant_stats(workdir: str, wall_s: float) -> dict:
  rows = [r for r in load_run_metrics(workdir)[1] if "reward" in r]
  summary = read_json(os.path.join(workdir, "summary.json"))
  thirds = {"first_third": rows[:max(1, len(rows) // 3)], "last_third": rows[len(rows) * 2 // 3:]
            or rows}
  mean = lambda key, rs: float(np.mean([r[key] for r in rs if key in r])) if rs else float("nan")
  n_batch = read_json(os.path.join(workdir, "config.json"))["rl"]["n_batch"]
  # Trained-on completions per second between the first and the last batch (start-up excluded).
  samples = n_batch * (len(rows) - 1)
  rl_time = float(rows[-1]["time"] - rows[0]["time"]) if len(rows) > 1 else 0.0
  return {
      **{k: summary.get(k) for k in ("heldout_accuracy_before", "heldout_accuracy_after",
                                     "format_rate")},
      **{f"{k}_{t}": mean(k, rs) for k in ("reward", "entropy") for t, rs in thirds.items()},
      "clip_high_frac": mean("clip_high_frac", rows), "clip_low_frac": mean("clip_low_frac", rows),
      "samples": samples, "rl_time_s": rl_time,
      "samples_per_s": samples / rl_time if rl_time else float("nan"), "wall_s": wall_s,
      "curves": {k: [r.get(k) for r in rows] for k in ("reward", "entropy", "accuracy",
                                                      "response_length_mean", "time")},
  }


def plot(name: str, results: dict, out_dir: str) -> str:
  import matplotlib
  matplotlib.use("Agg")
  from magistral_jax.analysis.plots import ablation_curves
  path = os.path.join(out_dir, f"{name}.png")
  ablation_curves(name, {v: [s["curves"] for s in per_seed] for v, per_seed in results.items()}
                  ).savefig(path, dpi=80)
  return path


def main():
  ap = common.argument_parser(__doc__)
  ap.add_argument("--which", default="clip,adv_norm,async,minibatch")
  ap.add_argument("--batches", type=int, default=30, help="RL batches per variant")
  ap.add_argument("--seeds", default="0", help="comma-separated RL seeds per variant")
  ap.add_argument("--root", default=os.path.join(ROOT, "runs", "ablations"))
  ap.add_argument("--docs", default=os.path.join(ROOT, "docs", "ablations"))
  ap.add_argument("--sft_steps", type=int, default=0, help="0 = configs/tiny.py's sft.num_steps")
  ap.add_argument("--sft_params", default="",
                  help="an existing cold-start params dir (launch/sft.py WORKDIR/params) to share")
  ap.add_argument("--heldout", type=int, default=64)
  ap.add_argument("--base_arg", default="slip=0,n_mini_per_batch=1",
                  help="configs/tiny.py arguments under every variant (and the shared cold start): "
                       "the paper's setting, n_batch = n_mini, on clean cold-start traces")
  args = ap.parse_args()
  which = [w for w in args.which.split(",") if w]
  for w in which:
    if w not in ABLATIONS:
      sys.exit(f"--which: unknown ablation {w!r}; choose from {sorted(ABLATIONS)}")
  seeds = [int(s) for s in args.seeds.split(",")]
  root = os.path.abspath(args.root)
  os.makedirs(args.docs, exist_ok=True)
  sft = os.path.dirname(os.path.abspath(args.sft_params)) if args.sft_params else ensure_sft(
      root, args.sft_steps or None, args.base_arg)
  all_results = {}
  headline = {}
  for name in which:
    results = {}
    for variant, arg in ABLATIONS[name]:
      for seed in seeds:
        wd = os.path.join(root, name, f"{variant}-s{seed}")
        summary = os.path.join(wd, "summary.json")
        if not os.path.exists(summary) or "heldout_accuracy_after" not in read_json(summary):
          os.makedirs(wd, exist_ok=True)
          print(f"[{name}] {variant} seed {seed} -> {wd}", flush=True)
          wall = run([sys.executable, "launch/train.py", tiny_config(args.base_arg, arg),
                      f"--workdir={wd}", "--config.init.source=orbax",
                      f"--config.init.path={os.path.join(sft, 'params')}",
                      f"--config.num_batches={args.batches}", f"--config.seed={seed}",
                      f"--config.data.heldout={args.heldout}"],
                     os.path.join(wd, "log.txt"))
        else:
          wall = read_json(summary).get("wall_time_s", 0.0)
        results.setdefault(variant, []).append(variant_stats(wd, wall))
        s = results[variant][-1]
        print(f"  {variant} s{seed}: reward {s['reward_first_third']:.3f} -> "
              f"{s['reward_last_third']:.3f} | entropy {s['entropy_first_third']:.3f} -> "
              f"{s['entropy_last_third']:.3f} | held-out {s['heldout_accuracy_before']:.3f} -> "
              f"{s['heldout_accuracy_after']:.3f} | {s['samples_per_s']:.1f} samples/s",
              flush=True)
    plot(name, results, args.docs)
    all_results[name] = {v: [{k: x for k, x in s.items() if k != "curves"} for s in per]
                         for v, per in results.items()}
    avg = lambda v, key: float(np.mean([s[key] for s in results[v]]))
    key, figure = HEADLINES[name]
    headline[key] = {v: avg(v, figure) for v in results}
    if name == "async":
      headline["async_over_sync_samples_per_s"] = avg("async", "samples_per_s") / avg(
          "sync", "samples_per_s")
    headline[f"{name}_baseline"] = ABLATIONS[name][0][0]
  with open(os.path.join(args.docs, "results.json"), "w") as f:
    json.dump({"batches": args.batches, "seeds": seeds, "results": all_results}, f, indent=1)
  common.emit(headline)


if __name__ == "__main__":
  main()
