"""Run statistics for the run report: metric series from metrics.jsonl, grouped into panels.

The keys are those the RL loop writes each batch (train/rl_loop.py, pipeline/rollouts.py: reward
and its parts, lengths, system metrics; rl/loss.py: entropy, clip fractions, ratios). A panel lists keys
or `*` patterns; keys a run did not log are simply absent from its panel.
"""
from __future__ import annotations

import fnmatch
import json
import os

import numpy as np

from magistral_jax.analysis import workdir as run_lib

PANELS: dict[str, tuple[str, ...]] = {
    "reward": ("reward", "reward_max"),
    "reward parts": ("reward_format", "reward_correct", "reward_language",
                     "reward_length_penalty"),
    "accuracy / format": ("accuracy", "format_rate"),
    "response length (tokens)": ("response_length_mean", "response_length_max"),
    "entropy": ("entropy",),
    "clip fractions": ("clip*_frac",),
    "version lag (policy versions)": ("version_lag_mean", "version_lag_max", "versions_in_batch"),
    "utilisation": ("generator_utilization", "trainer_idle_frac"),
    "filtered groups": ("filtered_group_frac",),
    "optimisation": ("grad_norm", "approx_kl_old_new", "ratio_std"),
    "trainer vs sampler |Δ log p|": ("logp_mismatch_mean", "logp_mismatch_max"),
}


def dedupe_steps(rows: list[dict]) -> list[dict]:
  """One row per step, the last one written wins: a resumed run re-logs the steps after its last
  checkpoint, and those later rows describe the weights the run went on with."""
  by_step = {}
  for r in rows:
    by_step[int(r["step"])] = r
  return [by_step[s] for s in sorted(by_step)]


def load_run_metrics(workdir: str) -> tuple[list[dict], list[dict]]:
  """(SFT rows, RL rows) of a workdir's metrics.jsonl, each sorted by step, duplicates removed."""
  sft, rl = run_lib.split_metrics(run_lib.read_metrics(workdir))
  return dedupe_steps(sft), dedupe_steps(rl)


def load_heldout_curve(workdir: str) -> list[dict]:
  """The held-out evaluations of a run in the order written (eval/in_run.py write_eval: tag,
  batch, pass@1, format rate, length, ...); [] when the run evaluated none."""
  path = os.path.join(workdir, "heldout_curve.jsonl")
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def metric_keys(rows: list[dict]) -> list[str]:
  keys = {k for r in rows for k in r if k not in ("step", "time")}
  return sorted(keys)


def panel_keys(rows: list[dict], patterns) -> list[str]:
  """The logged keys a panel's names and `*` patterns select, in the panel's order."""
  present = metric_keys(rows)
  out = []
  for p in patterns:
    for k in (fnmatch.filter(present, p) if "*" in p else [p] if p in present else []):
      if k not in out:
        out.append(k)
  return out


def series(rows: list[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
  """(steps, values) of one metric, over the rows that logged it."""
  pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
  if not pts:
    return np.zeros(0, np.int64), np.zeros(0, np.float64)
  s, v = zip(*pts)
  return np.asarray(s, np.int64), np.asarray(v, np.float64)


def summary_table(rows: list[dict], keys=None) -> list[dict]:
  """First, last, min, max and mean of each metric: the report's table."""
  out = []
  for k in keys or metric_keys(rows):
    _, v = series(rows, k)
    if v.size:
      out.append({"metric": k, "n": int(v.size), "first": float(v[0]), "last": float(v[-1]),
                  "min": float(v.min()), "max": float(v.max()), "mean": float(v.mean())})
  return out
