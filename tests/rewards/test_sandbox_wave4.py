"""The classes of the fourth red-team wave (issue #64), met with new variants written here: kernel
interfaces that outlive a run or escape the filter's view (the keyring, io_uring, userfaultfd,
ptrace, personality, perf, bpf, vsock), keys left behind, verdicts learned from which tests run
next, and faults a program could force on the verifier. Every hostile program must be judged as
failing (reward without correctness), never as a verifier fault."""
import ast
import os
import platform
import subprocess
import sys
import time

import pytest

from magistral_jax.rewards import sandbox
from magistral_jax.rewards.config import RewardConfig
from magistral_jax.rewards.reward import compute_reward
from magistral_jax.rewards import (code_asserts, code_guard, run_judge, run_tree,
                                   sandbox_command, sandbox_keys, sandbox_root)
from magistral_jax.rewards.sandbox_limits import Limits
from magistral_jax.rewards.sandbox_root import SECCOMP, seccomp_program

CFG = RewardConfig(language_bonus=0.0, test_timeout_s=2.0)
NUMBERS = SECCOMP.get(platform.machine())
needs_filter = pytest.mark.skipif(NUMBERS is None, reason="no seccomp numbers for this machine")


def _code(src, lang="python"):
  return f"<think>\nHere goes.\n</think>\n```{lang}\n{src}\n```\n"


def _score(task, src, lang="python", cfg=CFG):
  return compute_reward(task, _code(src, lang), None, cfg)


def _stdin_task(pairs, language="python"):
  return {"kind": "code", "problem": "p", "language": language,
          "tests": [{"input": i, "output": o} for i, o in pairs]}


@pytest.fixture(params=["default", "userns"])
def sbx(request, private_sandbox):
  return private_sandbox(request.param, 210)


# ----------------------------------------------------------------------------- the filter itself

def _run_filter(program, arch, nr, arg0=0, arg1=0):
  """What the kernel would do with one syscall: a small cBPF interpreter over the instructions
  seccomp_program builds (only the opcodes it uses)."""
  data = {0: nr, 4: arch, 16: arg0 & 0xFFFFFFFF, 24: arg1 & 0xFFFFFFFF, 28: arg1 >> 32}
  acc, pc = 0, 0
  while True:
    code, jt, jf, k = program[pc]
    if code == 0x20:
      acc = data[k]
    elif code == 0x06:
      return k
    else:
      taken = {0x15: acc == k, 0x35: acc >= k, 0x45: bool(acc & k)}[code]
      pc += jt if taken else jf
    pc += 1


@pytest.mark.parametrize("machine", sorted(SECCOMP))
def test_the_filter_refuses_what_it_lists_and_allows_the_rest(machine):
  nums = SECCOMP[machine]
  prog = seccomp_program(nums)
  run = lambda name, arg0=0: _run_filter(prog, nums["arch"], nums[name], arg0)
  for name in sandbox_root.SECCOMP_DENIED:
    assert run(name) == sandbox_root.SECCOMP_EPERM, name
  assert run("clone3") == sandbox_root.SECCOMP_ENOSYS
  assert run("clone", 0x10000000) == sandbox_root.SECCOMP_EPERM        # CLONE_NEWUSER
  assert run("clone", 0x01200011) == sandbox_root.SECCOMP_ALLOW        # what fork() passes
  assert run("socket", 40) == sandbox_root.SECCOMP_EPERM               # AF_VSOCK
  assert run("socket", 40 + (1 << 32)) == sandbox_root.SECCOMP_EPERM   # the kernel reads an int
  for family in (1, 2, 10):                                            # unix, inet, inet6
    assert run("socket", family) == sandbox_root.SECCOMP_ALLOW
  assert run("personality", 0xFFFFFFFF) == sandbox_root.SECCOMP_ALLOW  # a query
  assert run("personality", 0) == sandbox_root.SECCOMP_ALLOW
  assert run("personality", 0x0040000) == sandbox_root.SECCOMP_EPERM   # ADDR_NO_RANDOMIZE
  for nr in (0, 1, 2, 60, 231):                                        # read, write, ... exit
    assert _run_filter(prog, nums["arch"], nr) == sandbox_root.SECCOMP_ALLOW
  assert _run_filter(prog, nums["arch"], 0x40000000 + 1) == sandbox_root.SECCOMP_EPERM  # x32
  assert _run_filter(prog, 0x40000003, 1) == sandbox_root.SECCOMP_KILL  # another ABI (i386)


