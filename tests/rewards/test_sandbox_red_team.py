"""The classes of the second red-team wave (issue #50), each met with new variants written here:
verdicts forged through the tests' helpers, Python semantics at the boundary and the output
comparison; answers passed between runs through IPC; host writes through links planted in the
run directory; namespaces that outlive their worker; hangs in our own process; cleanup that can
be defeated; nested namespaces. Every forgery must get no correctness reward, and nothing may be
left on the host."""
import json
import os
import secrets
import signal
import subprocess
import time

import pytest

import magistral_jax
from magistral_jax.data import records
from magistral_jax.rewards import run_judge, run_tree, sandbox
from magistral_jax.rewards.config import RewardConfig
from magistral_jax.rewards.reward import compute_reward
from magistral_jax.rewards.code_codec import decode_parsed
from magistral_jax.rewards.humaneval import prompt_helpers
from magistral_jax.rewards.sandbox_limits import Limits
from magistral_jax.verify.uids import uid_processes

CFG = RewardConfig(language_bonus=0.0, test_timeout_s=2.0)
PROJECT = os.path.dirname(os.path.dirname(os.path.abspath(magistral_jax.__file__)))
HUMANEVAL = {r["task_id"]: r for r in map(json.loads, open(os.path.join(
    PROJECT, "magistral_jax", "data", "sources", "humaneval_full.jsonl")))}
MARK = "mj_redteam_" + secrets.token_hex(4)


def _code(src, lang="python"):
  return f"<think>\nHere goes.\n</think>\n```{lang}\n{src}\n```\n"


def _score(task, src, lang="python", cfg=CFG):
  return compute_reward(task, _code(src, lang), None, cfg)


def _humaneval_tasks(task_id):
  """The task as the score CLI gives it (test_code + the prompt) and as the RL pipeline builds it
  from the dataset record (test_list + the prompt's helpers as test_setup_code)."""
  row = HUMANEVAL[task_id]
  rec = records.humaneval(row, source="humaneval", row_number=0)
  return [{"kind": "code", "problem": row["prompt"], "language": "python",
           "test_code": row["test"], "entry_point": row["entry_point"]},
          {"kind": "code", "problem": row["prompt"], "language": "python",
           "test_list": [t["input"] for t in rec["tests"]],
           "test_setup_code": rec["test_setup"]}]


@pytest.fixture(params=["default", "userns"])
def sbx(request, private_sandbox):
  return private_sandbox(request.param, 200)


# ----------------------------------------------------------------------------- the tests' helpers

# HumanEval/32: the test checks `poly(xs, candidate(xs))` is near 0, with the prompt's `poly`.
POLY_FORGED = "def poly(xs, x):\n  return 0.0\ndef find_zero(xs):\n  return 0.0\n"
# HumanEval/50: the test decodes what the prompt's `encode_shift` made. A candidate that keeps
# the helper right but records its arguments could answer with the recorded original.
SHIFT_RECORDER = """
_seen = {}
def encode_shift(s):
  out = "".join([chr(((ord(ch) + 5 - ord("a")) % 26) + ord("a")) for ch in s])
  _seen[out] = s
  return out
def decode_shift(s):
  return _seen.get(s, "")
"""
SHIFT_HONEST = ("def decode_shift(s):\n  return ''.join(chr(((ord(c) - 5 - ord('a')) % 26) + "
                "ord('a')) for c in s)\n")


@pytest.mark.parametrize("form", [0, 1], ids=["test_code", "pipeline"])
def test_helpers_named_by_the_prompt_are_the_prompts(sbx, form):
  assert _score(_humaneval_tasks("HumanEval/32")[form], POLY_FORGED).parts["correct"] == 0.0
  shift = _humaneval_tasks("HumanEval/50")[form]
  assert _score(shift, SHIFT_RECORDER).parts["correct"] == 0.0
  assert _score(shift, SHIFT_HONEST).parts["correct"] == 0.9


def test_prompt_helpers_drop_only_the_entry_point():
  src = prompt_helpers(HUMANEVAL["HumanEval/32"]["prompt"], "find_zero")
  assert "def poly" in src and "import math" in src and "find_zero" not in src
  assert prompt_helpers("not python (", "f") is None
  assert prompt_helpers("def g():\n  pass\n", "f") is None


