"""The verifier pool: correct results, timeouts, crashes, recycling, back-pressure, clean exit,
slot uids of its own, a dead worker's sandboxes killed with it, and a pool that neither stops on
a failing cleanup nor leaves a future unresolved when its dispatcher fails."""
import glob
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from magistral_jax.rewards import sandbox
from magistral_jax.rewards.config import RewardConfig
from magistral_jax.verify import pool as pool_mod
from magistral_jax.verify.pool import VerifierPool
from magistral_jax.verify.config import VerifierConfig
from magistral_jax.verify.uids import claim_uid_offsets, kill_uid_processes

CFG = RewardConfig(language_bonus=0.0, test_timeout_s=1.5, math_timeout_s=1)
MATH = {"kind": "math", "problem": "p", "answer": "5"}
STDIN = {"kind": "code", "problem": "Double it.", "language": "python",
         "tests": [{"input": f"{i}\n", "output": f"{2 * i}\n"} for i in range(1, 6)]}


def _math(box):
  return f"<think>\nx\n</think>\n\\boxed{{{box}}}"


def _code(src):
  return f"<think>\nx\n</think>\n```python\n{src}\n```"


GOOD = _code("print(2 * int(input()))")
SLOW = _code("import time\ntime.sleep(1.2)\nprint(2 * int(input()))")   # 5 x 1.2 s > 3 s


def _alive(pid):
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  with open(f"/proc/{pid}/status") as f:   # a zombie is not alive
    return "zombie" not in f.read()


def _uid_processes(uids):
  out = []
  for p in os.listdir("/proc"):
    if p.isdigit():
      try:
        with open(f"/proc/{p}/status") as f:
          st = f.read()
      except OSError:
        continue
      uid = int(st.split("Uid:")[1].split()[0])
      if uid in uids and "zombie" not in st:
        out.append(int(p))
  return out


@pytest.fixture(scope="module")
def pool():
  with VerifierPool(2, CFG, task_timeout_s=3.0, max_tasks_per_worker=4, max_queue=4) as p:
    yield p


def test_pool_scores_correctly_and_keeps_serving_through_hostile_code(pool):
  items = [
      (MATH, _math(5), None, 0, 1.0),
      (MATH, _math(6), None, 0, 0.1),
      (MATH, _math("9^{9^{9^{9}}}"), None, 0, None),   # 0.1, or 0.0 if the hard kill hits
      (MATH, "", None, 0, 0.0),
      (STDIN, GOOD, None, 0, 1.0),
      (STDIN, _code("import os\nwhile True:\n  try:\n    os.fork()\n  except OSError:\n    pass"), None, 0, 0.1),
      (STDIN, _code("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nos.kill(-1, 9)"), None, 0, 0.1),
      (STDIN, _code("x = bytearray(10 * 1024**3)"), None, 0, 0.1),
      (MATH, _math(5), 10, 0, 1.0),
      (STDIN, GOOD, None, 3, 1.0),
  ]
  futs = [pool.submit(t, r, n, s) for t, r, n, s, _ in items]
  got = [f.result(timeout=60) for f in futs]
  for g, (*_, want) in zip(got, items):
    if want is None:
      assert g.parts["correct"] == 0.0
    else:
      assert g.reward == pytest.approx(want), g
  # Recycling (4 tasks per worker here) hands a slot over once the successor is ready.
  deadline = time.monotonic() + 60
  while pool.metrics()["recycled"] < 1 and time.monotonic() < deadline:
    time.sleep(0.05)
  m = pool.metrics()
  assert m["completed"] >= len(items) and m["recycled"] >= 1
  assert m["latency_p95_s"] > 0 and m["throughput_per_s"] > 0


def test_recycling_keeps_the_slot_serving_while_the_successor_starts():
  # One worker, recycled every 2 tasks: the old worker keeps scoring while its successor
  # imports and warms up, so no task waits for a worker to start (the slot is never empty).
  with VerifierPool(1, CFG, task_timeout_s=30.0, max_tasks_per_worker=2) as p:
    assert p.submit(MATH, _math(5)).result(timeout=60).reward == 1.0   # first worker ready
    for i in range(12):
      r = p.submit(MATH, _math(5 if i % 2 else 4)).result(timeout=60)
      assert r.reward == pytest.approx(1.0 if i % 2 else 0.1)
      assert p._workers[0].ready   # whoever holds the slot is a started, warm worker
    deadline = time.monotonic() + 60
    while p.metrics()["recycled"] < 1 and time.monotonic() < deadline:
      time.sleep(0.05)
    assert p.metrics()["recycled"] >= 1
    assert len(p.worker_pids()) <= 2   # at most the worker and one successor


