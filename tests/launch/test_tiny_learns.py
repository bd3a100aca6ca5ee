"""The README's main job, shortened for CI: the tiny default (cold-start SFT, then async GRPO
through the real verifier pool and the full Magistral reward) raises the reward over its first
RL batches. Seeded; not a timing test.

The full run (`make run`) is measured in BENCHMARKS.md ("Tiny default run"). Here the cold start
is cut short on clean traces, the task is narrowed (small operands, few steps), and RL takes one
optimizer step per large batch at a raised lr (the flags below), so that a few dozen batches move
the policy well beyond the run-to-run noise of the async pipeline. Not higher: at twice this lr
a single step now and then broke the format, and the reward took most of the run to recover
(the runs are in git history).

Why this form: with the default task and so short a cold start the answers stay near chance and
RL has little to reinforce; with half the completions a batch the reward's rise is within the
run-to-run noise; a batch's mean reward swings around a trend that rises over most of the run,
so the last batches are compared with the first (the runs behind these choices are in git
history).

The run is made in two launches (12 batches, then resumed to 24), so it also checks what a run
writes (summary, metrics, TensorBoard, checkpoints) and that a larger budget resumes it.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BATCHES, HALF, EVERY = 24, 12, 4   # batches in all, in the first launch; checkpoint every


def _train(workdir, batches):
  r = subprocess.run(
      [sys.executable, os.path.join(ROOT, "launch/train.py"), f"--workdir={workdir}",
       f"--config=configs/tiny.py:sft_steps=50,batches={batches},slip=0,n_batch=128,"
       "n_mini_per_batch=1",
       "--config.optimizer.learning_rate=5e-4", "--config.data.heldout=16",
       "--config.data.max_operand=4", "--config.data.max_steps=2",
       f"--config.checkpoint.every={EVERY}"],
      cwd=ROOT, capture_output=True, text=True, timeout=1500)
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  return r.stdout + r.stderr


@pytest.mark.slow
@pytest.mark.long
def test_tiny_default_reward_improves_over_its_first_batches(tmp_path):
  """Run in two launches, the second with a larger budget (what a user does to train longer):
  besides the learning, the run's outputs and its resume are checked here."""
  out = _train(tmp_path, HALF)
  first = json.load(open(tmp_path / "summary.json"))
  assert first["batches"] == HALF
  for key in ("heldout_accuracy_before", "heldout_accuracy_after", "format_rate", "wall_time_s"):
    assert key in first
  # The tiny system prompt (most of each prompt) is prefilled once per weights version
  # and every training prompt continues it (engine.shared_prefix_cache, on by default).
  assert "shared prompt prefix: 35 tokens" in out
  assert os.listdir(tmp_path / "tb")
  steps = sorted(int(s) for s in os.listdir(tmp_path / "checkpoints") if s.isdigit())
  assert steps == list(range(0, HALF + 1, EVERY)) and first["optimizer_steps"] == HALF

  out = _train(tmp_path, BATCHES)   # resumes from its checkpoint, not from scratch
  assert f"resumed from checkpoint {HALF}" in out and "cold-start SFT" not in out
  assert "held-out pass@1" in out   # the before -> after line the README promises
  summary = json.load(open(tmp_path / "summary.json"))
  assert summary["batches"] == BATCHES
  # Wall time adds up across the two processes (the checkpoint carries the first one's).
  assert summary["wall_time_s"] > first["wall_time_s"]
  # Each evaluation's per-problem counts (what bench/learn.py's paired bootstrap reads) and the
  # learning curve: "before" once (the resumed launch does not evaluate again), "after" of each
  # launch (the second overwrites the first's file).
  before = json.load(open(tmp_path / "eval_before.json"))
  after = json.load(open(tmp_path / "eval_after.json"))
  assert len(before["rows"]) == len(after["rows"]) == 16 and after["batch"] == BATCHES
  assert {r["n"] for r in after["rows"]} == {after["k"]}
  # Held out means never trained on: the run's record of what it trained on (the cold start's
  # traces, every RL prompt, across both launches) holds none of the evaluated problems.
  assert summary["heldout_trained_on"] == before["heldout_trained_on"] == 0
  assert after["heldout_trained_on"] == 0 and summary["heldout_problems"] == 16
  record = json.load(open(tmp_path / "trained_on.json"))
  assert len(record["ids"]) >= BATCHES * 16 and len(record["digests"]) > 100
  curve = [json.loads(l) for l in open(tmp_path / "heldout_curve.jsonl")]
  assert [c["tag"] for c in curve] == ["before", "after", "after"]
  assert [c["batch"] for c in curve] == [0, HALF, BATCHES]
  assert curve[-1]["pass@1"] == pytest.approx(summary["heldout_accuracy_after"])

  rows = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  rl = [row for row in rows if "reward" in row]
  assert [int(row["batch"]) for row in rl] == list(range(1, BATCHES + 1))   # none lost or redone
  assert max(row.get("generator_shared_prefix_hits", 0) for row in rl) > 0
  reward = np.asarray([row["reward"] for row in rl])
  fmt = np.asarray([row["format_rate"] for row in rl])
  assert reward[-8:].mean() > reward[:8].mean() + 0.01, reward.round(3)
  assert fmt[-8:].mean() > 0.5, fmt.round(2)   # the format is learned (cold start, then RL)