# ----------------------------------------------------------------------------- the boundary

def _check(body):
  return {"kind": "code", "problem": "p", "language": "python", "entry_point": "f",
          "test_code": "def check(candidate):\n" + "".join(f"  {l}\n" for l in body)}


def test_exceptions_from_the_candidate_are_as_in_one_process_but_cannot_end_iteration(sbx):
  # StopIteration would end the map() silently, and BaseExceptions are no test's business: those
  # are sticky failures. An Exception is raised in the test as its builtin class, as one process
  # would: the test's own handler may expect it (issue #64: `except ValueError` failed honest
  # solutions when every raise was sticky).
  over_map = _check(["for a, b in zip([1, 2, 3], map(candidate, [1, 2, 3])):",
                     "  assert b == 2 * a"])
  assert _score(over_map, "def f(x):\n  raise StopIteration").parts["correct"] == 0.0
  assert _score(over_map, "def f(x):\n  return 2 * x").parts["correct"] == 0.9
  caught = _check(["try:", "  assert candidate(1) == 2", "except BaseException:", "  pass",
                   "assert candidate(2) == 4"])
  for exc, correct in (("ValueError", 0.9), ("AssertionError", 0.9), ("KeyboardInterrupt", 0.0),
                       ("GeneratorExit", 0.0), ("StopIteration", 0.0), ("SystemExit", 0.0)):
    src = f"def f(x):\n  if x == 1:\n    raise {exc}()\n  return 2 * x"
    assert _score(caught, src).parts["correct"] == correct, exc
  uncaught = _check(["assert candidate(1) == 2", "assert candidate(2) == 4"])
  assert _score(uncaught, "def f(x):\n  if x == 1:\n    raise ValueError\n  return 2 * x"
                ).parts["correct"] == 0.0


def test_mutation_and_identity_are_seen_as_in_one_process(sbx):
  # "Return a sorted copy; leave the input alone": sorting in place, or returning the input
  # itself, is caught; an honest copy passes.
  copy = _check(["x = [3, 1, 2]", "y = candidate(x)", "assert y == [1, 2, 3]",
                 "assert x == [3, 1, 2]", "assert y is not x"])
  assert _score(copy, "def f(a):\n  a.sort()\n  return sorted(a)").parts["correct"] == 0.0
  assert _score(copy, "def f(a):\n  a[:] = sorted(a)\n  return a").parts["correct"] == 0.0
  assert _score(copy, "def f(a):\n  return sorted(a)").parts["correct"] == 0.9
  # "Sort in place": the caller's list changes, nested containers keep their identity.
  in_place = _check(["x = [[3], [1], {'k': {2}}]", "inner = x[0]",
                     "assert candidate(x) is None", "assert x == [[3, 0], [1], {'k': {2, 5}}]",
                     "assert inner is x[0]", "d = {'a': [1]}", "assert candidate(d=d) is d",
                     "assert d == {'a': [1, 9]}"])
  honest = ("def f(x=None, d=None):\n  if d is not None:\n    d['a'].append(9)\n    return d\n"
            "  x[0].append(0)\n  x[2]['k'].add(5)\n")
  assert _score(in_place, honest).parts["correct"] == 0.9
  assert _score(in_place, "def f(x=None, d=None):\n  return None").parts["correct"] == 0.0


def test_a_flood_of_equal_hashes_is_refused_quickly():
  # 50,000 distinct integers with one hash: a quadratic set; refused before it is built.
  flood = {"s": [k * (2 ** 61 - 1) for k in range(1, 50001)]}
  t0 = time.monotonic()
  with pytest.raises(ValueError, match="colliding"):
    decode_parsed(flood)
  with pytest.raises(ValueError, match="colliding"):
    decode_parsed({"d": [[k, 0] for k in flood["s"]]})
  assert time.monotonic() - t0 < 5
  assert decode_parsed({"s": list(range(50000))}) == set(range(50000))


def test_a_forged_answer_line_with_colliding_hashes_fails_the_call(sbx):
  # The candidate writes the answer line itself, on the driver's answer pipe.
  src = ("import os\ndef f(x):\n  v = ','.join(str(k * (2 ** 61 - 1)) for k in range(1, 40001))\n"
         "  for fd in range(3, 8):\n    try:\n"
         "      os.write(fd, ('{\"id\":1,\"ok\":{\"s\":[' + v + ']}}\\n').encode())\n"
         "    except OSError:\n      pass\n  return set()")
  t0 = time.monotonic()
  r = _score(_check(["assert len(candidate(1)) == 40000"]), src)
  assert r.parts["correct"] == 0.0 and time.monotonic() - t0 < 15


