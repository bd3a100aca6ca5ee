"""One device: `launch/train.py --config=configs/tiny.py:colocated` with
XLA_FLAGS=--xla_force_host_platform_device_count=1, the trainer and the generator taking turns on
it. Shortened as tests/launch/test_tiny_learns.py shortens the default run (a 50-step cold start on
clean traces, operands 0..4, 1-2 steps, one optimizer step per batch of 128 completions at lr
1e-3), stopped after half its batches and resumed by a second process on the same workdir.

The colocated sync schedule is deterministic (each batch is generated under one policy version
from seeded requests, and its groups are ordered by id), so this run is the same every time on a
given build; the full run is in BENCHMARKS.md ("One device, colocated").
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BATCHES, STOP_AT = 16, 8


def _train(workdir, *extra):
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
  return subprocess.run(
      [sys.executable, os.path.join(ROOT, "launch/train.py"), f"--workdir={workdir}",
       f"--config=configs/tiny.py:colocated,sft_steps=50,batches={BATCHES},slip=0,n_batch=128,"
       "n_mini_per_batch=1",
       "--config.optimizer.learning_rate=1e-3", "--config.data.heldout=16",
       "--config.data.max_operand=4", "--config.data.max_steps=2",
       "--config.checkpoint.every=4", *extra],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)


@pytest.mark.slow
def test_one_device_colocated_run_learns_and_resumes(tmp_path):
  first = _train(tmp_path, f"--config.stop_after_batches={STOP_AT}")
  assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
  log = first.stdout + first.stderr
  assert "colocated on the trainer's 1 device(s), taking turns" in log
  assert f"stopping after {STOP_AT} batches" in log
  second = _train(tmp_path)
  assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
  assert f"resumed from checkpoint {STOP_AT}" in second.stdout + second.stderr
  assert "held-out pass@1" in second.stdout

  rows = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  rl = [row for row in rows if "reward" in row]
  assert [row["batch"] for row in rl] == list(range(1, BATCHES + 1))   # none lost or redone
  reward = np.asarray([row["reward"] for row in rl])
  assert reward[-6:].mean() > reward[:6].mean() + 0.01, reward.round(3)
  for row in rl:
    # Taking turns: each batch is one policy version, the push moved nothing, and the generation
    # phase freed what it held before the trainer stepped.
    assert row["versions_in_batch"] == 1 and row["weight_push_s"] == 0.0
    assert row["memory/generation_released_bytes"] > 0
    assert row["memory/train_peak_bytes"] > 0
  summary = json.load(open(tmp_path / "summary.json"))
  assert summary["batches"] == BATCHES
