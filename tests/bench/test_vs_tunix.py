"""The short form of bench/vs_tunix.py: a tiny workload end to end, our side always, the tunix side
only where its venv (bench/peers/.venv-tunix, bench/peers/setup_tunix.sh) exists. Checks the
JSON last line's keys and that both sides ran the same workload; no timing assertions (the
figures are the bench's, on a quiet host)."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.insert(0, os.path.join(ROOT, "bench", "peers"))
import tunix_side  # noqa: E402  (imports nothing of tunix until it runs)
import vs_tunix  # noqa: E402

HAVE_TUNIX = os.access(vs_tunix.DEFAULT_TUNIX_PYTHON, os.X_OK)
PROMPTS, G, NEW = 1, 2, 4


@pytest.fixture(scope="module")
def result():
  argv = [sys.executable, os.path.join(ROOT, "bench", "vs_tunix.py"), "--model=tiny",
          f"--prompts={PROMPTS}", f"--group_size={G}", f"--max_new_tokens={NEW}",
          "--iterations=1", "--warmup=1"]
  if not HAVE_TUNIX:
    argv.append("--skip_tunix")
  r = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=1200)
  assert r.returncode == 0, r.stderr[-3000:]
  return json.loads(r.stdout.strip().splitlines()[-1])


def test_the_last_line_has_every_key(result):
  for k in ("speedup_vs_tunix", "rollout_speedup_vs_tunix", "train_step_speedup_vs_tunix",
            "memory_ratio", "workload", "versions", "device"):
    assert k in result
  for side in ("ours", "tunix"):
    for k in vs_tunix.SIDE_KEYS:
      assert f"{side}_{k}" in result
  ours = result["ours"]
  assert ours["completions_per_s"] > 0 and ours["rollout_tokens_per_s"] > 0
  assert ours["train_step_s"] > 0 and ours["peak_memory_bytes"] > 0
  assert ours["optimizer_steps"] == 2   # warm-up + timed: one step each


def test_our_side_ran_the_workload(result):
  ours = result["ours"]
  assert ours["completions_per_iteration"] == [PROMPTS * G]
  assert ours["generated_tokens_per_iteration"] == [PROMPTS * G * NEW]   # no early stop
  assert ours["generator_compiles_in_timed_iterations"] == 0


def test_tunix_side_or_a_clear_skip(result):
  if not HAVE_TUNIX:
    assert result["tunix_status"].startswith("skipped")
    assert result["tunix"] is None and result["speedup_vs_tunix"] is None
    pytest.skip("no bench/peers/.venv-tunix (bench/peers/setup_tunix.sh)")
  tunix = result["tunix"]
  assert result["tunix_status"] == "ran"
  assert result["same_weights"] and result["same_generated_tokens"]
  assert tunix["completions_per_iteration"] == [PROMPTS * G]
  assert tunix["optimizer_steps"] == 2
  assert result["speedup_vs_tunix"] > 0 and result["memory_ratio"] > 0


def test_both_sides_score_alike():
  # The tunix side's reward function against our verifier under the bench's reward config.
  from magistral_jax.rewards.reward import compute_reward
  assert vs_tunix.jitter("abc") == tunix_side.jitter("abc")
  assert 0 <= vs_tunix.jitter("x" * 100) < 0.01
  cfg = vs_tunix.reward_config(NEW)
  task = {"kind": "math", "problem": "Compute 7-3.", "answer": "4"}
  completions = ["<think>7-3=4</think> so \\boxed{4}", "<think>7-3=5</think> \\boxed{5}",
                 "no format \\boxed{4}", "<think>a</think> no answer",
                 " <think>x</think> \\boxed{4}", "<think>a<think>b</think> \\boxed{4}",
                 "<think>a</think>\\boxed{-4}"]
  theirs = [r - tunix_side.jitter(c) for r, c in
            zip(tunix_side.reward_fn(None, completions, ["4"] * len(completions)), completions)]
  ours = [compute_reward(task, c, NEW, cfg).reward for c in completions]
  assert theirs == pytest.approx(ours)
  assert ours == pytest.approx([1.0, 0.1, 0.0, 0.0, 0.0, 0.0, 0.1])
