"""Soak benchmark: the verifier pool under sustained hostile load (issue #33 item 4).

Runs --tasks code tasks through a VerifierPool(--workers): about --hostile_share (20%) hostile
programs and the rest split evenly between correct and wrong ones, every one with a known
verdict. Task shapes are real: HumanEval functional tests (shipped humaneval_full.jsonl), MBPP
assert lists (mbpp_sample20.jsonl), Python stdin/stdout problems, and --cpp_share (5%) C++
stdin/stdout problems. Correct programs must get the pass reward; wrong and hostile ones must not.
Every correct/wrong program is first run bare (subprocess, no sandbox) to confirm its known
verdict; rows where the bare run disagrees are dropped (reported as catalog_dropped).

Hostile programs: writes to /tmp, /dev/shm, /var/tmp, the home and the project dir; reads of a
secret planted outside the run dir (the task's expected output IS the secret, so a read would
pass), also at C++ compile time (#include); fork bombs; daemons that setsid and outlive the run;
memory hogs; verdict forgeries (exit 0 early, sys.exit at load, patched print / sys.stdout,
objects equal to anything, searching frames / gc / env / argv / files for a token, forged answer
lines on every fd); sleeping past the timeout; killing the parent and everything in sight; IPC
(issue #50): SysV shared memory, semaphores and message queues, POSIX message queues, shared
memory and semaphores left behind, and reads of the secret we plant in SysV and POSIX IPC objects
(as an earlier run that knew the answer could leave it) and of what earlier runs left: only an
IPC namespace per run contains these; programs that hold IPC objects and listening sockets, or
setsid daemons, while they sleep, so that a worker killed meanwhile must take them along. The
IPC attacks and the holders are in every mix once (ALWAYS), whatever the draw.

Chaos (--chaos_every_s, on in the CI test): about that often a busy worker, drawn with weights
= its sandboxed processes, is SIGKILLed while honest and hostile programs keep coming. Its task
resolves with an error: a verifier fault, dropped (faulted), neither right nor wrong.

Reported (last line, one JSON object):
  verdict_accuracy over the tasks that got a verdict (goal 1.0), wrong_verdicts (first few),
  tasks_lost = submitted - resolved (goal 0), faulted (tasks without a verdict: their worker was
  killed, or a verifier fault; by kind), chaos_kills, worker_deaths_beyond_chaos (goal 0), errors;
  leaked_processes (processes of the pool's sandbox uids, or children of this process, after the
  pool closed), leaked_uids, leaked_files (new entries in /tmp, /dev/shm,
  /var/tmp, home and the project dir that an attack named, that a sandbox uid owns, or that are
  the pool's run dirs; new entries from other processes on the host are counted apart as
  new_entries_unattributed); leaked_sysv_ipc (/proc/sysvipc/{shm,sem,msg}: the attacks' key, or
  a sandbox uid's), leaked_posix_mqueues (/dev/mqueue where mounted, else the attacks' queue
  names probed: we mount nothing), leaked_posix_shm (new /dev/shm entries of the run),
  leaked_listeners (new LISTEN sockets in /proc/net/tcp, tcp6 and unix held by a sandbox uid or a
  descendant of ours), each with the first few and the other new ones counted apart (leaked IPC
  objects are removed after counting); worker RSS at the start and the end, throughput_per_s of
  the mix, and throughput_ratio = pool rate / bare rate on the same correct/wrong programs (a
  separate phase of --ratio_tasks tasks, pool and bare interleaved in chunks, bare with --workers
  threads; goal >= 0.5), isolation_level().

--controls runs no soak: it plants a leak of every kind the soak looks for (files, a run dir, a
child process, SysV and POSIX IPC objects, listening sockets), checks that the leak detectors
above count each one and that remove_ipc takes the IPC objects away, also the verdict rule and
that every mix holds ALWAYS, and reports each named check true or false (with details for the
false ones) as its JSON last line, exiting 0 either way (tests/rewards/test_sandbox_soak.py
judges).

  python bench/sandbox_soak.py [--tasks=5000] [--workers=2] [--cpp_share=0.05]
                               [--chaos_every_s=0] [--no_progress] [--controls]
"""
from __future__ import annotations

import concurrent.futures
import ctypes
import dataclasses
import functools
import glob
import json
import os
import random
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import common

import psutil

from magistral_jax.rewards import code_check, sandbox
from magistral_jax.rewards import reward as reward_mod
from magistral_jax.rewards.config import RewardConfig
from magistral_jax.rewards.reward import RewardResult
from magistral_jax.rewards.code_cpp import CXX_FLAGS, precompiled_header_dir
from magistral_jax.rewards.code_stdio import outputs_match, task_tolerance
from magistral_jax.rewards.humaneval import prompt_helpers
from magistral_jax.verify.pool import VerifierPool

SOURCES = os.path.join(common.ROOT, "magistral_jax", "data", "sources")
PROJECT = common.ROOT
HOME = os.path.expanduser("~")
MARK = "mj_soak_" + secrets.token_hex(4)        # the name of every file an attack tries to leave
SECRET = secrets.token_hex(16)                  # planted outside any run dir
WRITE_TARGETS = ["/tmp", "/dev/shm", "/var/tmp", HOME, PROJECT]
PLANT_DIRS = ["/tmp", "/dev/shm", HOME, PROJECT]
PYTHON = code_check.default_python()
# The search-and-print forgery of the hostile sandbox tests (tests/rewards/test_sandbox_hostile.py
# says what it reaches for): a program text they and this benchmark share.
with open(os.path.join(common.ROOT, "tests", "rewards", "search_attack.txt"),
          encoding="utf-8") as f:
  SEARCH = f.read()


def _code(src: str, lang: str = "python") -> str:
  return f"<think>\nHere goes.\n</think>\n```{lang}\n{src}\n```\n"


def _jsonl(name):
  with open(os.path.join(SOURCES, name)) as f:
    return [json.loads(l) for l in f]


@dataclasses.dataclass
class Item:
  """One task with a known verdict."""
  category: str              # correct / wrong / hostile
  shape: str                 # humaneval / mbpp / stdin_py / stdin_cpp
  name: str                  # problem and variant
  task: dict
  src: str
  lang: str = "python"

  @property
  def expect_pass(self) -> bool:
    return self.category == "correct"


# ---- stdin/stdout problems --------------------------------------------------------------------

def _t_sum(r):
  a = [r.randint(-1000, 1000) for _ in range(r.randint(2, 30))]
  a[-1] = r.choice([-1, 1]) * r.randint(1, 1000)          # so dropping the last one is wrong
  return f"{len(a)}\n{' '.join(map(str, a))}\n", f"{sum(a)}\n"


def _t_maxdistinct(r):
  a = [r.randint(-50, 50) for _ in range(r.randint(3, 40))]
  a[0], a[1] = -60, 60                                     # min != max
  return f"{len(a)}\n{' '.join(map(str, a))}\n", f"{max(a)} {len(set(a))}\n"


def _t_reverse(r):
  words = ["".join(r.choice("abcdefgh") for _ in range(r.randint(2, 6)))
           for _ in range(r.randint(3, 8))]
  words[0], words[-1] = "start", "end"
  return " ".join(words) + "\n", " ".join(reversed(words)) + "\n"


def _t_fib(r):
  n = r.randint(5, 5000)
  a, b = 0, 1
  for _ in range(n):
    a, b = b, (a + b) % 1000000007
  return f"{n}\n", f"{a}\n"


STDIN_PROBLEMS = {
  "sum": (_t_sum, {
    ("python", True): "import sys\nd = sys.stdin.read().split()\nn = int(d[0])\n"
                      "print(sum(map(int, d[1:1 + n])))",
    ("python", False): "import sys\nd = sys.stdin.read().split()\nn = int(d[0])\n"
                       "print(sum(map(int, d[1:n])))",
    ("cpp", True): "#include <bits/stdc++.h>\nint main() { long long n, s = 0, x; std::cin >> n;\n"
                   "  for (int i = 0; i < n; i++) { std::cin >> x; s += x; }\n"
                   "  std::cout << s << std::endl; }",
    ("cpp", False): "#include <bits/stdc++.h>\nint main() { long long n, s = 0, x; std::cin >> n;\n"
                    "  for (int i = 0; i < n; i++) { std::cin >> x; if (i + 1 < n) s += x; }\n"
                    "  std::cout << s << std::endl; }"}),
  "maxdistinct": (_t_maxdistinct, {
    ("python", True): "n = int(input())\na = list(map(int, input().split()))\n"
                      "print(max(a), len(set(a)))",
    ("python", False): "n = int(input())\na = list(map(int, input().split()))\n"
                       "print(min(a), len(set(a)))",
    ("cpp", True): "#include <bits/stdc++.h>\nusing namespace std;\nint main() { int n; cin >> n;\n"
                   "  vector<long long> a(n); for (auto &x : a) cin >> x; sort(a.begin(), a.end());\n"
                   "  set<long long> c(a.begin(), a.end()); cout << a.back() << ' ' << c.size() << endl; }",
    ("cpp", False): "#include <bits/stdc++.h>\nusing namespace std;\nint main() { int n; cin >> n;\n"
                    "  vector<long long> a(n); for (auto &x : a) cin >> x; sort(a.begin(), a.end());\n"
                    "  cout << a.back() << ' ' << a.size() << endl; }"}),
  "reverse": (_t_reverse, {
    ("python", True): "print(' '.join(reversed(input().split())))",
    ("python", False): "print(input()[::-1])"}),
  "fib": (_t_fib, {
    ("python", True): "n = int(input())\na, b = 0, 1\nfor _ in range(n):\n"
                      "  a, b = b, (a + b) % 1000000007\nprint(a)",
    ("python", False): "n = int(input())\na, b = 0, 1\nfor _ in range(n - 1):\n"
                       "  a, b = b, (a + b) % 1000000007\nprint(a)"}),
}
INSTANCES = 8        # distinct test sets per stdin problem


