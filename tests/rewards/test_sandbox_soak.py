"""The short form of bench/sandbox_soak.py (issue #33 item 4, issue #50): a mix of hostile, correct
and wrong programs through a 2-worker VerifierPool whose busy workers are SIGKILLed every so often
(chaos). Every verdict must be the known one (a killed worker's task gets none: faulted, dropped),
no task lost, and nothing left behind: no process of the sandbox uids or child of ours, no file
outside the run dirs, no run dir, no IPC object, no listening socket, no run cgroup, no key of a
sandbox uid; and no verifier fault on an honest program beside the hostile ones. No timing assertions (the
throughput ratio is the bench's, on a quiet host). The bench runs as a script, as it does on its
own (its JSON last line is the result). The negative controls below check that each leak detector
(host_leaks.py) sees a planted leak of its kind and that the verdict rule holds."""
import json
import os
import signal
import subprocess
import sys

import host_leaks
import hostile_programs
import known_verdicts
import pytest
from hostile_programs import ALWAYS, ATTACKS, IPC_ATTACKS, IPC_KEY_LEFT, MARK, MQ_LEFT

from magistral_jax.rewards import run_cgroup, sandbox, sandbox_keys
from magistral_jax.rewards.config import RewardConfig
from magistral_jax.rewards.reward import RewardResult

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
  assert result["leaked_cgroups"] == 0, result["leaked_cgroups_first"]
  assert result["leaked_keys"] == 0, result["leaked_keys_by_uid"]


def test_honest_programs_beside_hostile_ones_get_no_verifier_fault(result):
  # Starving, flooding and forking neighbours (the whole-run attacks, in every mix) must not make
  # our limits stop an honest program: that would be a dropped group, not a verdict.
  assert result["honest_verifier_faults"] == 0, result["faulted_first"]


def test_no_ipc_object_or_listener_is_left_behind(result):
  # Until each run gets an IPC namespace, the IPC attacks leave their objects here.
  assert result["leaked_sysv_ipc"] == 0, result["leaked_sysv_ipc_first"]
  assert result["leaked_posix_mqueues"] == 0, result["leaked_posix_mqueues_first"]
  assert result["leaked_posix_shm"] == 0, result["leaked_posix_shm_first"]
  assert result["leaked_listeners"] == 0, result["leaked_listeners_first"]


def test_the_reading_attacks_would_pass_without_the_sandbox(result):
  # So their failing in the sandbox means the secret was out of reach, not a broken attack.
  assert all(result["read_attacks_pass_bare"].values()), result["read_attacks_pass_bare"]


def test_every_mix_has_the_ipc_attacks_the_holders_and_the_whole_run_attacks(result):
  assert result["always_in_mix"] == sorted(ALWAYS)
  assert set(IPC_ATTACKS) <= set(ATTACKS) and result["ipc_attacks"] == list(IPC_ATTACKS)


# ---- negative controls: each leak detector sees a leak of its kind ---------------------------

def test_the_leak_checks_see_a_leak():
  # Without a pool: a file an attack named, a run dir of a worker pid and a live child of ours.
  made = [os.path.join("/tmp", MARK + "_control"), "/tmp/mj_sbx_999999999_control"]
  before = host_leaks.listing()
  child = None
  try:
    for p in made:
      open(p, "w").close()
    child = subprocess.Popen(["sleep", "30"])
    files, _ = host_leaks.leaked_files(before, host_leaks.listing(), range(0), {999999999})
    assert sorted(made) == [f for f in files if f in made], files[:20]
    assert child.pid in [p["pid"] for p in host_leaks.leaked_processes(range(0))]
  finally:
    if child is not None:
      child.kill()
      child.wait()
    host_leaks.unplant_files(made)


def test_the_cgroup_and_key_checks_see_a_leak():
  # A run cgroup left under ours, and a key a sandbox uid made (run bare, as that uid).
  bases = [h.base for h in run_cgroup.own_hierarchies()]
  uid = sandbox.process_uid_base() + 230
  before = host_leaks.snapshot(range(uid, uid + 1))
  made = []
  try:
    for b in bases[:1]:
      made.append(os.path.join(b, run_cgroup.PREFIX + "control"))
      os.mkdir(made[-1])
    python = next((p for p in ("/usr/bin/python3", "/usr/local/bin/python3")
                   if os.access(p, os.X_OK)), None)
    if python is None:
      pytest.skip("no system python for the sandbox uid")
    r = subprocess.run([python, "-I", "-S", "-c", hostile_programs.KEYRING], capture_output=True,
                       preexec_fn=lambda: (os.setgid(uid), os.setuid(uid)), timeout=30, cwd="/")
    assert r.stdout.strip() == b"2", r   # the kernel has keys here, and this one was made
    assert host_leaks.new_keys(before["keys"], [uid], wait_s=0)
    rep = host_leaks.report(before, range(uid, uid + 1), set())
    assert rep["leaked_cgroups"] == len(made), rep["leaked_cgroups_first"]
    assert rep["leaked_keys"] >= 1, rep["leaked_keys_by_uid"]   # waited 10 s: not a sweep's lag
  finally:
    for d in made:
      os.rmdir(d)
    sandbox_keys.remove_uid_keys(uid)
  assert not host_leaks.new_keys(before["keys"], [uid])


