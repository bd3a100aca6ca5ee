"""bench/learn.py's logic apart from its launchers: the RL task from the headroom table, the
control's coin rate, the report's lines and figure, the archive that comes back from a device."""
from __future__ import annotations

import json
import os
import tarfile

from magistral_jax.analysis.report import load_run_metrics


def choose_task(headroom: dict, lo: float = 0.1, hi: float = 0.6) -> str | None:
  """The synthetic set with pass@1 in [lo, hi] and the most headroom (pass@k - pass@1): where RL,
  which mostly turns pass@k into pass@1, has the most to gain; failing that, the one with the most
  headroom. None when no synthetic set has any."""
  sets = [(r["headroom"], name, r["pass@1"]) for name, r in headroom["sets"].items()
          if name.startswith("synthetic/")]
  fits = [s for s in sets if lo <= s[2] <= hi]
  # None in the band: the one with the most headroom all the same, if it has any.
  fits = fits or [s for s in sets if s[0] > 0]
  return max(fits)[1] if fits else None


def mean_accuracy(workdir: str) -> float:
  """The mean training accuracy (the verifier's verdicts) over a run's RL batches."""
  vals = [r["accuracy"] for r in load_run_metrics(workdir)[1] if "accuracy" in r]
  if not vals:
    raise RuntimeError(f"{workdir}/metrics.jsonl holds no RL batch's accuracy")
  return sum(vals) / len(vals)


def read_json(path):
  with open(path) as f:
    return json.load(f)


def gain_line(label: str, g: dict) -> str:
  return (f"{label} {100 * g['gain']:+.1f} points [{100 * g['ci_low']:+.1f}, "
          f"{100 * g['ci_high']:+.1f}] ({g['before']:.3f} -> {g['after']:.3f})")


def plot(out_png: str, runs: dict, before: dict) -> str | None:
  """analysis/plots.learning_curves of the runs, saved as out_png (None without matplotlib)."""
  try:
    import matplotlib
    matplotlib.use("Agg")
  except ImportError:
    return None
  from magistral_jax.analysis.plots import learning_curves
  fig = learning_curves(runs, before=before["pass@1"])
  fig.axes[0].set_title(f"held-out pass@1 (k={before['k']}, {before['num_problems']} problems)")
  fig.savefig(out_png, dpi=80)
  return out_png


# What comes back from a device machine (a few files): each run's metrics, evaluations (with the
# per-problem counts) and learning curve, the SFT summary and every phase's log, in one archive.
KEEP = ("metrics.jsonl", "heldout_curve.jsonl", "summary.json", "sft_summary.json", ".log",
        "trained_on.json")


def pack(wd: str, path: str) -> str:
  with tarfile.open(path, "w:gz") as tar:
    for base, _, files in os.walk(wd):
      if "checkpoints" in base or "params" in base or "/data" in base:
        continue
      for f in files:
        if f.endswith(KEEP) or (f.startswith("eval_") and f.endswith(".json")):
          full = os.path.join(base, f)
          tar.add(full, arcname=os.path.relpath(full, wd))
  return path
