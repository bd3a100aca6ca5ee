"""The short form of bench/vs_tunix.py: a tiny workload end to end, our side always, the tunix side
only where its venv (bench/peers/.venv-tunix, bench/peers/setup_tunix.sh) exists. Checks the
JSON last line's keys and that both sides ran the same workload; no timing assertions (the
figures are the bench's, on a quiet host). Both scripts run as subprocesses, as a user runs
them."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
# bench/vs_tunix.py's DEFAULT_TUNIX_PYTHON and SIDE_KEYS.
HAVE_TUNIX = os.access(os.path.join(ROOT, "bench", "peers", ".venv-tunix", "bin", "python"),
                       os.X_OK)
SIDE_KEYS = ("completions_per_s", "rollout_tokens_per_s", "train_step_s", "peak_memory_bytes",
             "iteration_s")
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
    for k in SIDE_KEYS:
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


def _rewards(script, path):
  """The rewards `script --score=path` prints (our interpreter: tunix_side.py imports nothing of
  tunix to score)."""
  r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", *script), f"--score={path}"],
                     cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  return json.loads(r.stdout.strip().splitlines()[-1])["rewards"]


def test_both_sides_score_alike(tmp_path):
  # The tunix side's reward function against our verifier under the bench's reward config, each
  # with the shared tie-breaker (peer_common.jitter, < 0.01) added.
  completions = ["<think>7-3=4</think> so \\boxed{4}", "<think>7-3=5</think> \\boxed{5}",
                 "no format \\boxed{4}", "<think>a</think> no answer",
                 " <think>x</think> \\boxed{4}", "<think>a<think>b</think> \\boxed{4}",
                 "<think>a</think>\\boxed{-4}"]
  path = tmp_path / "completions.json"
  path.write_text(json.dumps({"completions": completions, "answers": ["4"] * len(completions),
                              "max_new_tokens": NEW}))
  ours = _rewards(["vs_tunix.py"], path)
  theirs = _rewards(["peers", "tunix_side.py"], path)
  assert theirs == pytest.approx(ours)
  base = [1.0, 0.1, 0.0, 0.0, 0.0, 0.0, 0.1]
  assert all(0 <= r - b < 0.01 for r, b in zip(ours, base)), ours
  assert len({round(r - b, 6) for r, b in zip(ours, base)}) > 1   # the tie-breaker varies