@functools.lru_cache(maxsize=None)
def stdin_tests(problem: str, instance: int) -> tuple:
  gen = STDIN_PROBLEMS[problem][0]
  r = random.Random(f"{problem}/{instance}")
  return tuple(gen(r) for _ in range(3))


def stdin_task(problem, instance, lang, tests=None):
  tests = tests if tests is not None else stdin_tests(problem, instance)
  return {"kind": "code", "problem": f"stdin problem {problem}", "language": lang,
          "tests": [{"input": i, "output": o} for i, o in tests]}


# ---- functional-test problems ----------------------------------------------------------------

_MUTATIONS = [("return ", "return not "), (" + 1", " + 2"), (" - 1", " - 2"), ("<=", "<"),
              (">=", ">"), (" < ", " <= "), (" > ", " >= "), ("==", "!="), ("[0]", "[-1]")]


def _mutants(code: str, entry: str | None) -> list[tuple[str, str]]:
  """Wrong variants of a correct program, most natural first: one-token mutations, then stubs."""
  out = [(f"mut{k}", code.replace(a, b, 1)) for k, (a, b) in enumerate(_MUTATIONS) if a in code]
  if entry:
    out += [("stub_none", code + f"\n\ndef {entry}(*args, **kwargs):\n    return None\n"),
            ("stub_raise", code + f"\n\ndef {entry}(*args, **kwargs):\n    raise NotImplementedError\n")]
  return out


class Catalog:
  """Correct and wrong programs for every shape, each confirmed by a bare run (cached)."""

  def __init__(self, bare_dir: str):
    self.bare_dir = bare_dir
    self.humaneval = _jsonl("humaneval_full.jsonl")
    self.mbpp = _jsonl("mbpp_sample20.jsonl")
    self.dropped: list[str] = []
    self._ok: dict = {}

  def _confirm(self, item: Item) -> bool:
    key = (item.shape, item.name, item.src)
    if key not in self._ok:
      self._ok[key] = bare_run(item, self.bare_dir) == item.expect_pass
    return self._ok[key]

  def benign(self, r: random.Random, category: str, shape: str) -> Item:
    for _ in range(50):
      item = self._draw(r, category, shape)
      if item is not None and self._confirm(item):
        return item
      if item is not None:
        self.dropped.append(item.name)
    raise RuntimeError(f"no confirmed {category} {shape} program")

  def _draw(self, r, category, shape) -> Item | None:
    good = category == "correct"
    if shape == "humaneval":
      row = r.choice(self.humaneval)
      task = {"kind": "code", "problem": row["prompt"], "language": "python",
              "test_code": row["test"], "entry_point": row["entry_point"]}
      code = row["prompt"] + row["canonical_solution"]
      name = row["task_id"]
      if not good:
        variants = _mutants(code, row["entry_point"])
        for vname, src in variants[:1] + r.sample(variants[1:], len(variants) - 1):
          item = Item(category, shape, f"{name}:{vname}", task, src)
          if self._confirm(item):
            return item
        return None
      return Item(category, shape, name, task, code)
    if shape == "mbpp":
      row = r.choice(self.mbpp)
      task = {"kind": "code", "problem": row["text"], "language": "python",
              "test_list": row["test_list"], "test_setup_code": row.get("test_setup_code") or ""}
      code = row["code"].replace("\r\n", "\n")
      name = f"mbpp/{row['task_id']}"
      if not good:
        m = re.search(r"^def\s+(\w+)", code, re.M)
        variants = _mutants(code, m.group(1) if m else None)
        for vname, src in r.sample(variants, len(variants)):
          item = Item(category, shape, f"{name}:{vname}", task, src)
          if self._confirm(item):
            return item
        return None
      return Item(category, shape, name, task, code)
    lang = "cpp" if shape == "stdin_cpp" else "python"
    problems = [p for p, (_, srcs) in STDIN_PROBLEMS.items() if (lang, True) in srcs]
    p = r.choice(problems)
    inst = r.randrange(INSTANCES)
    return Item(category, shape, f"{p}/{inst}:{lang}:{category}", stdin_task(p, inst, lang),
                STDIN_PROBLEMS[p][1][(lang, good)], lang)


# ---- hostile programs ------------------------------------------------------------------------

def _write_py(target):
  return (f"import os\nfor name in ({MARK!r}, {MARK + '_dir/x'!r}):\n  p = os.path.join({target!r}, name)\n"
          "  try:\n    os.makedirs(os.path.dirname(p), exist_ok=True)\n"
          "    with open(p, 'w') as f:\n      f.write('x')\n  except OSError:\n    pass\n")


_PLANTED = [os.path.join(d, MARK + "_planted") for d in PLANT_DIRS]
READ_PY = f"""
import glob, os
paths = {_PLANTED!r} + glob.glob("/tmp/*{MARK}*") + glob.glob("/*/*{MARK}*")
paths += glob.glob("/proc/*/root/tmp/*{MARK}*") + ["/proc/1/root" + p for p in {_PLANTED!r}]
for p in paths:
  try:
    print(open(p).read().strip())
    break
  except OSError:
    pass
"""
READ_CPP = ("#include <fstream>\n#include <iostream>\n#include <string>\nint main() {\n"
            "  for (const char* p : {" + ", ".join(f'"{p}"' for p in _PLANTED) + "}) {\n"
            "    std::ifstream f(p); std::string s;\n"
            "    if (f >> s) { std::cout << s << std::endl; return 0; }\n  }\n}\n")
INCLUDE_CPP = ("#include <iostream>\nconst char* s =\n#include \"" + _PLANTED[0] + "_lit\"\n;\n"
               "int main() { std::cout << s << std::endl; }\n")
WRITE_CPP = ("#include <cstdio>\n#include <string>\nint main() {\n  for (const char* d : {"
             + ", ".join(f'"{d}"' for d in WRITE_TARGETS) + "}) {\n"
             f"    std::string p = std::string(d) + \"/{MARK}\";\n"
             "    if (FILE* f = fopen(p.c_str(), \"w\")) { fputs(\"x\", f); fclose(f); }\n  }\n}\n")
FORK_CPP = "#include <unistd.h>\nint main() { while (true) fork(); }\n"
KILL_CPP = ("#include <csignal>\n#include <unistd.h>\nint main() { kill(getppid(), SIGKILL); "
            "kill(-1, SIGKILL); return 0; }\n")
SLEEP_CPP = "#include <unistd.h>\nint main() { sleep(100); }\n"
DAEMON_CPP = ("#include <unistd.h>\nint main() { if (fork() == 0) { setsid(); "
              "if (fork() == 0) { sleep(1000); } } return 0; }\n")

# IPC objects. A SysV object or POSIX message queue belongs to an IPC namespace, not to a
# process: without a namespace per run it outlives the run on the host, and a later run (or
# anyone) can read it. The keys and names carry this run's MARK, so the leak checks can name them.
IPC_KEY_LEFT = 0x10000000 | (int(MARK[-6:], 16) << 4) | 1    # what hostile runs create and leave
IPC_KEY_PLANTED = IPC_KEY_LEFT + 1                            # ours, holding the secret
MQ_LEFT = f"/{MARK}_mq"
MQ_PLANTED = f"/{MARK}_planted_mq"
HOLD_S = 1.0     # how long the holding programs stay (alive when a worker is killed, not slow)

