"""The paper's RL ablations (paper §6) at tiny scale: each variant runs launch/train.py from the
same cold-start SFT checkpoint for the same batches, against the paper's default (each ablation's
first variant).

  python bench/ablations.py [--which=clip --batches=20 --seeds=0]

Outputs: ROOT/<ablation>/<variant>-s<seed>/, docs/ablations/<ablation>.png,
docs/ablations/results.json; last line, one JSON object with each ablation's headline figure.
"""
import json
import os

import common
from common import read_json
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


def tiny_config(*args: str) -> str:
  """`--config=configs/tiny.py[:a,b]` from the non-empty comma-separated argument lists."""
  joined = ",".join(a for a in args if a)
  return "--config=configs/tiny.py" + (f":{joined}" if joined else "")


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
  ap = common.argument_parser(
      __doc__, which="clip,adv_norm,async,minibatch", batches=(30, "RL batches per variant"),
      seeds=("0", "comma-separated RL seeds per variant"),
      root=os.path.join(ROOT, "runs", "ablations"), docs=os.path.join(ROOT, "docs", "ablations"),
      sft_steps=(0, "0 = configs/tiny.py's sft.num_steps"),
      sft_params=("", "an existing cold-start params dir (launch/sft.py WORKDIR/params) to share"),
      heldout=64,
      base_arg=("slip=0,n_mini_per_batch=1", "configs/tiny.py arguments under every variant (and "
                "the shared cold start): the paper's setting, n_batch = n_mini, on clean "
                "cold-start traces"))
  args = ap.parse_args()
  # No persistent compilation cache (config.compilation_cache_dir) unless the caller set one:
  # every variant and seed compiles its own programs, so wall times compare.
  os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", "")
  which = [w for w in args.which.split(",") if w]
  if set(which) - set(ABLATIONS):
    ap.error(f"--which: unknown {sorted(set(which) - set(ABLATIONS))}; from {sorted(ABLATIONS)}")
  seeds = [int(s) for s in args.seeds.split(",")]
  root = os.path.abspath(args.root)
  os.makedirs(args.docs, exist_ok=True)
  # The cold-start checkpoint every variant starts from: --sft_params, else ROOT/sft's, made once.
  sft = os.path.dirname(os.path.abspath(args.sft_params or os.path.join(root, "sft", "params")))
  if not args.sft_params:
    os.makedirs(sft, exist_ok=True)
    steps = f"sft_steps={args.sft_steps}" if args.sft_steps else ""
    common.run_phase("sft", ["launch/sft.py", tiny_config(args.base_arg, steps),
                             f"--workdir={sft}"], sft, done=os.path.join(sft, "params"))
  all_results, headline = {}, {}
  for name in which:
    results = {}
    for variant, arg in ABLATIONS[name]:
      for seed in seeds:
        wd = os.path.join(root, name, f"{variant}-s{seed}")
        summary = os.path.join(wd, "summary.json")
        if not os.path.exists(summary) or "heldout_accuracy_after" not in read_json(summary):
          os.makedirs(wd, exist_ok=True)
          wall = common.run_phase(
              f"{name}_{variant}_s{seed}",
              ["launch/train.py", tiny_config(args.base_arg, arg), f"--workdir={wd}",
               "--config.init.source=orbax", f"--config.init.path={os.path.join(sft, 'params')}",
               f"--config.num_batches={args.batches}", f"--config.seed={seed}",
               f"--config.data.heldout={args.heldout}"], wd)
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