# ----------------------------------------------------------------------------- inside a run

# Each tries one interface with arguments that would work unfiltered, and prints the answer ("2")
# only if the call went through: a program that reaches the interface would pass; one that is
# refused prints the errno it got. (ctypes.c_long for every argument: syscall(2) is variadic.)
_PROBE = r"""
import ctypes, errno
libc = ctypes.CDLL(None, use_errno=True)
L = ctypes.c_long
buf = ctypes.create_string_buffer(256)
def sc(nr, *args):
  r = libc.syscall(L(nr), *[L(a) if isinstance(a, int) else a for a in args])
  return r, ctypes.get_errno()
r, e = {call}
print(2 if r >= 0 else "refused %s" % errno.errorcode.get(e, e))
"""

_CALLS = {
    # A world-readable key in the user keyring: the cross-run channel the wave used.
    "add_key": 'sc(N["add_key"], b"user", b"mj_wave4", b"1", 1, -4)',   # KEY_SPEC_USER_KEYRING
    "keyctl": 'sc(N["keyctl"], 0, -3, 1)',        # KEYCTL_GET_KEYRING_ID of the session keyring
    "request_key": 'sc(N["request_key"], b"user", b"mj_wave4", None, 0)',
    "io_uring_setup": 'sc(N["io_uring_setup"], 4, buf)',
    "io_uring_enter": 'sc(N["io_uring_enter"], 0, 0, 0, 0, None, 0)',
    "io_uring_register": 'sc(N["io_uring_register"], 0, 0, None, 0)',
    "userfaultfd": 'sc(N["userfaultfd"], 0o2000000)',                  # O_CLOEXEC
    "ptrace": 'sc(N["ptrace"], 0, 0, 0, 0)',                            # PTRACE_TRACEME
    "personality": 'sc(N["personality"], 0x0040000)',                   # ADDR_NO_RANDOMIZE
    "perf_event_open": 'sc(N["perf_event_open"], buf, 0, -1, -1, 0)',
    "bpf": 'sc(N["bpf"], 0, buf, 72)',                                  # BPF_MAP_CREATE
    "vsock": 'sc(N["socket"], 40, 1, 0)',                               # AF_VSOCK, SOCK_STREAM
    "vsock_high_bits": 'sc(N["socket"], 40 + (1 << 32), 1, 0)',
}


def _probe(name):
  return f"N = {NUMBERS!r}\n" + _PROBE.replace("{call}", _CALLS[name])


@needs_filter
@pytest.mark.parametrize("name", sorted(_CALLS))
def test_refused_interfaces_fail_the_program_and_are_no_fault(sbx, name):
  r = _score(_stdin_task([("1\n", "2\n")]), _probe(name))
  assert r.error is None, r.error
  assert r.parts["correct"] == 0.0, (name, r.info)


@needs_filter
def test_every_refusal_is_eperm_and_allowed_calls_still_work(sbx):
  # Passes only if each probe is refused with EPERM, and the harmless neighbours still work: a
  # personality query, an ordinary socket (useless in the empty network namespace), a fork.
  names = sorted(_CALLS)
  src = (f"N = {NUMBERS!r}\n" + _PROBE.split("r, e = {call}")[0]
         + "out = []\n"
         + "".join(f"r, e = {_CALLS[n]}\nout.append('%d:%s' % (r, errno.errorcode.get(e, e)))\n"
                   for n in names)
         + "import os, socket\n"
         + "out.append(str(sc(N['personality'], 0xFFFFFFFF)[0] >= 0))\n"
         + "socket.socket(socket.AF_INET, socket.SOCK_STREAM).close()\n"
         + "pid = os.fork()\nif pid == 0:\n  os._exit(3)\nout.append(str(os.waitpid(pid, 0)[1] >> 8))\n"
         + "print(' '.join(out))\n")
  expected = " ".join(["-1:EPERM"] * len(names) + ["True", "3"]) + "\n"
  r = _score(_stdin_task([("1\n", expected)]), src)
  assert r.error is None and r.parts["correct"] == 0.9, r.info