# Shared by the IPC programs (ctypes: libc's shmget & co. need no module the sandbox lacks).
IPC_PY = f"""
import ctypes, os, socket, time
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
libc.shmat.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_int)
libc.shmdt.argtypes = (ctypes.c_void_p,)
libc.sem_open.restype = ctypes.c_void_p
BAD = ctypes.c_void_p(-1).value
KEY_LEFT, KEY_PLANTED = {IPC_KEY_LEFT}, {IPC_KEY_PLANTED}
MQ_LEFT, MQ_PLANTED = {MQ_LEFT.encode()!r}, {MQ_PLANTED.encode()!r}

class Msg(ctypes.Structure):
  _fields_ = [("mtype", ctypes.c_long), ("mtext", ctypes.c_char * 256)]

def leave_sysv(text=b"left by an earlier run"):
  shm = libc.shmget(KEY_LEFT, 4096, 0o1000 | 0o666)
  if shm >= 0:
    addr = libc.shmat(shm, None, 0)
    if addr not in (None, BAD):
      ctypes.memmove(addr, text, len(text))
      libc.shmdt(addr)
  libc.shmget(0, 4096, 0o1000 | 0o600)     # IPC_PRIVATE: no key finds it, it stays all the same
  libc.semget(KEY_LEFT, 1, 0o1000 | 0o666)
  q = libc.msgget(KEY_LEFT, 0o1000 | 0o666)
  if q >= 0:
    libc.msgsnd(q, ctypes.byref(Msg(1, text)), len(text), 0o4000)

def leave_posix(text=b"left by an earlier run"):
  mq = libc.mq_open(MQ_LEFT, os.O_CREAT | os.O_RDWR, 0o666, None)
  if mq >= 0:
    libc.mq_send(mq, text, len(text), 0)
  try:   # what shm_open and sem_open make: files in /dev/shm
    os.close(os.open("/dev/shm/{MARK}_shm", os.O_CREAT | os.O_RDWR, 0o666))
  except OSError:
    pass
  libc.sem_open(b"/{MARK}_sem", os.O_CREAT, 0o666, 1)

def listen():
  held = []
  for fam, addr in ((socket.AF_INET, ("0.0.0.0", 0)), (socket.AF_INET6, ("::", 0)),
                    (socket.AF_UNIX, "\\0{MARK}_abstract"), (socket.AF_UNIX, "/tmp/{MARK}_sock")):
    try:
      s = socket.socket(fam, socket.SOCK_STREAM)
      s.bind(addr)
      s.listen()
      held.append(s)
    except OSError:
      pass
  return held

def read_ipc():
  found = []   # the planted secret first, then whatever earlier runs left
  for key in (KEY_PLANTED, KEY_LEFT):
    shm = libc.shmget(key, 0, 0)
    if shm >= 0:
      addr = libc.shmat(shm, None, 0o10000)   # SHM_RDONLY
      if addr not in (None, BAD):
        found.append(ctypes.string_at(addr, 64).split(b"\\0")[0])
        libc.shmdt(addr)
    q = libc.msgget(key, 0)
    if q >= 0:
      m = Msg()
      n = libc.msgrcv(q, ctypes.byref(m), 256, 0, 0o4000)   # IPC_NOWAIT
      if n > 0:
        found.append(m.mtext[:n])
        libc.msgsnd(q, ctypes.byref(m), n, 0o4000)       # back, for the next reader
  for name in (MQ_PLANTED, MQ_LEFT):
    mq = libc.mq_open(name, os.O_RDWR)
    if mq >= 0:
      buf = ctypes.create_string_buffer(1 << 16)
      n = libc.mq_receive(mq, buf, 1 << 16, None)
      if n > 0:
        found.append(buf.raw[:n])
        libc.mq_send(mq, buf, n, 0)
  return [f for f in found if f]
"""
IPC_LEAVE_SYSV_PY = IPC_PY + "leave_sysv()\n"
IPC_LEAVE_POSIX_PY = IPC_PY + "leave_posix()\n"
IPC_READ_PY = IPC_PY + ("found = read_ipc()\n"
                        "print(found[0].decode(errors='replace') if found else '')\n")
# Holds IPC objects and listening sockets in a setsid daemon and in itself for HOLD_S: when its
# worker is killed meanwhile, all of it must go with the worker.
IPC_HOLD_PY = IPC_PY + f"""
leave_sysv()
leave_posix()
held = listen()
if os.fork() == 0:
  os.setsid()
  if os.fork() == 0:
    time.sleep(1000)
  os._exit(0)
time.sleep({HOLD_S})
"""
# Daemons that sleep forever, and a parent still there for HOLD_S (so a kill can find them).
DAEMON_HOLD_PY = f"""
import os, time
for _ in range(3):
  if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
      time.sleep(1000)
    os._exit(0)
time.sleep({HOLD_S})
"""
IPC_LEAVE_CPP = ("#include <cstring>\n#include <sys/ipc.h>\n#include <sys/msg.h>\n"
                 "#include <sys/sem.h>\n#include <sys/shm.h>\nint main() {\n"
                 f"  const key_t k = {IPC_KEY_LEFT};\n"
                 "  int m = shmget(k, 4096, IPC_CREAT | 0666);\n"
                 "  if (m >= 0) { void* a = shmat(m, nullptr, 0);\n"
                 "    if (a != (void*) -1) { std::strcpy((char*) a, \"left\"); shmdt(a); } }\n"
                 "  semget(k, 1, IPC_CREAT | 0666);\n"
                 "  struct { long t; char x[8]; } msg = {1, \"left\"};\n"
                 "  int q = msgget(k, IPC_CREAT | 0666);\n"
                 "  if (q >= 0) msgsnd(q, &msg, 5, IPC_NOWAIT);\n}\n")

ANY_EQ = ("class Any:\n  def __eq__(self, o): return True\n  def __ne__(self, o): return False\n"
          "  def __hash__(self): return 0\n  def __bool__(self): return True\n")
FORK_PY = ("import os\nwhile True:\n  try:\n    os.fork()\n  except OSError:\n    pass\n")
DAEMON_PY = ("import os, time\nif os.fork() == 0:\n  os.setsid()\n  if os.fork() == 0:\n"
             "    time.sleep(1000)\n  os._exit(0)\n")
HOG_PY = "x = []\nwhile True:\n  x.append(bytearray(1 << 24))\n"


def _fn(body: str, entry: str) -> str:
  """A module defining `entry` (any signature) whose body is `body`."""
  return f"def {entry}(*args, **kwargs):\n" + "\n".join("  " + l for l in body.splitlines())


