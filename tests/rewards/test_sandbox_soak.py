"""The short form of bench/sandbox_soak.py (issue #33 item 4, issue #50): a mix of hostile, correct
and wrong programs through a 2-worker VerifierPool whose busy workers are SIGKILLed every so often
(chaos). Every verdict must be the known one (a killed worker's task gets none: faulted, dropped),
no task lost, and nothing left behind: no process of the sandbox uids or child of ours, no file
outside the run dirs, no run dir, no IPC object, no listening socket. No timing assertions (the
throughput ratio is the bench's, on a quiet host). The bench runs as a script, as it does on its
own (its JSON last line is the result); its negative controls are its --controls mode."""
import json
import os
import signal
import subprocess
import sys

import pytest

from magistral_jax.rewards import sandbox

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bench(*flags: str, timeout_s: float) -> dict:
  """Runs bench/sandbox_soak.py with `flags` from the repository root; its JSON last line."""
  argv = [sys.executable, "bench/sandbox_soak.py", *flags]
  proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
  try:
    out, err = proc.communicate(timeout=timeout_s)
  except subprocess.TimeoutExpired:
    proc.send_signal(signal.SIGTERM)   # unwinds through the bench's cleanup
    try:
      out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
      proc.kill()
      out, err = proc.communicate()
    pytest.fail(f"{' '.join(flags)} ran past {timeout_s} s\n{err.decode(errors='replace')[-4000:]}")
  lines = out.decode(errors="replace").strip().splitlines()
  assert proc.returncode == 0 and lines, \
      f"{' '.join(flags)}: exit {proc.returncode}\n{err.decode(errors='replace')[-4000:]}"
  return json.loads(lines[-1])


@pytest.fixture(scope="module")
def result():
  if sandbox.isolation_level() not in sandbox.PRIVATE_FS:
    pytest.skip(f"no private-filesystem sandbox here ({sandbox.isolation_level()})")
  # A larger hostile share than the bench's, so the short run meets most attack kinds.
  # Chaos every ~1.5 s: a few workers die mid-run in a run this short.
  return _bench("--tasks=60", "--workers=2", "--hostile_share=0.4", "--cpp_share=0.05",
                "--seed=1", "--test_timeout_s=2.0", "--ratio_tasks=0", "--no_progress",
                "--chaos_every_s=1.5", timeout_s=1200)


@pytest.fixture(scope="module")
def controls():
  return _bench("--controls", timeout_s=300)


def _assert_controls(controls, *names):
  for name in names:
    assert controls["checks"].get(name) is True, (name, controls["details"])


def test_every_verdict_is_the_known_one(result):
  # Over the tasks that got a verdict; the IPC attacks fail here until runs get an IPC namespace.
  assert result["verdict_accuracy"] == 1.0, result["wrong_verdicts"]
  assert result["verdicts"] == result["resolved"] - result["faulted"] > 0
  assert result["catalog_dropped"] == 0, result["catalog_dropped_first"]
  assert result["by_category"]["hostile"]["tasks"] > 0


def test_no_task_is_lost(result):
  assert result["tasks_lost"] == 0
  assert result["resolved"] == result["tasks"] == 60


def test_killed_workers_cost_only_their_own_task(result):
  # Each SIGKILLed worker faults at most the one task it ran; no worker died of anything else (a
  # program that reached its worker); and the pool kept serving without a cleanup failing.
  assert result["chaos_kills"] >= 1
  assert result["faulted_by_kind"].get("worker_died", 0) <= result["chaos_kills"], \
      result["faulted_first"]
  assert result["worker_deaths_beyond_chaos"] == 0
  m = result["pool_metrics"]
  assert m["stopped"] is None and m["cleanup_errors"] == 0 and m["orphans_left"] == 0


def test_nothing_is_left_behind(result):
  assert result["leaked_processes"] == 0, result["leaked_processes_first"]
  assert result["leaked_uids"] == []
  assert result["leaked_files"] == 0, result["leaked_files_first"]
  assert result["leaked_run_dirs"] == 0


def test_no_ipc_object_or_listener_is_left_behind(result):
  # Until each run gets an IPC namespace, the IPC attacks leave their objects here.
  assert result["leaked_sysv_ipc"] == 0, result["leaked_sysv_ipc_first"]
  assert result["leaked_posix_mqueues"] == 0, result["leaked_posix_mqueues_first"]
  assert result["leaked_posix_shm"] == 0, result["leaked_posix_shm_first"]
  assert result["leaked_listeners"] == 0, result["leaked_listeners_first"]


def test_the_reading_attacks_would_pass_without_the_sandbox(result):
  # So their failing in the sandbox means the secret was out of reach, not a broken attack.
  assert all(result["read_attacks_pass_bare"].values()), result["read_attacks_pass_bare"]


def test_the_leak_checks_see_a_leak(controls):
  # Negative controls, without a pool: a file an attack named, a run dir of a worker pid, a live
  # child of ours, and a wrong verdict are all counted.
  _assert_controls(controls, "leaks.files_named_and_run_dir_seen", "leaks.child_process_seen",
                   "leaks.hostile_pass_is_a_wrong_verdict",
                   "leaks.hostile_fail_is_the_right_verdict")


def test_every_mix_has_the_ipc_attacks_and_the_holders(controls):
  _assert_controls(controls, "mix.mix_is_always", "mix.ipc_attacks_are_hostile")


def test_the_ipc_and_listener_checks_see_a_leak(controls):
  # Negative controls: SysV shared memory, a semaphore set and a message queue under the attacks'
  # key (and a keyless segment, seen by its owner's uid), a POSIX message queue and a /dev/shm
  # entry named like the attacks', and listening TCP and unix sockets of a child of ours are all
  # counted; remove_ipc then takes the IPC objects away.
  _assert_controls(controls, "ipc.ipc_objects_made", "ipc.sysv_by_key_seen",
                   "ipc.sysv_by_owner_seen", "ipc.posix_mqueue_seen", "ipc.posix_shm_seen",
                   "ipc.listener_child_up", "ipc.tcp_and_unix_listeners_seen", "ipc.sysv_removed",
                   "ipc.posix_mqueue_removed", "ipc.posix_shm_removed")