def test_from_config_builds_the_pool_the_verifier_section_describes():
  cfg = VerifierConfig(num_workers=1, task_timeout_s=30.0, max_tasks_per_worker=7)
  with VerifierPool.from_config(cfg, CFG) as p:
    assert (p.num_workers, p.task_timeout_s, p.max_tasks_per_worker) == (1, 30.0, 7)
    assert p.reward_cfg is CFG
    assert p.submit(MATH, _math(5)).result(timeout=60).reward == 1.0


@pytest.mark.parametrize("field", ["num_workers", "task_timeout_s", "max_tasks_per_worker"])
def test_verifier_config_errors_name_the_field(field):
  with pytest.raises(ValueError, match=f"verifier.{field}="):
    VerifierConfig(**{field: 0})


def test_timed_out_task_resolves_to_zero_and_the_pool_recovers(pool, monkeypatch):
  # A worker that hangs past a task's deadline: here the deadline leaves out the task's own
  # budget (as if its limits allowed nothing), so 5 x 1.2 s overruns the 3 s left.
  monkeypatch.setattr(pool_mod.code_check, "worst_case_s", lambda *a: 0.0)
  before = pool.metrics()["timeouts"]
  r = pool.submit(STDIN, SLOW).result(timeout=60)
  assert r.reward == 0.0 and "timed out" in r.error
  assert pool.metrics()["timeouts"] == before + 1
  assert pool.submit(STDIN, GOOD).result(timeout=60).reward == 1.0


def test_a_slow_honest_program_is_never_cut_by_the_pool(pool):
  # The same slow program, each of its 5 tests right: its deadline follows from its own limits
  # (5 tests x each run's backstop), not the pool's 3 s, so it passes.
  before = pool.metrics()["timeouts"]
  r = pool.submit(STDIN, SLOW).result(timeout=120)
  assert r.error is None and r.reward == 1.0, r
  assert pool.metrics()["timeouts"] == before
  assert pool_mod.code_check.worst_case_s(STDIN, CFG.num_tests, CFG.test_timeout_s,
                                          CFG.compile_timeout_s) >= 5 * 7.5


def test_pool_survives_a_worker_killed_mid_task(pool):
  before = pool.metrics()["crashes"]
  fut = pool.submit(STDIN, _code("import time\ntime.sleep(1.0)\nprint(2 * int(input()))"))
  deadline = time.monotonic() + 30
  while pool.metrics()["busy"] == 0 and time.monotonic() < deadline:
    time.sleep(0.01)
  busy = [w for w in pool._workers if w.tid is not None]
  assert busy
  pid = busy[0].proc.pid
  while not glob.glob(f"{tempfile.gettempdir()}/mj_sbx_{pid}_*") and time.monotonic() < deadline:
    time.sleep(0.01)   # kill it mid-run, with its run dir there
  os.kill(pid, signal.SIGKILL)
  r = fut.result(timeout=60)
  assert r.reward == 0.0 and "died" in r.error
  # Its run dir goes too (removed when the dispatcher replaces it, just after resolving).
  deadline = time.monotonic() + 10
  while glob.glob(f"{tempfile.gettempdir()}/mj_sbx_{pid}_*") and time.monotonic() < deadline:
    time.sleep(0.05)
  assert glob.glob(f"{tempfile.gettempdir()}/mj_sbx_{pid}_*") == []
  assert pool.metrics()["crashes"] == before + 1
  results = [f.result(timeout=60) for f in [pool.submit(MATH, _math(5)) for _ in range(4)]]
  assert all(x.reward == 1.0 for x in results)


def test_bounded_queue_applies_back_pressure():
  with VerifierPool(1, CFG, task_timeout_s=30, max_queue=2) as p:
    seen, futs = [], []

    def producer():
      for _ in range(8):
        futs.append(p.submit(MATH, _math(5)))

    t = threading.Thread(target=producer)
    t.start()
    while t.is_alive():
      seen.append(p.metrics()["queued"])
      time.sleep(0.005)
    t.join()
    assert max(seen) <= 2
    assert [f.result(timeout=60).reward for f in futs] == [1.0] * 8


def test_close_leaves_no_orphan_processes():
  p = VerifierPool(2, CFG, task_timeout_s=30)
  # A setsid grandchild that would outlive a process-group kill.
  leak = _code("import os, time\nif os.fork() == 0:\n  os.setsid()\n  time.sleep(1000)\n"
               "time.sleep(1000)")
  futs = [p.submit(STDIN, leak), p.submit(MATH, _math(5))]
  time.sleep(0.5)
  pids = p.worker_pids()
  p.close(timeout=0.5)     # abandons the running task
  uids = {p.uid_base + s for s in range(2)}
  assert all(f.done() for f in futs)
  deadline = time.monotonic() + 5
  while (any(_alive(x) for x in pids) or _uid_processes(uids)) and time.monotonic() < deadline:
    time.sleep(0.05)
  assert not any(_alive(x) for x in pids)
  assert _uid_processes(uids) == []
  with pytest.raises(RuntimeError, match="closed"):
    p.submit(MATH, _math(5))