def test_a_candidate_that_stops_reading_cannot_block_our_write(sbx):
  # It moves the driver's request pipe aside (kept open, never read) and stays alive: our 2 MB
  # request would block forever on a blocking write.
  src = ("import os, threading, time\nkeep = os.dup(3)\nos.dup2(os.open('/dev/null', os.O_RDONLY), 3)"
         "\nthreading.Thread(target=time.sleep, args=(1000,)).start()\ndef f(x):\n  return 1")
  t0 = time.monotonic()
  r = _score(_check(["assert candidate('x' * 2_000_000) == 1"]), src)
  assert r.parts["correct"] == 0.0
  assert time.monotonic() - t0 < Limits(cpu_s=CFG.test_timeout_s).backstop_s + 5


# ----------------------------------------------------------------------------- output comparison

def _stdin_task(pairs, **extra):
  return {"kind": "code", "problem": "p", "language": "python",
          "tests": [{"input": i, "output": o} for i, o in pairs], **extra}


def test_integers_are_compared_exactly_and_floats_only_within_the_asked_tolerance(sbx):
  modular = _stdin_task([("1\n", "1000000006\n")], tolerance=1e-6)
  assert _score(modular, "input()\nprint(1000000007)").parts["correct"] == 0.0
  assert _score(modular, "input()\nprint(1000000006)").parts["correct"] == 0.9
  big = _stdin_task([("1\n", "10000000000\n")])
  assert _score(big, "print(10000001000)").parts["correct"] == 0.0
  mean = _stdin_task([("1\n", "0.333333333\n")])
  assert _score(mean, "print('%.2f' % (1 / 3))").parts["correct"] == 0.0
  assert _score({**mean, "tolerance": 1e-6}, "print(1 / 3)").parts["correct"] == 0.9
  assert _score({**mean, "tolerance": 1e-6}, "print('%.2f' % (1 / 3))").parts["correct"] == 0.0
  assert compute_reward({**mean, "tolerance": "big"}, _code("print(1)"), None,
                        CFG).error.startswith("bad task")


# ----------------------------------------------------------------------------- IPC

IPC_WRITE = r"""
import ctypes, ctypes.util, os
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
key = 0x6D6A{k:04x}
sid = libc.shmget(key, 4096, 0o1666)            # IPC_CREAT | 0666
if sid >= 0:
  addr = libc.shmat(sid, None, 0)
  ctypes.memmove(addr, b"{secret}\0", 33)
libc.semget(key, 1, 0o1666)
libc.msgget(key, 0o1666)
rt = ctypes.CDLL(ctypes.util.find_library("rt") or "librt.so.1", use_errno=True)
rt.mq_open(b"/{mark}", os.O_CREAT | os.O_RDWR, 0o666, None)
with open("/dev/shm/{mark}", "w") as f:
  f.write("{secret}")
print(int(input()) * 2)
"""

IPC_READ = r"""
import ctypes, ctypes.util, os
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
found = []
sid = libc.shmget(0x6D6A{k:04x}, 0, 0)
if sid >= 0:
  found.append(ctypes.string_at(libc.shmat(sid, None, 0), 32).decode())
for name in ("semget", "msgget"):
  if getattr(libc, name)(0x6D6A{k:04x}, 0, 0) if name == "msgget" else libc.semget(0x6D6A{k:04x}, 0, 0) >= 0:
    found.append(name)
rt = ctypes.CDLL(ctypes.util.find_library("rt") or "librt.so.1", use_errno=True)
if rt.mq_open(b"/{mark}", os.O_RDONLY) >= 0:
  found.append("mq")
try:
  found.append(open("/dev/shm/{mark}").read())
except OSError:
  pass
print(found[0] if found else int(input()) * 2)
"""


def _sysv_ids():
  out = set()
  for kind in ("shm", "sem", "msg"):
    with open(f"/proc/sysvipc/{kind}") as f:
      out |= {(kind, line.split()[1]) for line in f.read().splitlines()[1:] if line.strip()}
  return out


