"""The gain of one checkpoint over another on the same held-out problems, with a 95 % confidence
interval from a paired bootstrap over problems (issue #51: a claim that RL helps).

Each problem i has a pass@1 before (b_i, its correct samples over its n samples) and after (a_i).
The gain is mean_i (a_i - b_i). The bootstrap resamples problems with replacement, B times, and
takes the gain's 2.5 and 97.5 percentiles: the per-problem pairing removes the spread of problem
difficulty, which is most of the variance of either mean. Both the sampling of problems and of
completions are in the resampled differences, since each d_i carries its own sampling noise.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np


def paired_bootstrap(before: Sequence[float], after: Sequence[float], *, n_boot: int = 10_000,
                     level: float = 0.95, seed: int = 0) -> dict:
  """{"gain", "ci_low", "ci_high", "n", "before", "after", "p_le_0"} for per-problem scores
  `before` and `after` (same problems, same order). p_le_0 is the bootstrap share of gains <= 0
  (a one-sided check that the gain is above zero)."""
  b = np.asarray(before, np.float64)
  a = np.asarray(after, np.float64)
  if b.shape != a.shape or b.ndim != 1 or not b.size:
    raise ValueError(f"paired_bootstrap: need two equal-length non-empty 1-D score lists, got "
                     f"{b.shape} and {a.shape}")
  if not 0.0 < level < 1.0:
    raise ValueError(f"paired_bootstrap: level must be in (0, 1), got {level}")
  d = a - b
  rng = np.random.default_rng(seed)
  idx = rng.integers(0, d.size, size=(n_boot, d.size))
  gains = d[idx].mean(axis=1)
  tail = (1.0 - level) / 2.0
  lo, hi = np.quantile(gains, [tail, 1.0 - tail])
  return {"gain": float(d.mean()), "ci_low": float(lo), "ci_high": float(hi), "level": level,
          "n": int(d.size), "before": float(b.mean()), "after": float(a.mean()),
          "p_le_0": float(np.mean(gains <= 0.0))}


def pass1_by_id(rows: Sequence[Mapping]) -> dict:
  """{problem id: pass@1} from an evaluation's per-problem rows (eval/evaluate.py)."""
  out = {}
  for r in rows:
    n = r.get("n", 0)
    out[str(r["id"])] = (r["correct"] / n) if n else float(r.get("pass1", 0.0))
  return out


def compare_evals(before_rows: Sequence[Mapping], after_rows: Sequence[Mapping],
                  **kw) -> dict:
  """paired_bootstrap over the problems two evaluations share (by id). Refuses two evaluations
  of different problem sets: a gain measured on different problems is not a paired one."""
  b, a = pass1_by_id(before_rows), pass1_by_id(after_rows)
  if set(b) != set(a):
    only_b, only_a = sorted(set(b) - set(a))[:3], sorted(set(a) - set(b))[:3]
    raise ValueError(f"compare_evals: the two evaluations are of different problems (only "
                     f"before: {only_b}..., only after: {only_a}...)")
  ids = sorted(b)
  return paired_bootstrap([b[i] for i in ids], [a[i] for i in ids], **kw)