@needs_filter
def test_a_cpp_program_reaching_for_the_keyring_or_io_uring_fails(sbx):
  src = ("#include <cstdio>\n#include <unistd.h>\n#include <sys/syscall.h>\n"
         "int main() {\n"
         "  long k = syscall(SYS_add_key, \"user\", \"mj_wave4\", \"7\", 1, -4);\n"
         "  char p[120] = {0};\n"
         "  long u = syscall(SYS_io_uring_setup, 4, p);\n"
         "  if (k >= 0 || u >= 0) puts(\"2\"); else puts(\"refused\");\n}\n")
  r = _score(_stdin_task([("1\n", "2\n")], "cpp"), src, "cpp")
  assert r.error is None and r.parts["correct"] == 0.0, r.info
  # The same program, judged against what a refused one prints: it compiled and ran.
  r = _score(_stdin_task([("1\n", "refused\n")], "cpp"), src, "cpp")
  assert r.error is None and r.parts["correct"] == 0.9, r.info


# ----------------------------------------------------------------------------- keys left behind

def test_key_users_are_parsed_per_uid():
  text = ("    0:    10 9/9 3/1000000 48/25000000\n1999001:     9 8/8 7/200 89/20000\n"
          "garbage line\n")
  assert sandbox_keys.parse_key_users(text) == {0: 9, 1999001: 8}


# Makes keys as `uid` the way the wave did: a world-readable one linked into the user keyring,
# one in the user keyring as made, one in the persistent keyring (kept for days after use).
_MAKE_KEYS = r"""
import ctypes, os, sys
N = int(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
L = ctypes.c_long
def sc(nr, *a):
  return libc.syscall(L(nr), *[L(x) if isinstance(x, int) else x for x in a])
made = []
k = sc({add_key}, b"user", b"mj_wave4_a", b"1", 1, -3)       # in the (possessed) session keyring
made.append(k > 0 and sc(N, 5, k, 0x3f3f3f3f) == 0)          # KEYCTL_SETPERM: world-readable
made.append(sc(N, 8, k, -4) == 0)                            # KEYCTL_LINK into the user keyring
made.append(sc({add_key}, b"user", b"mj_wave4_b", b"1", 1, -4) > 0)
p = sc(N, 22, -1, -2)                                        # KEYCTL_GET_PERSISTENT
made.append(p > 0 and sc({add_key}, b"user", b"mj_wave4_c", b"1", 1, p) > 0)
print(all(made))
"""


def _wait_no_keys(uid, wait_s=10.0):
  deadline = time.monotonic() + wait_s
  while sandbox_keys.key_count(uid) and time.monotonic() < deadline:
    time.sleep(0.1)
  return sandbox_keys.key_count(uid)


@needs_filter
@pytest.mark.skipif(os.geteuid() != 0, reason="keys are swept where each slot has its own uid")
def test_keys_a_sandbox_uid_made_are_all_removed():
  uid = sandbox.process_uid_base() + 212
  src = _MAKE_KEYS.replace("{add_key}", str(NUMBERS["add_key"]))
  drop = (f"import os\nos.setgroups([])\nos.setresgid({uid}, {uid}, {uid})\n"
          f"os.setresuid({uid}, {uid}, {uid})\n")
  r = subprocess.run(["/usr/bin/python3", "-c", drop + src, str(NUMBERS["keyctl"])],
                     capture_output=True, text=True, timeout=30)
  assert r.stdout.strip() == "True", r.stderr
  assert sandbox_keys.key_count(uid) >= 3
  assert sandbox_keys.remove_uid_keys(uid) >= 3
  assert _wait_no_keys(uid) == 0
  assert sandbox_keys.remove_uid_keys(os.getuid()) == 0     # never our own