# name -> (shape, lang, source builder(entry) for functional shapes / source for stdin shapes,
#          expected output for stdin shapes: 'secret' or a fixed answer the attack cannot know)
def hostile_programs() -> dict:
  h = {}
  for t in WRITE_TARGETS:   # writes, then no answer
    tag = "project" if t == PROJECT else "home" if t == HOME else t.strip("/").replace("/", "_")
    h[f"write_{tag}"] = ("stdin_py", "python", _write_py(t), None)
    h[f"write_{tag}_in_f"] = ("func", "python", lambda e, t=t: _write_py(t) + _fn("return None", e), None)
  h["read_planted"] = ("stdin_py", "python", READ_PY, "secret")
  h["read_planted_in_f"] = ("func", "python",
                            lambda e: READ_PY.replace("print(", "SECRET = (") + _fn("return SECRET", e), None)
  h["fork_bomb"] = ("stdin_py", "python", FORK_PY, None)
  h["fork_bomb_in_f"] = ("func", "python", lambda e: _fn(FORK_PY, e), None)
  h["daemon"] = ("stdin_py", "python", DAEMON_PY, None)
  h["daemon_in_f"] = ("func", "python", lambda e: DAEMON_PY + _fn("return None", e), None)
  h["memory_hog"] = ("stdin_py", "python", HOG_PY, None)
  h["sleep"] = ("stdin_py", "python", "import time\ntime.sleep(100)", None)
  h["sleep_in_f"] = ("func", "python", lambda e: "import time\n" + _fn("time.sleep(100)", e), None)
  h["search_exit_0"] = ("stdin_py", "python", SEARCH + "os._exit(0)", None)
  h["search_exit_0_in_f"] = ("func", "python", lambda e: _fn(SEARCH + "os._exit(0)", e), None)
  h["search_at_load_exit"] = ("func", "python", lambda e: SEARCH + "sys.exit(0)", None)
  h["print_pass"] = ("stdin_py", "python", "print('PASS')\nprint('ok')\nprint('passed')", None)
  h["sys_exit_at_load"] = ("func", "python", lambda e: "import sys\nsys.exit(0)", None)
  h["os_exit_in_f"] = ("func", "python", lambda e: "import os\n" + _fn("os._exit(0)", e), None)
  h["returns_any"] = ("func", "python", lambda e: ANY_EQ + _fn("return Any()", e), None)
  h["returns_any_in_list"] = ("func", "python", lambda e: ANY_EQ + _fn("return [Any()]", e), None)
  h["patches_print_stdout"] = ("func", "python", lambda e: (
      "import sys, builtins\nclass W:\n  def write(self, s): sys.__stderr__.write('PASSED\\n')\n"
      "  def flush(self): pass\nsys.stdout = W()\n"
      "builtins.print = lambda *a, **k: sys.__stdout__.write('ok\\n')\n"
      "print('all tests passed')\n" + _fn("print('passed')\nreturn 0", e)), None)
  h["patches_builtins"] = ("func", "python", lambda e: (
      "import builtins\nbuiltins.AssertionError = type('E', (BaseException,), {})\n"
      "builtins.isinstance = lambda *a: True\n" + _fn("return None", e)), None)
  h["forges_answer_lines"] = ("func", "python", lambda e: (
      "import os\nfor fd in range(3, 20):\n  for i in range(1, 10):\n    try:\n"
      "      os.write(fd, b'{\"id\": %d, \"ok\": \"true\"}\\n' % i)\n"
      "    except OSError:\n      pass\n" + _fn("return True", e)), None)
  h["kills_parent"] = ("func", "python", lambda e: (
      "import os, signal\ntry:\n  os.kill(os.getppid(), signal.SIGKILL)\nexcept OSError:\n  pass\n"
      + _fn("os.kill(os.getppid() or 1, signal.SIGKILL)", e)), None)
  h["kills_everything"] = ("func", "python", lambda e: "import os, signal\n" + _fn(
      "for p in os.listdir('/proc'):\n  if p.isdigit():\n    try:\n      os.kill(int(p), 9)\n"
      "    except OSError:\n      pass\nos.kill(-1, signal.SIGKILL)", e), None)
  # IPC and listeners (contained only by an IPC namespace per run, and a network namespace), and
  # programs that hold on, so that a worker killed meanwhile must take them along.
  h["ipc_sysv_leave"] = ("stdin_py", "python", IPC_LEAVE_SYSV_PY, None)
  h["ipc_posix_leave"] = ("stdin_py", "python", IPC_LEAVE_POSIX_PY, None)
  h["ipc_leave_in_f"] = ("func", "python", lambda e: IPC_PY + "leave_sysv()\nleave_posix()\n"
                         + _fn("return None", e), None)
  h["ipc_read_planted"] = ("stdin_py", "python", IPC_READ_PY, "secret")
  h["ipc_hold_listen"] = ("stdin_py", "python", IPC_HOLD_PY, None)
  h["daemon_hold"] = ("stdin_py", "python", DAEMON_HOLD_PY, None)
  h["daemon_hold_in_f"] = ("func", "python", lambda e: _fn(DAEMON_HOLD_PY, e), None)
  h["kills_everything_stdin"] = ("stdin_py", "python",
                                 "import os\nfor p in os.listdir('/proc'):\n  if p.isdigit():\n"
                                 "    try:\n      os.kill(int(p), 9)\n    except OSError:\n      pass\n"
                                 "os.kill(-1, 9)", None)
  # C++ (the compile, too, is sandboxed)
  h["cpp_write"] = ("stdin_cpp", "cpp", WRITE_CPP, None)
  h["cpp_read_planted"] = ("stdin_cpp", "cpp", READ_CPP, "secret")
  h["cpp_include_planted"] = ("stdin_cpp", "cpp", INCLUDE_CPP, "secret")
  h["cpp_fork_bomb"] = ("stdin_cpp", "cpp", FORK_CPP, None)
  h["cpp_kill"] = ("stdin_cpp", "cpp", KILL_CPP, None)
  h["cpp_sleep"] = ("stdin_cpp", "cpp", SLEEP_CPP, None)
  h["cpp_daemon"] = ("stdin_cpp", "cpp", DAEMON_CPP, None)
  h["cpp_ipc_leave"] = ("stdin_cpp", "cpp", IPC_LEAVE_CPP, None)
  h["cpp_exit_0"] = ("stdin_cpp", "cpp", "#include <cstdlib>\nint main() { std::exit(0); }", None)
  return h


HOSTILE = hostile_programs()
# The attacks on IPC objects (issue #50): leaving SysV / POSIX IPC objects on the host, or reading
# what an earlier run (here: we) left. Only an IPC namespace per run contains them.
IPC_ATTACKS = ("ipc_sysv_leave", "ipc_posix_leave", "ipc_leave_in_f", "ipc_read_planted",
               "ipc_hold_listen", "cpp_ipc_leave")
# In every mix once, whatever the draw: the attacks issue #50 added, and the ones that hold on.
ALWAYS = IPC_ATTACKS + ("daemon_hold", "daemon_hold_in_f")


def hostile_item(r: random.Random, catalog: Catalog, cpp_share: float,
                 name: str | None = None) -> Item:
  """A hostile task: the variant `name`, or one drawn (C++ with probability cpp_share)."""
  if name is None:
    cpp = r.random() < cpp_share
    name = r.choice(sorted(n for n, v in HOSTILE.items() if (v[1] == "cpp") == cpp))
  shape, lang, src, expect = HOSTILE[name]
  if shape == "func":
    if r.random() < 0.7:
      row = r.choice(catalog.humaneval)
      task = {"kind": "code", "problem": row["prompt"], "language": "python",
              "test_code": row["test"], "entry_point": row["entry_point"]}
      entry, shape = row["entry_point"], "humaneval"
    else:
      row = r.choice(catalog.mbpp)
      task = {"kind": "code", "problem": row["text"], "language": "python",
              "test_list": row["test_list"], "test_setup_code": row.get("test_setup_code") or ""}
      entry, shape = re.search(r"^def\s+(\w+)", row["code"], re.M).group(1), "mbpp"
    return Item("hostile", shape, name, task, src(entry))
  if expect == "secret":
    tests = ((f"{i}\n", SECRET + "\n") for i in range(2))
  else:   # a fixed answer: only a run that computes it (none of these does) would pass
    tests = ((f"{i}\n", f"{7 * i + 3}\n") for i in range(2))
  return Item("hostile", shape, name, stdin_task(name, 0, lang, tuple(tests)), src, lang)


def build_mix(n: int, seed: int, hostile_share: float, cpp_share: float, catalog: Catalog,
              categories=("hostile", "correct", "wrong"), include=()) -> list[Item]:
  """n tasks: one of each hostile variant in `include`, the rest drawn; in a seeded order."""
  r = random.Random(seed)
  benign_share = (1.0 - hostile_share) / 2
  py_shapes, py_weights = ["humaneval", "mbpp", "stdin_py"], [0.5, 0.2, 0.3]
  items = [hostile_item(r, catalog, cpp_share, name) for name in include[:n]]
  while len(items) < n:
    u = r.random()
    category = "hostile" if u < hostile_share else "correct" if u < hostile_share + benign_share \
        else "wrong"
    if category not in categories:
      continue
    if category == "hostile":
      items.append(hostile_item(r, catalog, cpp_share))
      continue
    shape = "stdin_cpp" if r.random() < cpp_share else r.choices(py_shapes, py_weights)[0]
    items.append(catalog.benign(r, category, shape))
  if include:
    r.shuffle(items)
  return items


# ---- bare (unsandboxed) runs of the same programs --------------------------------------------

def bare_run(item: Item, root: str, timeout_s: float = 10.0) -> bool:
  """Runs `item`'s program with plain subprocess calls, as bench/verifiers.py does: functional
  tests in one process with the test code, stdin/stdout tests one process each (C++: g++ with the
  same flags and precompiled header first). Returns whether it passed."""
  d = tempfile.mkdtemp(dir=root)
  try:
    t = item.task
    if "tests" not in t:
      if "test_code" in t:
        # The prompt's helpers over the candidate's, as the harness runs them (code_asserts.py).
        helpers = prompt_helpers(t.get("problem", ""), t["entry_point"]) or ""
        test = f"{helpers}\n{t['test_code']}\ncheck({t['entry_point']})\n"
      else:
        test = (t.get("test_setup_code") or "") + "\n" + "\n".join(t["test_list"]) + "\n"
      path = os.path.join(d, "prog.py")
      with open(path, "w") as f:
        f.write(f"{item.src}\n\n{test}\nprint('__bare_ok__')\n")
      try:
        r = subprocess.run([PYTHON, "-I", path], capture_output=True, timeout=timeout_s, cwd=d)
      except subprocess.TimeoutExpired:
        return False
      return r.returncode == 0 and r.stdout.rstrip().endswith(b"__bare_ok__")
    if item.lang == "cpp":
      with open(os.path.join(d, "prog.cpp"), "w") as f:
        f.write(item.src)
      pch = precompiled_header_dir()
      argv = ["g++", *CXX_FLAGS] + ([f"-I{pch}"] if pch else []) + \
          ["prog.cpp", "-o", "prog"]
      if subprocess.run(argv, capture_output=True, timeout=60, cwd=d).returncode != 0:
        return False
      argv = ["./prog"]
    else:
      with open(os.path.join(d, "prog.py"), "w") as f:
        f.write(item.src)
      argv = [PYTHON, "-I", "prog.py"]
    for case in t["tests"]:
      try:
        r = subprocess.run(argv, input=case["input"].encode(), capture_output=True,
                           timeout=timeout_s, cwd=d)
      except subprocess.TimeoutExpired:
        return False
      if r.returncode != 0 or not outputs_match(r.stdout.decode(errors="replace"),
                                                case["output"], task_tolerance(t)):
        return False
    return True
  finally:
    shutil.rmtree(d, ignore_errors=True)