def test_ipc_objects_are_private_to_a_run_and_gone_after_it(sbx):
  secret, k = secrets.token_hex(16), secrets.randbelow(1 << 16)
  before = _sysv_ids()
  fill = dict(k=k, secret=secret, mark=MARK)
  assert _score(_stdin_task([("4\n", "8\n")]), IPC_WRITE.format(**fill)).parts["correct"] == 0.9
  # A second run finds nothing the first left: reading it would print the secret and pass.
  r = _score(_stdin_task([("4\n", f"{secret}\n")]), IPC_READ.format(**fill))
  assert r.parts["correct"] == 0.0, r.info
  assert _sysv_ids() - before == set()
  assert not os.path.exists(f"/dev/shm/{MARK}") and not os.path.exists(f"/dev/mqueue/{MARK}")


# ----------------------------------------------------------------------------- the run directory

PLANT_LINKS = r"""
import os
for name in [".stdin", "solution.py", "prog", "input.txt", "x"]:
  for target in ("/tmp/{mark}_host", "/etc/{mark}_host"):
    try:
      if os.path.lexists(name):
        os.unlink(name)
      os.symlink(target, name)
    except OSError:
      pass
try:
  os.mkfifo("fifo")
  os.rename("fifo", ".stdin")
except OSError:
  pass
print(int(input().split()[0]) * 2)
"""

PLANT_LINKS_CPP = r"""#include <bits/stdc++.h>
#include <unistd.h>
#include <sys/stat.h>
int main() {{
  for (const char* n : {{".stdin", "prog", "prog.cpp", "x"}}) {{
    unlink(n); symlink("/tmp/{mark}_host", n);
  }}
  mkfifo("f", 0666); rename("f", ".stdin");
  long long a; std::cin >> a; std::cout << 2 * a << std::endl;
}}
"""


@pytest.mark.parametrize("lang", ["python", "cpp"])
def test_links_and_fifos_planted_in_the_run_dir_reach_nothing(sbx, lang):
  # Large inputs (past any pipe buffer) and several tests: each run's input must come from us,
  # never through a path the previous run could have replaced.
  big = "7 " + "1 " * 40000 + "\n"
  task = _stdin_task([(big, "14\n")] * 3, language=lang)
  src = (PLANT_LINKS if lang == "python" else PLANT_LINKS_CPP).format(mark=MARK)
  t0 = time.monotonic()
  r = _score(task, src, lang)
  assert r.parts["correct"] == 0.9, r.info
  assert time.monotonic() - t0 < 30
  assert not os.path.lexists(f"/tmp/{MARK}_host") and not os.path.lexists(f"/etc/{MARK}_host")


def test_the_run_dir_is_a_private_quota_and_deep_trees_vanish_with_it(sbx):
  src = ("import os\nfor i in range(2500):\n  os.mkdir('d')\n  os.chdir('d')\nos.chdir('/sandbox')\n"
         "try:\n  with open('big', 'wb') as f:\n    for _ in range(300):\n"
         "      f.write(b'x' * (1 << 20))\n  print('fit')\nexcept OSError:\n  print('full')\n")
  tmp_before = set(os.listdir("/tmp"))
  r = _score(_stdin_task([("1\n", "full\n")]), src)
  assert r.parts["correct"] == 0.9, r.info
  assert {n for n in set(os.listdir("/tmp")) - tmp_before if n.startswith("mj_sbx_")} == set()


def test_remove_tree_survives_depth_links_and_path_max(tmp_path):
  root = tmp_path / "run"
  outside = tmp_path / "outside"
  outside.mkdir()
  (outside / "keep").write_text("x")
  fd = os.open(tmp_path, os.O_RDONLY)
  os.mkdir("run", dir_fd=fd)
  d = os.open("run", os.O_RDONLY, dir_fd=fd)
  os.close(fd)
  for i in range(3000):            # 3,000 deep, 9,000 chars of path: past PATH_MAX and recursion
    os.symlink(str(outside), "link", dir_fd=d)
    os.mkdir("abc", dir_fd=d)
    nxt = os.open("abc", os.O_RDONLY, dir_fd=d)
    os.close(d)
    d = nxt
  os.close(d)
  run_tree.remove_tree(str(root))
  assert not root.exists() and (outside / "keep").read_text() == "x"


