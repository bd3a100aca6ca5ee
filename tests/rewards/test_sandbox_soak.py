"""The short form of bench/sandbox_soak.py (issue #33 item 4, issue #50): a mix of hostile, correct
and wrong programs through a 2-worker VerifierPool whose busy workers are SIGKILLed every so often
(chaos). Every verdict must be the known one (a killed worker's task gets none: faulted, dropped),
no task lost, and nothing left behind: no process of the sandbox uids or child of ours, no file
outside the run dirs, no run dir, no IPC object, no listening socket. No timing assertions (the
throughput ratio is the bench's, on a quiet host)."""
import os
import subprocess
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
  # Chaos every ~1.5 s: a few workers die mid-run in a run this short.
  return sandbox_soak.run(tasks=60, workers=2, hostile_share=0.4, cpp_share=0.05, seed=1,
                          test_timeout_s=2.0, ratio_tasks=0, progress=False, chaos_every_s=1.5)


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


def test_every_mix_has_the_ipc_attacks_and_the_holders(tmp_path):
  catalog = sandbox_soak.Catalog(str(tmp_path))
  items = sandbox_soak.build_mix(len(sandbox_soak.ALWAYS), 0, 0.2, 0.05, catalog,
                                 include=sandbox_soak.ALWAYS)
  assert sorted(i.name for i in items) == sorted(sandbox_soak.ALWAYS)
  assert set(sandbox_soak.IPC_ATTACKS) <= set(sandbox_soak.HOSTILE)


_LISTENER = ("import socket, time\nt = socket.socket()\nt.bind(('127.0.0.1', 0))\nt.listen()\n"
             "u = socket.socket(socket.AF_UNIX)\nu.bind('\\0mj_soak_control_%d' % id(u))\n"
             "u.listen()\nprint('up', flush=True)\ntime.sleep(30)\n")


def test_the_ipc_and_listener_checks_see_a_leak():
  # Negative controls: SysV shared memory, a semaphore set and a message queue under the attacks'
  # key (and a keyless segment, seen by its owner's uid), a POSIX message queue and a /dev/shm
  # entry named like the attacks', and listening TCP and unix sockets of a child of ours are all
  # counted; remove_ipc then takes the IPC objects away.
  s = sandbox_soak
  c = s.libc()
  ipc0, mq0, files0, socks0 = s.sysv_objects(), s.posix_mqueues(), s.listing(), s.listeners()
  made = [("shm", c.shmget(s.IPC_KEY_LEFT, 4096, s.IPC_CREAT | 0o600)),
          ("sem", c.semget(s.IPC_KEY_LEFT, 1, s.IPC_CREAT | 0o600)),
          ("msg", c.msgget(s.IPC_KEY_LEFT, s.IPC_CREAT | 0o600)),
          ("shm", c.shmget(0, 4096, s.IPC_CREAT | 0o600))]
  mq = c.mq_open(s.MQ_LEFT.encode(), os.O_CREAT | os.O_RDWR, 0o600, None)
  shm_file = f"/dev/shm/{s.MARK}_control"
  open(shm_file, "w").close()
  child = subprocess.Popen([sys.executable, "-c", _LISTENER], stdout=subprocess.PIPE)
  me = range(os.getuid(), os.getuid() + 1)
  try:
    assert all(i >= 0 for _, i in made) and mq >= 0
    keyed, _ = s.leaked_sysv(ipc0, s.sysv_objects(), range(0))
    assert sorted((o["kind"], o["id"]) for o in keyed) == sorted(made[:3])
    owned, _ = s.leaked_sysv(ipc0, s.sysv_objects(), me)
    assert set(made) <= {(o["kind"], o["id"]) for o in owned}
    assert s.leaked_mqueues(mq0, s.posix_mqueues())[0] == [s.MQ_LEFT]
    assert s.leaked_posix_shm(files0, s.listing(), range(0))[0] == [shm_file]
    assert child.stdout.readline() == b"up\n"
    socks, _ = s.leaked_listeners(socks0, s.listeners(), range(0))
    assert {x["proto"] for x in socks if child.pid in x["holders"]} == {"tcp", "unix"}
  finally:
    child.kill()
    child.wait()
    if mq >= 0:
      c.mq_close(mq)
    s.remove_ipc([dict(kind=k, id=i) for k, i in made if i >= 0], [s.MQ_LEFT], [shm_file])
  left = {(o["kind"], o["id"]) for o in s.leaked_sysv(ipc0, s.sysv_objects(), me)[0]}
  assert not set(made) & left
  assert s.leaked_mqueues(mq0, s.posix_mqueues())[0] == []
  assert not os.path.exists(shm_file)
