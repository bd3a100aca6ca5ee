"""The short form of bench/sandbox_soak.py (issue #33 item 4): a mix of hostile, correct and wrong
programs through a 2-worker VerifierPool. Every verdict must be the known one, no task lost, and
nothing left behind: no process of the sandbox uids or child of ours, no file outside the run
dirs, no run dir. No timing assertions (the throughput ratio is the bench's, on a quiet host)."""
import os
import sys

import pytest

from magistral_jax.rewards import sandbox

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
import sandbox_soak  # noqa: E402


@pytest.fixture(scope="module")
def result():
  if sandbox.isolation_level() not in sandbox.PRIVATE_FS:
    pytest.skip(f"no private-filesystem sandbox here ({sandbox.isolation_level()})")
  # A larger hostile share than the bench's, so the short run meets most attack kinds.
  return sandbox_soak.run(tasks=60, workers=2, hostile_share=0.4, cpp_share=0.05, seed=1,
                          test_timeout_s=2.0, ratio_tasks=0, progress=False)


def test_every_verdict_is_the_known_one(result):
  assert result["verdict_accuracy"] == 1.0, result["wrong_verdicts"]
  assert result["catalog_dropped"] == 0, result["catalog_dropped_first"]
  assert result["by_category"]["hostile"]["tasks"] > 0


def test_no_task_is_lost(result):
  assert result["tasks_lost"] == 0
  assert result["resolved"] == result["tasks"] == 60


def test_nothing_is_left_behind(result):
  assert result["leaked_processes"] == 0, result["leaked_processes_first"]
  assert result["leaked_uids"] == []
  assert result["leaked_files"] == 0, result["leaked_files_first"]
  assert result["leaked_run_dirs"] == 0


def test_the_reading_attacks_would_pass_without_the_sandbox(result):
  # So their failing in the sandbox means the secret was out of reach, not a broken attack.
  assert all(result["read_attacks_pass_bare"].values()), result["read_attacks_pass_bare"]


def test_the_leak_checks_see_a_leak(tmp_path):
  # Negative controls, without a pool: a file an attack named, a run dir of a worker pid, a live
  # child of ours, and a wrong verdict are all counted.
  import subprocess
  from magistral_jax.rewards import RewardResult
  before = sandbox_soak.listing()
  made = [os.path.join("/tmp", sandbox_soak.MARK + "_control"), "/tmp/mj_sbx_999999999_control"]
  for p in made:
    open(p, "w").close()
  child = subprocess.Popen(["sleep", "30"])
  try:
    files, _ = sandbox_soak.leaked_files(before, sandbox_soak.listing(), range(0), {999999999})
    assert sorted(made) == [f for f in files if f in made]
    assert child.pid in [p["pid"] for p in sandbox_soak.leaked_processes(range(0))]
  finally:
    child.kill()
    child.wait()
    for p in made:
      os.remove(p)
  item = sandbox_soak.Item("hostile", "stdin_py", "x", {}, "")
  cfg = sandbox_soak.RewardConfig(language_bonus=0.0)
  assert not sandbox_soak.verdict_ok(item, RewardResult(1.0, {"correct": 0.9}), cfg)
  assert sandbox_soak.verdict_ok(item, RewardResult(0.1, {"correct": 0.0}), cfg)