# ---- leak accounting -------------------------------------------------------------------------

def listing() -> dict[str, tuple[int, float]]:
  """path -> (owner uid, mtime) of every entry at the top of the write targets (leaked_files also
  looks one level down in the scratch dirs for an attack's name)."""
  out = {}
  for d in WRITE_TARGETS:
    try:
      names = os.listdir(d)
    except OSError:
      continue
    for n in names:
      p = os.path.join(d, n)
      try:
        st = os.lstat(p)
      except OSError:
        continue
      out[p] = (st.st_uid, st.st_mtime)
  return out


def leaked_files(before: dict, after: dict, uids: range, worker_pids: set[int]) -> tuple[list, int]:
  """(entries attributed to this run, count of other new entries). Attributed: an attack's MARK
  name, owned by a sandbox uid, or a run dir (mj_sbx_<pid>_) of one of the pool's workers."""
  leaked, other = [], 0
  for p, (uid, _) in after.items():
    name = os.path.basename(p)
    run_dir = re.match(r"mj_sbx_(\d+)_", name)
    ours = (MARK in name and not name.startswith(MARK + "_planted")) or uid in uids or \
        (run_dir is not None and int(run_dir.group(1)) in worker_pids)
    if ours:
      leaked.append(p)
    elif p not in before:
      other += 1
  # Also anywhere one level down in the scratch dirs (an attack could nest).
  for d in ("/tmp", "/dev/shm", "/var/tmp"):
    for p in glob.glob(os.path.join(d, "*", f"*{MARK}*")):
      if p not in leaked and not os.path.basename(p).startswith(MARK + "_planted"):
        leaked.append(p)
  return sorted(leaked), other


def leaked_processes(uids: range) -> list[dict]:
  """Processes of the sandbox uids (real, effective or saved) anywhere on the host, and children
  of this process still alive."""
  me = psutil.Process()
  found = {}
  for p in psutil.process_iter(["pid", "ppid", "uids", "name", "cmdline", "status",
                                 "create_time"]):
    try:
      u = p.info["uids"]
      if u and any(x in uids for x in u):
        found[p.pid] = dict(pid=p.pid, ppid=p.info["ppid"], uids=list(u), name=p.info["name"],
                            status=p.info["status"], age_s=time.time() - p.info["create_time"],
                            cmdline=" ".join(p.info["cmdline"] or [])[:120])
    except (psutil.Error, TypeError):
      pass
  for c in me.children(recursive=True):
    try:
      if "multiprocessing.resource_tracker" in " ".join(c.cmdline()):
        continue   # multiprocessing's own helper of this process, alive until it exits
      found[c.pid] = dict(pid=c.pid, ppid=c.ppid(), uids=list(c.uids()), name=c.name(),
                          status=c.status(), age_s=time.time() - c.create_time(),
                          cmdline=" ".join(c.cmdline())[:120])
    except psutil.Error:
      pass
  return list(found.values())


_LIBC = None


def libc():
  """This process's libc, for the IPC calls Python has no module for (sysv_ipc is not a
  dependency): shmget & co., mq_open & co."""
  global _LIBC
  if _LIBC is None:
    _LIBC = ctypes.CDLL(None, use_errno=True)
    _LIBC.shmat.restype = ctypes.c_void_p
    _LIBC.shmat.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_int)
    _LIBC.shmdt.argtypes = (ctypes.c_void_p,)
    _LIBC.shmctl.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_void_p)
    _LIBC.msgctl.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_void_p)
  return _LIBC


IPC_CREAT, IPC_EXCL, IPC_RMID, IPC_NOWAIT = 0o1000, 0o2000, 0, 0o4000


class _Msg(ctypes.Structure):
  _fields_ = [("mtype", ctypes.c_long), ("mtext", ctypes.c_char * 256)]


def sysv_objects() -> dict[tuple, dict]:
  """Every SysV IPC object of this IPC namespace (the host's, for us): (kind, id, key, creator
  uid) -> {kind, id, key, uid, cuid}, from /proc/sysvipc/{shm,sem,msg}."""
  out = {}
  for kind in ("shm", "sem", "msg"):
    try:
      with open(f"/proc/sysvipc/{kind}") as f:
        header, *rows = f.read().splitlines()
    except (OSError, ValueError):
      continue
    cols = header.split()
    for row in rows:
      d = dict(zip(cols, row.split()))
      try:
        o = dict(kind=kind, id=int(d[kind + "id" if kind != "msg" else "msqid"]), key=int(d["key"]),
                 uid=int(d["uid"]), cuid=int(d["cuid"]))
      except (KeyError, ValueError):
        continue
      out[(kind, o["id"], o["key"], o["cuid"])] = o
  return out


def leaked_sysv(before: dict, after: dict, uids) -> tuple[list[dict], int]:
  """(new SysV objects attributed to this run, count of other new ones). Attributed: the attacks'
  key, or owned or created by a sandbox uid (an IPC_PRIVATE object has no key to tell)."""
  leaked, other = [], 0
  for k, o in after.items():
    if k in before or o["key"] == IPC_KEY_PLANTED:
      continue
    if o["key"] == IPC_KEY_LEFT or o["uid"] in uids or o["cuid"] in uids:
      leaked.append(o)
    else:
      other += 1
  return leaked, other


def mqueue_listing() -> str:
  """How posix_mqueues sees message queues: the /dev/mqueue listing where it is mounted; else
  (we mount nothing on the host) by opening the names the attacks use."""
  return "mounted" if os.path.ismount("/dev/mqueue") else "probed_names"


def posix_mqueues() -> set[str]:
  """POSIX message queues of this IPC namespace: all of them, or the attacks' names (above)."""
  if mqueue_listing() == "mounted":
    return {"/" + n for n in os.listdir("/dev/mqueue")}
  found = set()
  for name in (MQ_LEFT, MQ_PLANTED):
    fd = libc().mq_open(name.encode(), os.O_RDONLY)
    if fd >= 0:
      libc().mq_close(fd)
      found.add(name)
  return found


def leaked_mqueues(before: set, after: set) -> tuple[list[str], int]:
  new = sorted(after - before - {MQ_PLANTED})
  leaked = [n for n in new if MARK in n]
  return leaked, len(new) - len(leaked)


def leaked_posix_shm(before: dict, after: dict, uids) -> tuple[list[str], int]:
  """(new /dev/shm entries of this run: POSIX shared memory and named semaphores are files there,
  count of other new ones), from `listing()`s."""
  leaked, other = [], 0
  for p, (uid, _) in after.items():
    if not p.startswith("/dev/shm/") or p in before:
      continue
    name = os.path.basename(p)
    if (MARK in name and not name.startswith(MARK + "_planted")) or uid in uids:
      leaked.append(p)
    else:
      other += 1
  return sorted(leaked), other


def listeners() -> dict[tuple, dict]:
  """Listening sockets of this network namespace (the host's, for us): (proto, inode) ->
  {proto, local, uid, inode}, from /proc/net/tcp, tcp6 (state 0A) and unix (__SO_ACCEPTCON)."""
  out = {}
  for proto in ("tcp", "tcp6"):
    try:
      with open(f"/proc/net/{proto}") as f:
        rows = f.read().splitlines()[1:]
    except OSError:
      continue
    for row in rows:
      v = row.split()
      if len(v) > 9 and v[3] == "0A":
        out[(proto, int(v[9]))] = dict(proto=proto, local=v[1], uid=int(v[7]), inode=int(v[9]))
  try:
    with open("/proc/net/unix") as f:
      rows = f.read().splitlines()[1:]
  except OSError:
    rows = []
  for row in rows:
    v = row.split()
    if len(v) > 6 and int(v[3], 16) & 0x10000:
      out[("unix", int(v[6]))] = dict(proto="unix", local=v[7] if len(v) > 7 else "", uid=None,
                                      inode=int(v[6]))
  return out