def test_slot_uids_are_this_process_own_and_never_shared(pool):
  # 1_000_000 + 256 * pid + slot: no other process's block; two live pools of one process take
  # distinct slots of it; 255 (a stand-alone Sandbox's) is never a slot.
  base = 1_000_000 + 256 * os.getpid()
  with VerifierPool(1, CFG, task_timeout_s=30) as other:
    mine = {pool.uid_base + s for s in range(pool.num_workers)}
    theirs = {other.uid_base}
    assert not mine & theirs
    assert all(base <= u < base + 255 for u in mine | theirs)
    with pytest.raises(ValueError, match="free sandbox uids"):
      claim_uid_offsets(255)
  for n in (0, 256, 1000):
    with pytest.raises(ValueError, match="num_workers"):
      VerifierPool(n, CFG)


def _escaped_sandbox(uid):
  """Processes of `uid` that left their session and parent, as a sandbox whose worker died in
  the setresuid window leaves them (issue #50)."""
  subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--", "sh",
                  "-c", "setsid sh -c 'sleep 1000 & sleep 1000' & exit 0"], check=True)
  deadline = time.monotonic() + 10
  while len(_uid_processes({uid})) < 2 and time.monotonic() < deadline:
    time.sleep(0.02)
  assert len(_uid_processes({uid})) >= 2


root_only = pytest.mark.skipif(os.geteuid() != 0, reason="sandbox uids need root")


@root_only
def test_kill_uid_processes_kills_everything_of_the_uid_and_nothing_else():
  uid = 1_000_000 + 256 * 4_000_000 + 7    # a pid above pid_max: nobody's block
  _escaped_sandbox(uid)
  bystander = subprocess.Popen(["sleep", "30"])
  try:
    found, left = kill_uid_processes(uid)
    assert found >= 2 and left == 0
    assert _uid_processes({uid}) == []
    assert _alive(bystander.pid) and _alive(os.getpid())
  finally:
    bystander.kill()
    bystander.wait()
  for uid in (0, os.getuid(), 1000):   # root's, ours, a real account's: never
    with pytest.raises(ValueError, match="refusing"):
      kill_uid_processes(uid)


@root_only
def test_a_dead_worker_takes_everything_of_its_slot_uid_before_the_successor_starts():
  # A run that daemonizes and sleeps is alive in the sandbox when its worker is SIGKILLed, and
  # processes of the slot uid that escaped earlier are there too: none may be alive when the
  # successor scores its first task (the sweep runs before the successor starts).
  daemon = _code("import os, time\nfor _ in range(3):\n  if os.fork() == 0:\n    os.setsid()\n"
                 "    if os.fork() == 0:\n      time.sleep(1000)\n    os._exit(0)\n"
                 "time.sleep(1000)")
  with VerifierPool(1, CFG, task_timeout_s=30) as p:
    uid = p.uid_base
    assert p.submit(MATH, _math(5)).result(timeout=60).reward == 1.0
    _escaped_sandbox(uid)
    fut = p.submit(STDIN, daemon)
    deadline = time.monotonic() + 30
    while len(_uid_processes({uid})) < 4 and time.monotonic() < deadline:
      time.sleep(0.02)   # the run's own processes are up (the escaped ones count 2)
    assert len(_uid_processes({uid})) >= 4
    os.kill(p.worker_pids()[0], signal.SIGKILL)
    r = fut.result(timeout=60)
    assert r.reward == 0.0 and "died" in r.error
    assert p.submit(STDIN, GOOD).result(timeout=60).reward == 1.0
    assert _uid_processes({uid}) == []
    m = p.metrics()
    assert m["crashes"] == 1 and m["orphans_killed"] >= 2 and m["orphans_left"] == 0
  assert _uid_processes({uid}) == []


