"""Metrics to TensorBoard event files and a JSONL file in the workdir, plus a progress line."""
from __future__ import annotations

import json
import math
import os
import time
from typing import Mapping

import numpy as np


def _scalar(v):
  try:
    v = float(np.asarray(v))
  except (TypeError, ValueError):
    return None
  return v if math.isfinite(v) else None


class MetricsWriter:
  """Writes `metrics.jsonl` (one object per step) and TensorBoard scalars under `workdir/tb`."""

  def __init__(self, workdir: str | None, tensorboard: bool = True):
    self.workdir = workdir
    self._jsonl = None
    self._tb = None
    if workdir:
      os.makedirs(workdir, exist_ok=True)
      self._jsonl = open(os.path.join(workdir, "metrics.jsonl"), "a", buffering=1)
      if tensorboard:
        from tensorboardX import SummaryWriter
        self._tb = SummaryWriter(os.path.join(workdir, "tb"))

  def write(self, step: int, metrics: Mapping[str, object]) -> dict:
    clean = {k: _scalar(v) for k, v in metrics.items()}
    clean = {k: v for k, v in clean.items() if v is not None}
    if self._jsonl:
      self._jsonl.write(json.dumps({"step": int(step), "time": time.time(), **clean}) + "\n")
    if self._tb:
      for k, v in clean.items():
        self._tb.add_scalar(k, v, int(step))
      self._tb.flush()
    return clean

  def write_text(self, step: int, name: str, text: str):
    if self._tb:
      self._tb.add_text(name, text, int(step))
    if self.workdir:
      with open(os.path.join(self.workdir, "samples.jsonl"), "a") as f:
        f.write(json.dumps({"step": int(step), "name": name, "text": text}) + "\n")

  def close(self):
    if self._jsonl:
      self._jsonl.close()
      self._jsonl = None
    if self._tb:
      self._tb.close()
      self._tb = None


class Progress:
  """A one-line progress report: step, rate, ETA and a few headline metrics."""

  def __init__(self, total_steps: int, start_step: int = 0):
    self.total, self.start = total_steps, start_step
    self.t0 = time.time()

  def line(self, step: int, metrics: Mapping[str, float], keys=("reward", "accuracy",
                                                                  "response_length_mean")) -> str:
    done = step - self.start
    elapsed = time.time() - self.t0
    rate = done / elapsed if elapsed > 0 else 0.0
    eta = (self.total - step) / rate if rate > 0 else float("inf")
    parts = [f"step {step}/{self.total}", f"{rate * 60:.2f} steps/min",
             f"ETA {eta:.0f}s" if math.isfinite(eta) else "ETA ?"]
    for k in keys:
      if k in metrics and metrics[k] is not None:
        parts.append(f"{k}={float(metrics[k]):.4g}")
    return " | ".join(parts)