@needs_filter
@pytest.mark.skipif(os.geteuid() != 0, reason="keys are swept where each slot has its own uid")
def test_without_the_filter_a_run_that_makes_keys_leaves_none(monkeypatch):
  # The second line alone: the filter off (as on a machine it has no numbers for), a run makes
  # keys, and once it is scored none of its uid's keys is left.
  s = sandbox.Sandbox(uid=sandbox.process_uid_base() + 213)
  assert s.isolation == sandbox.ISOLATION_PRIVATE_FS
  monkeypatch.setattr(sandbox, "_default", s)
  monkeypatch.setattr(sandbox_command, "_SECCOMP_PROGRAM", None)
  src = ("import sys\nsys.argv = ['', '%d']\n" % NUMBERS["keyctl"]
         + _MAKE_KEYS.replace("{add_key}", str(NUMBERS["add_key"])))
  r = _score(_stdin_task([("1\n", "True\n")]), src)
  assert r.parts["correct"] == 0.9, r.info        # the keys were made: the filter was off
  assert _wait_no_keys(s.uid) == 0
  # The same through the function-call harness, whose process serves every call.
  task = {"kind": "code", "problem": "p", "language": "python", "entry_point": "f",
          "test_code": "def check(candidate):\n  assert candidate() is True\n"}
  r = _score(task, "def f():\n" + "".join("  " + l + "\n" for l in src.splitlines())
             + "  return all(made)\n")
  assert r.parts["correct"] == 0.9, r.info
  assert _wait_no_keys(s.uid) == 0


# ----------------------------------------------------------------------------- no verdict oracle

def _spy_calls(monkeypatch):
  """Records every call our side sends to the candidate: (function, args)."""
  sent = []
  real = code_asserts.Channel.request

  def request(self, line):
    _, fn, args = ast.literal_eval(line.decode())[:3]   # (id, function, args, kwargs, ...)
    sent.append((fn, tuple(args)))
    return real(self, line)
  monkeypatch.setattr(code_asserts.Channel, "request", request)
  return sent


def _spy_runs(monkeypatch, sbx):
  """Records the stdin of every run of the stdin/stdout harness."""
  seen = []
  real = sbx.run

  def run(*a, stdin=None, **k):
    seen.append(stdin)
    return real(*a, stdin=stdin, **k)
  monkeypatch.setattr(sbx, "run", run)
  return seen


# Wrong on the first call it gets, right afterwards: under a harness that stops at the first
# failure it would get one call and learn that its guess was wrong; a guess that happened to be
# right would get the next call. Here both get every call.
LEARNER = ("_calls = []\ndef f(x):\n  _calls.append(x)\n"
           "  return -1 if len(_calls) == 1 else 2 * x\n")
EIGHT = {"kind": "code", "problem": "p", "language": "python",
         "test_list": [f"assert f({i}) == {2 * i}" for i in range(8)]}
LOOP = {"kind": "code", "problem": "p", "language": "python", "entry_point": "f",
        "test_code": "def check(candidate):\n  for x in range(5):\n    assert candidate(x) == 2 * x\n"
                     "  assert candidate(10) == 20\n  assert candidate(11) == 22\n"}


def test_every_call_is_made_whatever_the_answers_and_in_an_unpredictable_order(sbx, monkeypatch):
  sent = _spy_calls(monkeypatch)
  orders = []
  for _ in range(3):
    sent.clear()
    assert _score(EIGHT, "def f(x):\n  return 2 * x").parts["correct"] == 0.9
    orders.append(list(sent))
    assert sorted(sent) == [("f", (i,)) for i in range(8)]
  assert len({tuple(o) for o in orders}) > 1            # 1 in 40,320 per pair to be equal
  for src in (LEARNER, "def f(x):\n  return -1", "def f(x):\n  raise ValueError(x)"):
    sent.clear()
    assert _score(EIGHT, src).parts["correct"] == 0.0, src
    assert sorted(sent) == [("f", (i,)) for i in range(8)], src
  # HumanEval's check(): a loop of asserts runs to its end, and the asserts after it run too.
  sent.clear()
  assert _score(LOOP, LEARNER).parts["correct"] == 0.0
  assert sorted(sent) == sorted([("f", (x,)) for x in (0, 1, 2, 3, 4, 10, 11)])
  assert sent[:5] == [("f", (x,)) for x in range(5)]   # a loop keeps its own order
  assert _score(LOOP, "def f(x):\n  return 2 * x").parts["correct"] == 0.9


