"""Hostile responses: each gets reward 0 (or its correct value) in time and leaves nothing behind."""
import os
import time

import pytest

from magistral_jax.rewards import sandbox
from magistral_jax.rewards.config import RewardConfig
from magistral_jax.rewards.reward import compute_reward
from magistral_jax.verify.uids import uid_processes

CFG = RewardConfig(language_bonus=0.0, test_timeout_s=1.5, math_timeout_s=1)

STDIN_TASK = {"kind": "code", "problem": "Print twice the number.", "language": "python",
              "tests": [{"input": f"{i}\n", "output": f"{2 * i}\n"} for i in range(1, 6)]}
ASSERT_TASK = {"kind": "code", "problem": "Write f(x) = 2x.", "language": "python",
               "test_code": "def check(candidate):\n  assert candidate(2) == 4\n",
               "entry_point": "f"}
MATH_TASK = {"kind": "math", "problem": "What is 2+3?", "answer": "5"}


def _code(src):
  return f"<think>\nHere goes.\n</think>\n```python\n{src}\n```\n"


def _uid_processes(uid):
  """Pids of live (non-zombie) processes running as `uid`."""
  return uid_processes(uid)[0]


def _assert_nothing_left(uid, wait_s=3.0):
  deadline = time.monotonic() + wait_s
  while _uid_processes(uid) and time.monotonic() < deadline:
    time.sleep(0.05)
  assert _uid_processes(uid) == []


def test_isolation_level_has_a_private_filesystem():
  # As root: the per-slot uid; without root: a user namespace. Both have the private root; a host
  # where neither works refuses to run code (tests/rewards/test_sandbox_hostile.py).
  want = sandbox.ISOLATION_PRIVATE_FS if os.geteuid() == 0 else sandbox.ISOLATION_USERNS
  assert sandbox.isolation_level() == want


HOSTILE_CODE = {
    "never_ends": (STDIN_TASK, "while True:\n  pass"),
    "sleeps_forever": (STDIN_TASK, "import time\ntime.sleep(1000)"),
    "fork_bomb": (STDIN_TASK, "import os\nwhile True:\n  try:\n    os.fork()\n  except OSError:\n    pass"),
    "allocates_10gb": (STDIN_TASK, "x = bytearray(10 * 1024**3)\nprint(2 * int(input()))"),
    "writes_1gb": (STDIN_TASK, "with open('big', 'wb') as f:\n  for _ in range(1024):\n"
                               "    f.write(b'x' * (1 << 20))\nprint(2 * int(input()))"),
    "huge_stdout": (STDIN_TASK, "import sys\nwhile True:\n  sys.stdout.write('9' * 65536)"),
    "opens_socket": (STDIN_TASK, "import socket\ns = socket.create_connection(('8.8.8.8', 53), "
                                 "timeout=1)\nprint(2 * int(input()))"),
    "sys_exit_before_tests": (ASSERT_TASK, "import sys\nsys.exit(0)"),
    "os_exit_before_tests": (ASSERT_TASK, "import os\nos._exit(0)"),
    "exit_inside_function": (ASSERT_TASK, "import os\ndef f(x):\n  os._exit(0)"),
    "prints_first_output_always": (STDIN_TASK, "print(2)"),
    "kills_everything_it_sees": (STDIN_TASK,
        "import os, signal\nfor p in os.listdir('/proc'):\n  if p.isdigit() and int(p) != os.getpid():\n"
        "    try:\n      os.kill(int(p), signal.SIGKILL)\n    except OSError:\n      pass\n"
        "os.kill(os.getppid(), signal.SIGKILL)\nos.kill(-1, signal.SIGKILL)"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE_CODE))
def test_hostile_code_gets_no_correctness_reward(name):
  task, src = HOSTILE_CODE[name]
  t0 = time.monotonic()
  r = compute_reward(task, _code(src), None, CFG)
  assert r.parts["correct"] == 0.0, (name, r)
  assert r.reward == pytest.approx(0.1)          # format still holds
  assert time.monotonic() - t0 < 5 * CFG.test_timeout_s + 5
  _assert_nothing_left(sandbox.default_sandbox().uid)


def test_setsid_grandchild_does_not_survive_and_correct_code_still_passes():
  src = ("import os, time\nif os.fork() == 0:\n  os.setsid()\n  if os.fork() == 0:\n"
         "    time.sleep(1000)\n  os._exit(0)\nprint(2 * int(input()))")
  t0 = time.monotonic()
  r = compute_reward(STDIN_TASK, _code(src), None, CFG)
  assert r.parts["correct"] == 0.9          # the right output is the right output
  assert time.monotonic() - t0 < 5 * CFG.test_timeout_s
  _assert_nothing_left(sandbox.default_sandbox().uid)


def test_network_is_unreachable_inside_the_sandbox():
  src = ("import socket\ntry:\n  socket.create_connection(('127.0.0.1', 22), timeout=1)\n"
         "  print('connected')\nexcept OSError as e:\n  print(2 * int(input()))")
  assert compute_reward(STDIN_TASK, _code(src), None, CFG).parts["correct"] == 0.9


def test_one_megabyte_math_response_is_graded():
  response = "<think>\n" + "a" * (1 << 20) + "\n</think>\n\\boxed{5}"
  t0 = time.monotonic()
  assert compute_reward(MATH_TASK, response, None, CFG).parts["correct"] == 0.9
  assert time.monotonic() - t0 < 15


@pytest.mark.parametrize("response", [
    "",
    "<think>",
    "<think>\n" + "\\boxed{" * (1 << 17) + "\n</think>\n\\boxed{" + "{" * (1 << 19),
    "<think>\nx\n</think>\n\\boxed{" + "{" * 10000,
    "<think>\nx\n</think>\n\\boxed{\\frac{1}{2}}}}}} {{{",
    "<think>\nx\n</think>\n\\boxed{9^{9^{9^{9}}}}",
    b"<think>\n\xff\xfe\xc3(\n</think>\n\\boxed{\xff}",
    "<think>\n\udcff\n</think>\n\\boxed{\udcfe6}",
])
def test_bad_math_responses_score_zero_quickly(response):
  t0 = time.monotonic()
  r = compute_reward(MATH_TASK, response, None, CFG)
  assert r.parts["correct"] == 0.0 and r.reward in (0.0, pytest.approx(0.1))
  assert time.monotonic() - t0 < 15


def test_one_megabyte_code_response_is_handled():
  src = "# " + "x" * (1 << 20) + "\nprint(2 * int(input()))"
  r = compute_reward(STDIN_TASK, _code(src), None, CFG)
  assert r.error is None and r.parts["correct"] == 0.9