def test_a_hostile_pass_is_a_wrong_verdict():
  item = known_verdicts.Item("hostile", "stdin_py", "x", {}, "")
  cfg = RewardConfig(language_bonus=0.0)
  assert not known_verdicts.verdict_ok(item, RewardResult(1.0, {"correct": 0.9}), cfg)
  assert known_verdicts.verdict_ok(item, RewardResult(0.1, {"correct": 0.0}), cfg)


def test_every_mix_holds_each_of_always_once(tmp_path):
  items = known_verdicts.build_mix(len(ALWAYS), 0, 0.2, 0.05, known_verdicts.Catalog(str(tmp_path)),
                                   include=ALWAYS)
  assert sorted(i.name for i in items) == sorted(ALWAYS)


def test_the_ipc_and_listener_checks_see_a_leak():
  # SysV shared memory, a semaphore set and a message queue under the attacks' key (and a keyless
  # segment, seen by its owner's uid), a POSIX message queue and a /dev/shm entry named like the
  # attacks', and listening TCP and unix sockets of a child of ours are all counted; remove_ipc
  # then takes the IPC objects away.
  c = host_leaks.libc()
  before = host_leaks.snapshot()
  made, mq, child = [], -1, None
  shm_file = f"/dev/shm/{MARK}_control"
  me = range(os.getuid(), os.getuid() + 1)
  creat = host_leaks.IPC_CREAT | 0o600
  try:
    made = [("shm", c.shmget(IPC_KEY_LEFT, 4096, creat)), ("sem", c.semget(IPC_KEY_LEFT, 1, creat)),
            ("msg", c.msgget(IPC_KEY_LEFT, creat)), ("shm", c.shmget(0, 4096, creat))]
    mq = c.mq_open(MQ_LEFT.encode(), os.O_CREAT | os.O_RDWR, 0o600, None)
    open(shm_file, "w").close()
    child = subprocess.Popen([sys.executable, "-c", _LISTENER], stdout=subprocess.PIPE)
    assert all(i >= 0 for _, i in made) and mq >= 0, (made, mq)
    after = host_leaks.snapshot()
    keyed, _ = host_leaks.leaked_sysv(before["sysv"], after["sysv"], range(0))
    assert sorted((o["kind"], o["id"]) for o in keyed) == sorted(made[:3])
    owned, _ = host_leaks.leaked_sysv(before["sysv"], after["sysv"], me)
    assert set(made) <= {(o["kind"], o["id"]) for o in owned}
    assert host_leaks.leaked_mqueues(before["mqueues"], after["mqueues"])[0] == [MQ_LEFT]
    assert host_leaks.leaked_posix_shm(before["files"], after["files"], range(0))[0] == [shm_file]
    assert child.stdout.readline() == b"up\n"
    socks, _ = host_leaks.leaked_listeners(before["listeners"], host_leaks.listeners(), range(0))
    assert {x["proto"] for x in socks if child.pid in x["holders"]} == {"tcp", "unix"}, socks[:20]
  finally:
    if child is not None:
      child.kill()
      child.wait()
    if mq >= 0:
      c.mq_close(mq)
    host_leaks.remove_ipc([dict(kind=k, id=i) for k, i in made if i >= 0], [MQ_LEFT], [shm_file])
  left = host_leaks.leaked_sysv(before["sysv"], host_leaks.sysv_objects(), me)[0]
  assert not set(made) & {(o["kind"], o["id"]) for o in left}
  assert host_leaks.leaked_mqueues(before["mqueues"], host_leaks.posix_mqueues())[0] == []
  assert not os.path.exists(shm_file)


_LISTENER = ("import socket, time\nt = socket.socket()\nt.bind(('127.0.0.1', 0))\nt.listen()\n"
             "u = socket.socket(socket.AF_UNIX)\nu.bind('\\0mj_soak_control_%d' % id(u))\n"
             "u.listen()\nprint('up', flush=True)\ntime.sleep(30)\n")