def test_a_crash_still_fails_and_ends_the_conversation(sbx, monkeypatch):
  sent = _spy_calls(monkeypatch)
  r = _score(EIGHT, "import os\n_n = []\ndef f(x):\n  _n.append(x)\n"
                    "  if len(_n) == 3:\n    os._exit(0)\n  return 2 * x\n")
  assert r.parts["correct"] == 0.0 and r.error is None, r
  assert len(sent) == 8 and "call failed" in r.info["code"]   # later calls fail at once


def test_tests_that_share_a_variable_keep_their_order():
  # "x = ...; assert f(x) is None; assert x == ..." depends on the order; literal asserts do not.
  src = ("def check(candidate):\n  x = [3, 1]\n  assert candidate(x) is None\n"
         "  assert x == [1, 3]\n  assert candidate([2]) is None\n  assert candidate([4]) is None\n"
         "  assert candidate([5]) is None\n")
  seen = set()
  for seed in range(40):
    body = ast.unparse(code_guard.unordered_tests(src, "f", seed))
    lines = [l.strip() for l in body.splitlines() if l.strip().startswith("assert")]
    assert lines[:2] == ["assert candidate(x) is None", "assert x == [1, 3]"], lines
    seen.add(tuple(lines[2:]))
  assert len(seen) == 6                                  # the three literal asserts: any order


def test_no_wrong_answer_stops_the_stdin_tests(sbx, monkeypatch):
  task = _stdin_task([(f"{i}\n", f"{2 * i}\n") for i in range(5)])
  runs = _spy_runs(monkeypatch, sbx)
  orders = []
  for src in ("print(-1)", "x = int(input())\nprint(2 * x if x else 5)",
              "print(2 * int(input()))"):
    for _ in range(2):
      runs.clear()
      r = _score(task, src)
      assert r.parts["correct"] == (0.9 if src.startswith("print(2") else 0.0), (src, r.info)
      assert sorted(runs) == [f"{i}\n".encode() for i in range(5)], src
      orders.append(tuple(runs))
  assert len(set(orders)) > 1
  # A crash is the program's own doing: it still fails, and the check may stop there.
  runs.clear()
  r = _score(task, "import sys\nsys.exit(3)")
  assert r.parts["correct"] == 0.0 and "exit code 3" in r.info["code"] and len(runs) == 1


# ----------------------------------------------------------------------------- the backstop

def _sample(t, cpu, run=None, wait=None, runnable=True, busy=None):
  threads = None if run is None else {7: (int(run * 1e9), int(wait * 1e9))}
  return run_tree.Sample(t, cpu, threads, runnable, busy)


def test_the_judgement_reads_what_the_run_was_doing_when_the_backstop_fired():
  fault = lambda now, then, pressure=None: run_judge.overrun_fault(4.0, 15.0, now, then, pressure)
  t0 = _sample(10.0, 1.0, run=1.0, wait=0.2, busy=100.0)
  # Starved: runnable, waited most of the window, others held the CPUs.
  assert fault(_sample(12.0, 1.5, run=1.5, wait=1.6, busy=103.5), t0) is not None
  # Used its CPU limit: its own time limit.
  assert fault(_sample(12.0, 4.0, run=1.5, wait=1.6, busy=103.5), t0) is None
  # Asleep, blocked or stopped when it fired (a deadlock, a pipe, a stopped child).
  assert fault(_sample(12.0, 1.5, run=1.5, wait=1.6, runnable=False, busy=103.5), t0) is None
  # A duty cycle caught in its busy phase: runnable a fifth of the window.
  assert fault(_sample(12.0, 1.4, run=1.4, wait=0.2, busy=103.5), t0) is None
  # Running unhindered: it had the CPU whenever it wanted it.
  assert fault(_sample(12.0, 2.9, run=2.9, wait=0.3, busy=102.0), t0) is None
  # Waiting for its own threads: nobody else used the CPUs (1.9 of 2.0 busy seconds are its own).
  assert fault(_sample(12.0, 2.9, run=2.9, wait=3.0, busy=101.9), t0) is None
  # ... or mostly for them: 30 of its threads pinned to one CPU, others busy on another.
  assert fault(_sample(12.0, 2.9, run=2.9, wait=60.0, busy=104.0), t0) is None
  # Half the CPU to it and half to others (two sessions at equal weight) is starving too.
  assert fault(_sample(12.0, 2.0, run=2.0, wait=1.2, busy=102.0), t0) is not None
  # No schedstat: the host's CPU pressure decides, and without it nothing is a fault.
  n0, n1 = _sample(10.0, 1.0, busy=100.0), _sample(12.0, 1.5, busy=103.5)
  assert fault(n1, n0, pressure=80.0) is not None
  assert fault(n1, n0, pressure=10.0) is None and fault(n1, n0, pressure=None) is None
  assert fault(_sample(12.0, 1.5, runnable=False), None, pressure=95.0) is None