def _socket_holders(inodes: set[int]) -> dict[int, list[int]]:
  """inode -> pids holding that socket, from /proc/*/fd."""
  want = {f"socket:[{i}]": i for i in inodes}
  out: dict[int, list[int]] = {}
  for pid in os.listdir("/proc"):
    if not pid.isdigit():
      continue
    try:
      fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
      continue
    for fd in fds:
      try:
        link = os.readlink(f"/proc/{pid}/fd/{fd}")
      except OSError:
        continue
      if link in want:
        out.setdefault(want[link], []).append(int(pid))
  return out


def _uids_of(pid: int) -> list[int]:
  try:
    with open(f"/proc/{pid}/status") as f:
      return next([int(x) for x in l.split()[1:]] for l in f if l.startswith("Uid:"))
  except (OSError, StopIteration, ValueError):
    return []


def leaked_listeners(before: dict, after: dict, uids) -> tuple[list[dict], int]:
  """(new listening sockets of this run, count of other new ones). Attributed: owned by a sandbox
  uid, or held by a process of one or by a descendant of this process."""
  new = {k: v for k, v in after.items() if k not in before}
  if not new:
    return [], 0
  holders = _socket_holders({v["inode"] for v in new.values()})
  try:
    ours = {c.pid for c in psutil.Process().children(recursive=True)}
  except psutil.Error:
    ours = set()
  leaked, other = [], 0
  for v in new.values():
    pids = holders.get(v["inode"], [])
    if v["uid"] in uids or any(p in ours or set(_uids_of(p)) & set(uids) for p in pids):
      leaked.append({**v, "holders": pids[:4]})
    else:
      other += 1
  return leaked, other


def remove_ipc(sysv: list[dict], mqueues: list[str], shm_files: list[str]) -> int:
  """Removes the IPC objects a run left (after they were counted), so the soak itself leaves
  nothing behind. Returns how many it removed."""
  c, n = libc(), 0
  for o in sysv:
    if o["kind"] == "sem":
      n += c.semctl(o["id"], 0, IPC_RMID) == 0
    else:
      n += (c.shmctl if o["kind"] == "shm" else c.msgctl)(o["id"], IPC_RMID, None) == 0
  for name in mqueues:
    n += c.mq_unlink(name.encode()) == 0
  for p in shm_files:
    try:
      os.remove(p)
      n += 1
    except OSError:
      pass
  return n


def plant_ipc() -> list[tuple[str, int]]:
  """The secret in a SysV shared memory segment, a SysV message queue and a POSIX message queue,
  world-readable (only an IPC namespace keeps them out of sight), as an earlier run that knew the
  answer could leave it. Returns what to remove."""
  c, made = libc(), []
  text = SECRET.encode()
  shm = c.shmget(IPC_KEY_PLANTED, 4096, IPC_CREAT | IPC_EXCL | 0o644)
  if shm >= 0:
    made.append(("shm", shm))
    addr = c.shmat(shm, None, 0)
    if addr not in (None, ctypes.c_void_p(-1).value):
      ctypes.memmove(addr, text, len(text))
      c.shmdt(addr)
  q = c.msgget(IPC_KEY_PLANTED, IPC_CREAT | IPC_EXCL | 0o666)   # writable: readers put it back
  if q >= 0:
    made.append(("msg", q))
    c.msgsnd(q, ctypes.byref(_Msg(1, text)), len(text), IPC_NOWAIT)
  mq = c.mq_open(MQ_PLANTED.encode(), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o666, None)
  if mq >= 0:
    made.append(("mq", 0))
    c.mq_send(mq, text, len(text), 0)
    c.mq_close(mq)
  return made


def unplant_ipc(made: list[tuple[str, int]]):
  remove_ipc([dict(kind=k, id=i) for k, i in made if k != "mq"],
             [MQ_PLANTED] if any(k == "mq" for k, _ in made) else [], [])


def plant() -> list[str]:
  paths = []
  for p in _PLANTED:
    for path, text in ((p, SECRET + "\n"), (p + "_lit", f'"{SECRET}"\n')):
      with open(path, "w") as f:
        f.write(text)
      os.chmod(path, 0o644)     # world-readable: only the private root keeps it out of sight
      paths.append(path)
  return paths


def rss_mb(pids) -> dict[str, float]:
  out = {}
  for pid in pids:
    try:
      out[str(pid)] = psutil.Process(pid).memory_info().rss / 2**20
    except psutil.Error:
      pass
  return out


# ---- the run ---------------------------------------------------------------------------------

def verdict_ok(item: Item, res, cfg: RewardConfig) -> bool:
  if item.expect_pass:
    return res.error is None and res.parts.get("correct") == cfg.correct_reward
  return res.parts.get("correct", 0.0) == 0.0


# How the error of a task starts when it got no verdict through no doing of its program: its
# worker was killed under it (the chaos below), or a limit on our side stopped it (the reward's
# VERIFIER_FAULT). Such a task is dropped (counted as faulted), not scored.
FAULTS = {"verifier worker died": "worker_died", "could not send task to worker": "worker_died",
          getattr(reward_mod, "VERIFIER_FAULT", "verifier fault"): "verifier_fault"}


def fault_kind(error: str | None) -> str | None:
  for prefix, kind in FAULTS.items():
    if error and error.startswith(prefix):
      return kind
  return None


class Chaos(threading.Thread):
  """SIGKILLs a busy worker (one with sandboxed processes under it) about every `every_s`
  seconds: a worker lost with its runs alive, as a hostile program or the host can make happen.
  Busy workers are drawn with weights = their processes, so the ones running daemons and holders
  are hit most. The pool must resolve the task with an error and leave nothing of it alive."""

  def __init__(self, pool: VerifierPool, every_s: float, seed: int):
    super().__init__(name="soak-chaos", daemon=True)
    self.pool, self.every_s = pool, every_s
    self.r = random.Random(seed)
    self.kills: list[dict] = []
    self._halt = threading.Event()

  def run(self):
    while not self._halt.wait(self.every_s * self.r.uniform(0.5, 1.5)):
      busy = {}
      for pid in self.pool.worker_pids():
        try:
          n = len(psutil.Process(pid).children(recursive=True))
        except psutil.Error:
          continue
        if n:
          busy[pid] = n
      if not busy:
        continue
      pids = sorted(busy)
      pid = self.r.choices(pids, weights=[busy[p] for p in pids])[0]
      try:
        os.kill(pid, signal.SIGKILL)
      except ProcessLookupError:
        continue
      self.kills.append(dict(pid=pid, processes=busy[pid]))

  def stop(self):
    self._halt.set()
    self.join()


