"""Matplotlib figures for the notebooks (imported lazily: the analysis itself needs no plotting).

Each function returns the Figure, so a notebook shows it and a script can `fig.savefig(...)`.
"""
from __future__ import annotations

import math

import numpy as np

from magistral_jax.analysis import report as report_lib


def _plt():
  import matplotlib.pyplot as plt
  return plt


def run_report(rl_rows: list[dict], sft_rows: list[dict] | None = None,
               panels: dict | None = None, ncols: int = 3):
  """One subplot per panel with data (plus the SFT loss if there was a cold start)."""
  plt = _plt()
  panels = dict(panels or report_lib.PANELS)
  chosen = [(name, report_lib.panel_keys(rl_rows, pats)) for name, pats in panels.items()]
  chosen = [(name, keys) for name, keys in chosen if keys]
  if sft_rows:
    chosen.insert(0, ("cold-start SFT", report_lib.panel_keys(sft_rows, ("sft/loss",))))
  if not chosen:
    raise ValueError("run_report: none of the panels' metrics were logged")
  nrows = math.ceil(len(chosen) / ncols)
  fig, axes = plt.subplots(nrows, ncols, figsize=(5 * ncols, 3.2 * nrows), squeeze=False)
  for ax, (name, keys) in zip(axes.flat, chosen):
    rows = sft_rows if name == "cold-start SFT" else rl_rows
    for k in keys:
      s, v = report_lib.series(rows, k)
      ax.plot(s, v, marker="o" if len(s) < 30 else None, ms=3, label=k)
    ax.set_title(name)
    ax.set_xlabel("SFT step" if name == "cold-start SFT" else "optimizer step")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
  for ax in list(axes.flat)[len(chosen):]:
    ax.axis("off")
  fig.tight_layout()
  return fig


def _heatmap(ax, values, m1, m2, title, fmt):
  im = ax.imshow(values, origin="lower", cmap="viridis", aspect="auto")
  ax.set_xticks(range(len(m2)), [f"{m:g}" for m in m2])
  ax.set_yticks(range(len(m1)), [f"{m:g}" for m in m1])
  ax.set_xlabel("α2 / σ2 (component 2)")
  ax.set_ylabel("α1 / σ1 (component 1)")
  ax.set_title(title)
  mid = (np.nanmin(values) + np.nanmax(values)) / 2
  for i in range(values.shape[0]):
    for j in range(values.shape[1]):   # dark text on the bright (high) end of viridis
      ax.text(j, i, format(values[i, j], fmt), ha="center", va="center", fontsize=7,
              color="k" if values[i, j] > mid else "w")
  ax.figure.colorbar(im, ax=ax)


def grid_heatmaps(result):
  """Mean reward and mean response length over the (α1, α2) grid; (0, 0) is the final weights."""
  plt = _plt()
  fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
  _heatmap(axes[0], result.grid["reward"], result.multiples1, result.multiples2, "mean reward",
           ".3f")
  _heatmap(axes[1], result.grid["length"], result.multiples1, result.multiples2,
           "mean response length (tokens)", ".1f")
  fig.tight_layout()
  return fig


def reward_vs_log_length(result):
  """Each grid point's (log length, reward) with the least-squares line."""
  plt = _plt()
  fig, ax = plt.subplots(figsize=(5.5, 4))
  length, reward = result.grid["length"].reshape(-1), result.grid["reward"].reshape(-1)
  m1 = np.repeat(result.multiples1, len(result.multiples2))
  sc = ax.scatter(np.log(length), reward, c=m1, cmap="coolwarm")
  fig.colorbar(sc, ax=ax, label="α1 / σ1")
  fit = result.fit
  if math.isfinite(fit["slope"]):
    xs = np.linspace(np.log(length).min(), np.log(length).max(), 50)
    ax.plot(xs, fit["slope"] * xs + fit["intercept"], "k--",
            label=f"slope {fit['slope']:.3g}, r² {fit['r2']:.2f}")
    ax.legend()
  ax.set_xlabel("log(mean response length)")
  ax.set_ylabel("mean reward")
  ax.set_title("reward vs log(length) over the grid")
  ax.grid(alpha=0.3)
  fig.tight_layout()
  return fig