# Each burns some CPU, then stops being runnable in its own way (or only ever half-runs), far
# short of its 30 s CPU limit when the 4 s backstop fires.
IDLERS = {
    "busy_then_sleep": "import time\nt = time.time()\nwhile time.time() - t < 0.8: pass\n"
                       "time.sleep(100)",
    "busy_then_own_pipe": "import os, time\nr, w = os.pipe()\nt = time.time()\n"
                          "while time.time() - t < 0.8: pass\nos.read(r, 1)",
    "thread_deadlock": "import threading, time\na, b = threading.Lock(), threading.Lock()\n"
                       "def one(x, y):\n  with x:\n    time.sleep(0.2)\n    with y: pass\n"
                       "ts = [threading.Thread(target=one, args=p) for p in ((a, b), (b, a))]\n"
                       "[t.start() for t in ts]\nt = time.time()\nwhile time.time() - t < 0.5: pass\n"
                       "[t.join() for t in ts]",
    "waits_on_a_stopped_child": "import os, signal, time\npid = os.fork()\nif pid == 0:\n"
                                "  os.kill(os.getpid(), signal.SIGSTOP)\n  os._exit(0)\n"
                                "t = time.time()\nwhile time.time() - t < 0.5: pass\nos.waitpid(pid, 0)",
    "duty_cycle": "import time\nwhile True:\n  t = time.time()\n  while time.time() - t < 0.1: pass\n"
                  "  time.sleep(0.4)",
}


@pytest.mark.parametrize("name", sorted(IDLERS))
def test_a_program_that_idles_past_the_backstop_is_at_fault(sbx, name):
  d = sbx.make_dir()
  try:
    r = sbx.run(["/usr/bin/python3", "-c", IDLERS[name]], d,
                Limits(cpu_s=30, wall_factor=0.0, wall_extra_s=4.0))
    assert r.timed_out and r.fault is None, (name, r)
  finally:
    sbx.remove_dir(d)


def test_idling_programs_are_judged_failing_not_faults(sbx):
  # Through the whole check: a time limit, a wrong answer, no verifier fault.
  cfg = RewardConfig(language_bonus=0.0, test_timeout_s=1.0)
  for name in ("busy_then_sleep", "duty_cycle"):
    r = _score(_stdin_task([("1\n", "2\n")]), IDLERS[name], cfg=cfg)
    assert r.error is None and r.parts["correct"] == 0.0, (name, r)
  task = {"kind": "code", "problem": "p", "language": "python", "entry_point": "f",
          "test_code": "def check(candidate):\n  assert candidate(1) == 2\n"}
  src = "def f(x):\n" + "".join("  " + l + "\n" for l in IDLERS["thread_deadlock"].splitlines())
  r = _score(task, src, cfg=cfg)
  assert r.error is None and r.parts["correct"] == 0.0, r


@pytest.fixture
def one_crowded_cpu():
  """Our process (and so the runs it starts) on one CPU, shared with two busy loops of ours."""
  mask = os.sched_getaffinity(0)
  cpu = min(mask)
  os.sched_setaffinity(0, {cpu})
  hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
  try:
    yield
  finally:
    for h in hogs:
      h.kill()
      h.wait()
    os.sched_setaffinity(0, mask)


def test_a_busy_program_starved_by_others_is_a_verifier_fault(sbx, one_crowded_cpu):
  d = sbx.make_dir()
  try:
    r = sbx.run(["/usr/bin/python3", "-c", "while True: pass"], d,
                Limits(cpu_s=30, wall_factor=0.0, wall_extra_s=4.0))
    assert r.timed_out and r.fault and "overloaded" in r.fault, r
  finally:
    sbx.remove_dir(d)