# ----------------------------------------------------------------------------- namespaces

def test_no_namespace_can_be_made_inside(sbx):
  src = ("import ctypes, os, subprocess\nlibc = ctypes.CDLL(None, use_errno=True)\n"
         "print(libc.unshare(0x10000000), libc.unshare(0x00020000))\n"
         "print(subprocess.run(['unshare', '-Ur', 'true']).returncode != 0)\n"
         "pid = os.fork()\nif pid == 0:\n  os._exit(7)\nprint(os.waitpid(pid, 0)[1] >> 8)\n")
  assert _score(_stdin_task([("1\n", "-1 -1\nTrue\n7\n")]), src).parts["correct"] == 0.9


def _uid_pids(uid):
  return uid_processes(uid)[0]


@pytest.mark.skipif(os.geteuid() != 0, reason="the uid drop that clears PDEATHSIG is root's")
def test_the_namespace_dies_with_whoever_started_it():
  # A middleman process starts a sandboxed program (with setsid() grandchildren) and is then
  # SIGKILLed, as the pool kills a worker: the parent-death signal, re-armed after the uid drop,
  # takes the namespace with it.
  uid = sandbox.process_uid_base() + 201
  script = (
      "import time\nfrom magistral_jax.rewards import sandbox\n"
      "from magistral_jax.rewards.sandbox_limits import Limits\n"
      "s = sandbox.Sandbox(uid=%d)\nd = s.make_dir()\n"
      "p = s.start(['/usr/bin/python3', '-c', 'import os, time\\nif os.fork() == 0:\\n"
      "  os.setsid()\\n  time.sleep(1000)\\ntime.sleep(1000)'], d, Limits(cpu_s=60))\n"
      "print('started', flush=True)\ntime.sleep(1000)\n" % uid)
  mid = subprocess.Popen([os.sys.executable, "-c", script], stdout=subprocess.PIPE)
  try:
    assert mid.stdout.readline().strip() == b"started"
    deadline = time.monotonic() + 10
    while len(_uid_pids(uid)) < 2 and time.monotonic() < deadline:
      time.sleep(0.05)
    assert len(_uid_pids(uid)) >= 2
  finally:
    mid.send_signal(signal.SIGKILL)
    mid.wait()
  deadline = time.monotonic() + 5
  while _uid_pids(uid) and time.monotonic() < deadline:
    time.sleep(0.05)
  assert _uid_pids(uid) == []
  sandbox.remove_leftovers(mid.pid)


# ----------------------------------------------------------------------------- CPU, not wall time

def test_the_backstop_judges_idle_programs_wrong_and_spent_ones_by_their_limit(sbx):
  # Which runs the host starved is tested in test_sandbox_wave4.py (run_judge).
  d = sbx.make_dir()
  try:
    limits = Limits(cpu_s=30, wall_factor=0.0, wall_extra_s=1.5)
    idle = sbx.run(["/usr/bin/python3", "-c", "import time; time.sleep(100)"], d, limits)
    assert idle.timed_out and idle.fault is None, idle
    # Used up its CPU: its own time limit, whatever the clock says.
    spent = sbx.run(["/usr/bin/python3", "-c", "while True: pass"], d,
                    Limits(cpu_s=0.5, wall_factor=0.0, wall_extra_s=1.5))
    assert spent.fault is None and spent.returncode != 0, spent
  finally:
    sbx.remove_dir(d)


def test_a_fault_is_an_error_not_a_wrong_answer(sbx, monkeypatch):
  # A host too loaded to judge the run in time: no verdict, an error, so the group is dropped.
  monkeypatch.setattr(run_judge, "judge_overrun", lambda watch, elapsed, cpu: (0.5, "overloaded"))
  task = _stdin_task([("1\n", "2\n")])
  r = _score(task, "import time\ntime.sleep(100)", cfg=RewardConfig(language_bonus=0.0,
                                                                    test_timeout_s=0.5))
  assert r.error and r.error.startswith("verifier fault") and r.reward == 0.0, r
  r = _score(_check(["assert candidate(1) == 2"]), "import time\ndef f(x):\n  time.sleep(100)",
             cfg=RewardConfig(language_bonus=0.0, test_timeout_s=0.5))
  assert r.error and r.error.startswith("verifier fault"), r