def trajectory(result):
  """The checkpoints' coordinates on (c1, c2), labelled by step, and the perturbation grid."""
  plt = _plt()
  fig, ax = plt.subplots(figsize=(5.5, 4))
  p = result.pca.projections
  ax.plot(p[:, 0], p[:, 1], "-o", ms=4)
  for s, (a, b) in zip(result.steps, p):
    ax.annotate(str(s), (a, b), fontsize=7, xytext=(3, 3), textcoords="offset points")
  ga, gb = np.meshgrid(p[-1, 0] + result.alpha1, p[-1, 1] + result.alpha2, indexing="ij")
  ax.scatter(ga, gb, marker="x", c="gray", label="grid points")
  ax.set_xlabel(f"c1 ({100 * result.pca.explained[0]:.0f}% of variance)")
  ax.set_ylabel(f"c2 ({100 * result.pca.explained[1]:.0f}% of variance)")
  ax.set_title("checkpoint trajectory (labels: step)")
  ax.legend(fontsize=7)
  ax.grid(alpha=0.3)
  fig.tight_layout()
  return fig


def learning_curves(runs: dict, before: float | None = None):
  """Issue #51's figure: held-out pass@1 over RL batches (WORKDIR/heldout_curve.jsonl, the
  "before" point at batch 0 shared by a control run, which skips its own) beside the training
  accuracy (the verifier's verdicts, also under a random-reward control), reward, format rate and
  response length per batch (metrics.jsonl), one line per run. `runs`: {label: a launch/train.py
  workdir}."""
  plt = _plt()
  fig, axes = plt.subplots(1, 5, figsize=(22, 3.8))
  for label, wd in runs.items():
    pts = report_lib.load_heldout_curve(wd)
    xy = [(c["batch"], c["pass@1"]) for c in pts]
    if before is not None and not any(c["tag"] == "before" for c in pts):
      xy.insert(0, (0, before))
    if xy:
      axes[0].plot(*zip(*sorted(xy)), marker="o", label=label)
    rows = [r for r in report_lib.load_run_metrics(wd)[1] if "reward" in r]
    for ax, key in zip(axes[1:], ("accuracy", "reward", "format_rate", "response_length_mean")):
      ax.plot(range(1, len(rows) + 1), [r.get(key) for r in rows], label=label)
  titles = ("held-out pass@1", "training accuracy (verdicts)", "training reward (paid)",
            "training format rate", "response length (tokens)")
  for ax, title in zip(axes, titles):
    ax.set_title(title)
    ax.set_xlabel("RL batch")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  fig.tight_layout()
  return fig


def ablation_curves(name: str, variants: dict):
  """bench/ablations.py's figure for one ablation: reward and entropy per RL batch (mean over
  seeds) and reward against the RL seconds of the first seed (the async-vs-sync question), one
  line per variant. `variants`: {variant: [per seed: {"reward", "entropy", "time": per batch}]}."""
  plt = _plt()
  fig, axes = plt.subplots(1, 3, figsize=(15, 4))
  nan = lambda vs: [v if v is not None else np.nan for v in vs]
  for variant, curves in variants.items():
    n = min(len(c["reward"]) for c in curves)
    for ax, key in zip(axes[:2], ("reward", "entropy")):
      ax.plot(np.arange(1, n + 1), np.mean([nan(c[key][:n]) for c in curves], 0), label=variant)
      ax.set_xlabel("batch")
      ax.set_ylabel(f"{key} (mean over {len(curves)} seed(s))")
    t = np.asarray([v or 0.0 for v in curves[0]["time"][:n]], float)
    axes[2].plot(t - t[0] if len(t) else t, nan(curves[0]["reward"][:n]), label=variant)
  axes[2].set_xlabel("seconds since the first batch (seed 0)")
  axes[2].set_ylabel("reward")
  for ax in axes:
    ax.legend()
    ax.grid(alpha=0.3)
  fig.suptitle(f"tiny-scale ablation: {name}")
  fig.tight_layout()
  return fig