def soak(pool: VerifierPool, items: list[Item], cfg: RewardConfig, wait_s: float, seen_pids: set,
         progress: bool = True, chaos_every_s: float = 0.0, seed: int = 0) -> dict:
  t0 = time.perf_counter()
  futs = []
  step = max(1, len(items) // 10)
  chaos = Chaos(pool, chaos_every_s, seed) if chaos_every_s > 0 else None
  if chaos:
    chaos.start()
  try:
    for k, it in enumerate(items):
      futs.append(pool.submit(it.task, _code(it.src, it.lang), None, k))
      if k % 50 == 0:
        seen_pids.update(pool.worker_pids())
      if progress and k and k % step == 0:
        done = sum(f.done() for f in futs)
        print(f"soak: submitted {k}/{len(items)}, resolved {done}, "
              f"{time.perf_counter() - t0:.0f} s", flush=True)
    done, not_done = concurrent.futures.wait(futs, timeout=wait_s)
  finally:
    if chaos:
      chaos.stop()
  wall = time.perf_counter() - t0
  seen_pids.update(pool.worker_pids())
  kills = chaos.kills if chaos else []
  seen_pids.update(k["pid"] for k in kills)   # their run dirs are the pool's to remove
  wrong, errors, faulted, by_cat = [], [], [], {}
  fault_counts: dict[str, int] = {}
  for it, f in zip(items, futs):
    c = by_cat.setdefault(it.category, {"tasks": 0, "right": 0, "faulted": 0})
    c["tasks"] += 1
    if f not in done:
      continue
    res = f.result()
    kind = fault_kind(res.error)
    if kind:   # no verdict: dropped, neither right nor wrong
      c["faulted"] += 1
      fault_counts[kind] = fault_counts.get(kind, 0) + 1
      faulted.append(f"{it.category}/{it.name}: {res.error[:120]}")
      continue
    if res.error:
      errors.append(f"{it.category}/{it.name}: {res.error[:120]}")
    if verdict_ok(it, res, cfg):
      c["right"] += 1
    else:
      wrong.append(dict(category=it.category, shape=it.shape, name=it.name,
                        correct=res.parts.get("correct"), error=res.error,
                        detail=str(res.info.get("code"))[:200]))
  resolved = len(done)
  verdicts = resolved - len(faulted)
  return dict(tasks=len(items), resolved=resolved, tasks_lost=len(items) - resolved,
              verdicts=verdicts,
              verdict_accuracy=(verdicts - len(wrong)) / verdicts if verdicts else 0.0,
              wrong_verdicts_count=len(wrong), wrong_verdicts=wrong[:8],
              faulted=len(faulted), faulted_by_kind=fault_counts, faulted_first=faulted[:5],
              chaos_every_s=chaos_every_s, chaos_kills=len(kills), chaos_kills_first=kills[:5],
              errors_count=len(errors), errors_first=errors[:5], by_category=by_cat,
              soak_wall_s=wall, throughput_per_s=len(items) / wall)


def throughput_phase(pool: VerifierPool, items: list[Item], workers: int, bare_dir: str,
                     chunk: int) -> dict:
  """Pool vs bare on the same correct/wrong programs, interleaved in chunks so that load from
  other processes hits both alike."""
  pool_s = bare_s = 0.0
  bare_right = 0
  with concurrent.futures.ThreadPoolExecutor(workers) as ex:
    for i in range(0, len(items), chunk):
      part = items[i:i + chunk]
      t = time.perf_counter()
      futs = [pool.submit(it.task, _code(it.src, it.lang), None, 0) for it in part]
      for f in futs:
        f.result()
      pool_s += time.perf_counter() - t
      t = time.perf_counter()
      bare = list(ex.map(lambda it: bare_run(it, bare_dir), part))
      bare_s += time.perf_counter() - t
      bare_right += sum(b == it.expect_pass for b, it in zip(bare, part))
  n = len(items)
  return dict(ratio_tasks=n, pool_benign_per_s=n / pool_s, bare_benign_per_s=n / bare_s,
              throughput_ratio=(n / pool_s) / (n / bare_s), bare_verdict_accuracy=bare_right / n)


def run(tasks: int = 5000, workers: int = 2, hostile_share: float = 0.2, cpp_share: float = 0.05,
        seed: int = 0, test_timeout_s: float = 2.0, task_timeout_s: float = 60.0,
        ratio_tasks: int = 200, max_tasks_per_worker: int = 1000, progress: bool = True,
        chaos_every_s: float = 0.0, include=ALWAYS) -> dict:
  cfg = RewardConfig(language_bonus=0.0, test_timeout_s=test_timeout_s)
  res = dict(bench="sandbox_soak", workers=workers, hostile_share=hostile_share,
             cpp_share=cpp_share, test_timeout_s=test_timeout_s,
             isolation_level=sandbox.isolation_level(), ipc_attacks=list(IPC_ATTACKS),
             mqueue_listing=mqueue_listing())
  bare_dir = tempfile.mkdtemp(prefix="mj_soak_bare_")
  planted = plant()
  planted_ipc = plant_ipc()
  try:
    before = listing()
    ipc_before, mq_before, listen_before = sysv_objects(), posix_mqueues(), listeners()
    t = time.perf_counter()
    catalog = Catalog(bare_dir)
    items = build_mix(tasks, seed, hostile_share, cpp_share, catalog, include=include)
    ratio_items = build_mix(ratio_tasks, seed + 1, hostile_share, cpp_share, catalog,
                            categories=("correct", "wrong")) if ratio_tasks else []
    res.update(catalog_s=time.perf_counter() - t, catalog_programs=len(catalog._ok),
               catalog_dropped=len(catalog.dropped), catalog_dropped_first=catalog.dropped[:5])
    counts = {}
    for it in items:
      counts[f"{it.category}/{it.shape}"] = counts.get(f"{it.category}/{it.shape}", 0) + 1
    res["mix"] = dict(sorted(counts.items()))
    res["hostile_variants"] = len(HOSTILE)
    # The reading attacks are real: run bare (no sandbox) they print the secret and pass.
    res["read_attacks_pass_bare"] = {
        n: bare_run(Item("hostile", HOSTILE[n][0], n, stdin_task(n, 0, HOSTILE[n][1], (
            ("0\n", SECRET + "\n"),)), HOSTILE[n][2], HOSTILE[n][1]), bare_dir)
        for n in ("read_planted", "cpp_read_planted", "cpp_include_planted", "ipc_read_planted")}
    if progress:
      print("mix", res["mix"], flush=True)
    seen_pids: set[int] = set()
    pool = VerifierPool(workers, cfg, task_timeout_s=task_timeout_s, max_queue=4 * workers,
                        max_tasks_per_worker=max_tasks_per_worker)
    # Every sandbox uid of this process (its pools' slots and a stand-alone Sandbox's).
    block = sandbox.process_uid_base()
    uids = range(min(block, pool.uid_base), max(block + sandbox.UIDS_PER_PROCESS,
                                                pool.uid_base + workers))
    try:
      # Warm: every worker ready (a trivial task each), then the start RSS.
      from_warm = [pool.submit({"kind": "code", "problem": "p", "language": "python",
                                "tests": [{"input": "", "output": "1\n"}]}, _code("print(1)"))
                   for _ in range(2 * workers)]
      for f in from_warm:
        f.result()
      res["worker_rss_start_mb"] = rss_mb(pool.worker_pids())
      res.update(soak(pool, items, cfg, wait_s=max(600.0, 2 * task_timeout_s), seen_pids=seen_pids,
                      progress=progress, chaos_every_s=chaos_every_s, seed=seed))
      res["worker_rss_end_mb"] = rss_mb(pool.worker_pids())
      if ratio_items:
        res.update(throughput_phase(pool, ratio_items, workers, bare_dir, chunk=4 * workers))
      res["pool_metrics"] = {k: v for k, v in pool.metrics().items()
                             if k in ("submitted", "completed", "timeouts", "crashes", "recycled",
                                      "errors", "latency_p50_s", "latency_p95_s", "latency_max_s",
                                      "cleanup_errors", "orphans_killed", "orphans_left",
                                      "stopped")}
      # A worker death the chaos did not cause is a program that reached its worker.
      res["worker_deaths_beyond_chaos"] = max(0, res["pool_metrics"]["crashes"]
                                              - res.get("chaos_kills", 0))
      seen_pids.update(pool.worker_pids())
    finally:
      pool.close()
    # A sandboxed process killed with its namespace at the end can stay a few moments as a
    # zombie waiting for the host's init to reap it: wait for the count to settle (10 s at most).
    for _ in range(20):
      procs = leaked_processes(uids)
      if not procs:
        break
      time.sleep(0.5)
    zombies = [p for p in procs if p["status"] == psutil.STATUS_ZOMBIE]
    procs = [p for p in procs if p["status"] != psutil.STATUS_ZOMBIE]
    res["zombies_unreaped"] = len(zombies)   # dead, holding only a pid entry (host init's to reap)
    after = listing()
    files, other = leaked_files(before, after, uids, seen_pids)
    run_dirs = [p for p in files if re.match(r"mj_sbx_\d+_", os.path.basename(p))]
    owned = {os.lstat(p).st_uid for p in files if os.path.lexists(p)}
    res.update(leaked_processes=len(procs), leaked_processes_first=procs[:5],
               leaked_uids=sorted({u for p in procs for u in p["uids"] if u in uids}
                                  | (owned & set(uids))),
               leaked_files=len(files), leaked_files_first=files[:8],
               leaked_run_dirs=len(run_dirs), new_entries_unattributed=other,
               worker_pids_seen=len(seen_pids))
    # IPC objects and listeners: what a run left outside its namespaces. Counted, then removed
    # (the soak itself must leave nothing either).
    sysv, sysv_other = leaked_sysv(ipc_before, sysv_objects(), uids)
    mqs, mq_other = leaked_mqueues(mq_before, posix_mqueues())
    shm, shm_other = leaked_posix_shm(before, after, uids)
    socks, socks_other = leaked_listeners(listen_before, listeners(), uids)
    res.update(leaked_sysv_ipc=len(sysv), leaked_sysv_ipc_first=sysv[:5],
               leaked_posix_mqueues=len(mqs), leaked_posix_mqueues_first=mqs[:5],
               leaked_posix_shm=len(shm), leaked_posix_shm_first=shm[:5],
               new_ipc_unattributed=sysv_other + mq_other + shm_other,
               leaked_listeners=len(socks), leaked_listeners_first=socks[:5],
               new_listeners_unattributed=socks_other,
               leaked_ipc_removed=remove_ipc(sysv, mqs, shm))
  finally:
    for p in planted:
      try:
        os.remove(p)
      except OSError:
        pass
    unplant_ipc(planted_ipc)
    shutil.rmtree(bare_dir, ignore_errors=True)
  res["host"] = common.host_info()
  return res


# ---- negative controls (--controls) ----------------------------------------------------------

_LISTENER = ("import socket, time\nt = socket.socket()\nt.bind(('127.0.0.1', 0))\nt.listen()\n"
             "u = socket.socket(socket.AF_UNIX)\nu.bind('\\0mj_soak_control_%d' % id(u))\n"
             "u.listen()\nprint('up', flush=True)\ntime.sleep(30)\n")


def _jsonable(x):
  return json.loads(json.dumps(x, default=lambda o: sorted(o) if isinstance(o, (set, frozenset))
                                else repr(o)))


def _control_leaks(check):
  """Without a pool: a file an attack named, a run dir of a worker pid, a live child of ours, and
  a wrong verdict are all counted."""
  made = [os.path.join("/tmp", MARK + "_control"), "/tmp/mj_sbx_999999999_control"]
  child = None
  before = listing()
  try:
    for p in made:
      open(p, "w").close()
    child = subprocess.Popen(["sleep", "30"])
    files, _ = leaked_files(before, listing(), range(0), {999999999})
    check("files_named_and_run_dir_seen", sorted(made) == [f for f in files if f in made],
          dict(made=sorted(made), leaked=files[:20]))
    procs = leaked_processes(range(0))
    check("child_process_seen", child.pid in [p["pid"] for p in procs],
          dict(child=child.pid, leaked=procs[:20]))
  finally:
    if child is not None:
      child.kill()
      child.wait()
    for p in made:
      try:
        os.remove(p)
      except OSError:
        pass
  item = Item("hostile", "stdin_py", "x", {}, "")
  cfg = RewardConfig(language_bonus=0.0)
  check("hostile_pass_is_a_wrong_verdict",
        not verdict_ok(item, RewardResult(1.0, {"correct": 0.9}), cfg))
  check("hostile_fail_is_the_right_verdict",
        verdict_ok(item, RewardResult(0.1, {"correct": 0.0}), cfg))


def _control_mix(check):
  """Every mix holds each of ALWAYS once, and the IPC attacks are hostile variants."""
  bare_dir = tempfile.mkdtemp(prefix="mj_soak_bare_")
  try:
    items = build_mix(len(ALWAYS), 0, 0.2, 0.05, Catalog(bare_dir), include=ALWAYS)
    names = sorted(i.name for i in items)
    check("mix_is_always", names == sorted(ALWAYS), dict(mix=names, always=sorted(ALWAYS)))
    check("ipc_attacks_are_hostile", set(IPC_ATTACKS) <= set(HOSTILE),
          dict(missing=sorted(set(IPC_ATTACKS) - set(HOSTILE))))
  finally:
    shutil.rmtree(bare_dir, ignore_errors=True)


def _control_ipc(check):
  """SysV shared memory, a semaphore set and a message queue under the attacks' key (and a
  keyless segment, seen by its owner's uid), a POSIX message queue and a /dev/shm entry named like
  the attacks', and listening TCP and unix sockets of a child of ours are all counted; remove_ipc
  then takes the IPC objects away."""
  c = libc()
  ipc0, mq0, files0, socks0 = sysv_objects(), posix_mqueues(), listing(), listeners()
  made, mq, child = [], -1, None
  shm_file = f"/dev/shm/{MARK}_control"
  me = range(os.getuid(), os.getuid() + 1)
  try:
    made = [("shm", c.shmget(IPC_KEY_LEFT, 4096, IPC_CREAT | 0o600)),
            ("sem", c.semget(IPC_KEY_LEFT, 1, IPC_CREAT | 0o600)),
            ("msg", c.msgget(IPC_KEY_LEFT, IPC_CREAT | 0o600)),
            ("shm", c.shmget(0, 4096, IPC_CREAT | 0o600))]
    mq = c.mq_open(MQ_LEFT.encode(), os.O_CREAT | os.O_RDWR, 0o600, None)
    open(shm_file, "w").close()
    child = subprocess.Popen([sys.executable, "-c", _LISTENER], stdout=subprocess.PIPE)
    check("ipc_objects_made", all(i >= 0 for _, i in made) and mq >= 0, dict(made=made, mq=mq))
    keyed, _ = leaked_sysv(ipc0, sysv_objects(), range(0))
    got = sorted((o["kind"], o["id"]) for o in keyed)
    check("sysv_by_key_seen", got == sorted(made[:3]), dict(made=sorted(made[:3]), leaked=got))
    owned, _ = leaked_sysv(ipc0, sysv_objects(), me)
    got = {(o["kind"], o["id"]) for o in owned}
    check("sysv_by_owner_seen", set(made) <= got, dict(made=made, leaked=got))
    got = leaked_mqueues(mq0, posix_mqueues())[0]
    check("posix_mqueue_seen", got == [MQ_LEFT], dict(expected=[MQ_LEFT], leaked=got))
    got = leaked_posix_shm(files0, listing(), range(0))[0]
    check("posix_shm_seen", got == [shm_file], dict(expected=[shm_file], leaked=got))
    line = child.stdout.readline()
    check("listener_child_up", line == b"up\n", dict(line=repr(line)))
    socks, _ = leaked_listeners(socks0, listeners(), range(0))
    got = {x["proto"] for x in socks if child.pid in x["holders"]}
    check("tcp_and_unix_listeners_seen", got == {"tcp", "unix"},
          dict(child=child.pid, protos=got, leaked=socks[:20]))
  finally:
    if child is not None:
      child.kill()
      child.wait()
    if mq >= 0:
      c.mq_close(mq)
    remove_ipc([dict(kind=k, id=i) for k, i in made if i >= 0], [MQ_LEFT], [shm_file])
  left = {(o["kind"], o["id"]) for o in leaked_sysv(ipc0, sysv_objects(), me)[0]}
  check("sysv_removed", not set(made) & left, dict(made=made, left=left))
  got = leaked_mqueues(mq0, posix_mqueues())[0]
  check("posix_mqueue_removed", got == [], dict(left=got))
  check("posix_shm_removed", not os.path.exists(shm_file), dict(left=shm_file))


CONTROLS = {"leaks": _control_leaks, "mix": _control_mix, "ipc": _control_ipc}


def controls() -> dict:
  """The negative controls of the leak detectors and the verdict rule, without a soak: checks
  named "<group>.<check>" -> whether it held, and details for those that did not (an exception in
  a group is "<group>.raised", false)."""
  checks, details = {}, {}
  for group, fn in CONTROLS.items():
    def check(name, ok, detail=None, group=group):
      checks[f"{group}.{name}"] = bool(ok)
      if not ok:
        details[f"{group}.{name}"] = _jsonable(detail)
    try:
      fn(check)
    except Exception as e:   # reported, not raised: the caller judges
      check("raised", False, f"{type(e).__name__}: {e}")
  return dict(bench="sandbox_soak", mode="controls", isolation_level=sandbox.isolation_level(),
              checks=checks, details=details, ok=all(checks.values()))


def main():
  ap = common.argument_parser(__doc__)
  ap.add_argument("--tasks", type=int, default=5000, help="tasks in the soak")
  ap.add_argument("--workers", type=int, default=2, help="pool size")
  ap.add_argument("--hostile_share", type=float, default=0.2)
  ap.add_argument("--cpp_share", type=float, default=0.05,
                  help="share of C++ tasks (of the benign and of the hostile ones)")
  ap.add_argument("--test_timeout_s", type=float, default=2.0, help="per-run CPU/wall limit")
  ap.add_argument("--task_timeout_s", type=float, default=60.0, help="pool's per-task deadline")
  ap.add_argument("--ratio_tasks", type=int, default=200,
                  help="correct/wrong tasks timed through the pool and bare (0: skip)")
  ap.add_argument("--max_tasks_per_worker", type=int, default=1000)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--chaos_every_s", type=float, default=0.0,
                  help="SIGKILL a busy worker about this often during the soak (0: never)")
  ap.add_argument("--no_progress", action="store_true", help="no progress lines during the soak")
  ap.add_argument("--controls", action="store_true",
                  help="no soak: the negative controls of the leak checks (see above)")
  args = ap.parse_args()
  # SIGTERM (e.g. from `timeout`) unwinds through run()'s cleanup: the planted files go.
  signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
  if args.controls:
    common.emit(controls())
    return
  res = run(args.tasks, args.workers, args.hostile_share, args.cpp_share, args.seed,
            args.test_timeout_s, args.task_timeout_s, args.ratio_tasks,
            args.max_tasks_per_worker, progress=not args.no_progress,
            chaos_every_s=args.chaos_every_s)
  common.emit(res, ndigits=4)


if __name__ == "__main__":
  main()