def test_a_failing_cleanup_is_counted_and_the_pool_serves_on(monkeypatch):
  # Issue #50: rmtree raised RecursionError on a 2,500-deep tree while the dispatcher cleaned a
  # killed worker's run dirs; the dispatcher died and no future of the batch ever resolved.
  real = sandbox.remove_leftovers
  threads = []

  def deep_tree(pid, *args, **kwargs):
    threads.append(threading.current_thread().name)
    raise RecursionError("maximum recursion depth exceeded while calling a Python object")

  monkeypatch.setattr(sandbox, "remove_leftovers", deep_tree)
  slow = _code("import time\ntime.sleep(1.0)\nprint(2 * int(input()))")
  with VerifierPool(1, CFG, task_timeout_s=30) as p:
    assert p.submit(MATH, _math(5)).result(timeout=60).reward == 1.0
    fut = p.submit(STDIN, slow)
    deadline = time.monotonic() + 30
    while p.metrics()["busy"] == 0 and time.monotonic() < deadline:
      time.sleep(0.01)
    pid = p.worker_pids()[0]
    time.sleep(0.2)
    os.kill(pid, signal.SIGKILL)
    r = fut.result(timeout=60)
    assert r.reward == 0.0 and "died" in r.error
    results = [f.result(timeout=60) for f in [p.submit(MATH, _math(5)), p.submit(STDIN, GOOD)]]
    assert [x.reward for x in results] == [1.0, 1.0]
    m = p.metrics()
    assert m["cleanup_errors"] >= 1 and m["stopped"] is None
  assert "verifier-pool" in threads   # it raised in the dispatcher, which served on
  real(pid)


def test_a_failed_dispatcher_fails_every_task_and_stops_the_pool(monkeypatch):
  # A failure outside the guarded cleanups: the running and the queued tasks all resolve, with
  # an error naming it; submit raises afterwards; metrics say why; close still works.
  slow = _code("import time\ntime.sleep(1.5)\nprint(2 * int(input()))")
  p = VerifierPool(2, CFG, task_timeout_s=30)
  try:
    assert [f.result(timeout=60).reward for f in [p.submit(MATH, _math(5)) for _ in range(2)]] \
        == [1.0, 1.0]

    def broken(w):
      raise ValueError("boom in the dispatcher")

    monkeypatch.setattr(p._slots, "maybe_recycle", broken)   # runs after every finished task
    running = p.submit(STDIN, slow)
    deadline = time.monotonic() + 30
    while p.metrics()["busy"] == 0 and time.monotonic() < deadline:
      time.sleep(0.01)
    first = p.submit(MATH, _math(5))      # finishes first, then the dispatcher fails
    queued = [p.submit(MATH, _math(5)) for _ in range(3)]
    assert first.result(timeout=60).reward == 1.0
    for f in [running, *queued]:
      r = f.result(timeout=30)
      assert r.reward == 0.0 and "verifier pool stopped" in r.error
      assert "ValueError: boom in the dispatcher" in r.error
    with pytest.raises(RuntimeError, match="verifier pool stopped: .*boom"):
      p.submit(MATH, _math(5))
    assert "boom" in p.metrics()["stopped"]
    pids = p.worker_pids()
  finally:
    p.close(timeout=5)
  deadline = time.monotonic() + 10
  while any(_alive(x) for x in pids) and time.monotonic() < deadline:
    time.sleep(0.05)
  assert not any(_alive(x) for x in pids)


_RAY_CHECK = r"""
import os
import ray
from tests.verify.test_pool import CFG, GOOD, MATH, STDIN, _code, _math
from magistral_jax.verify.config import VerifierConfig
from magistral_jax.verify.pool import VerifierPool
from magistral_jax.verify.ray_pool import RayVerifierPool
ray.init(num_cpus=2, include_dashboard=False)
try:
  # The run config's verifier.backend="ray" builds this backend.
  cfg = VerifierConfig(num_workers=2, task_timeout_s=30, backend="ray")
  with VerifierPool.from_config(cfg, CFG) as p:
    assert isinstance(p, RayVerifierPool)
    assert p.submit(MATH, _math(5)).result(timeout=120).reward == 1.0
    assert p.submit(STDIN, GOOD).result(timeout=120).reward == 1.0
    # The actors' sandbox is the same: a private filesystem, and a write to /tmp goes nowhere.
    mark = f"mj_ray_{os.getpid()}"
    leak = _code(f"open('/tmp/{mark}', 'w').write('x')\nprint(2 * int(input()))")
    assert p.submit(STDIN, leak).result(timeout=120).reward == 1.0
    assert not os.path.exists(f"/tmp/{mark}")
    assert p.submit(STDIN, _code("import os\nos._exit(0)")).result(timeout=120).reward == 0.1
    assert p.metrics()["completed"] == 4
finally:
  ray.shutdown()
print("ray backend ok")
"""


def test_ray_backend_has_the_same_interface():
  # In a process of its own: Ray's runtime lives in its driver process (threads, a connection to
  # its own services), and a failure of it must fail this test, not abort the whole session.
  pytest.importorskip("ray")
  # From the repository root, where `python -c` finds this file as tests.verify.test_pool.
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  r = subprocess.run([sys.executable, "-c", _RAY_CHECK], cwd=root, capture_output=True,
                     text=True, timeout=600)
  assert r.returncode == 0 and "ray backend ok" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
