"""Our side of a sandboxed run is bounded (issue #64): a run's mount table names no host path of
ours, a flood on stderr (vmsplice'd pages included) costs our reader no more than the output cap,
and an answer of the function-call harness is bounded in size before it is decoded. New variants,
not the held-out wave's programs."""
import platform
import tracemalloc

import pytest

from magistral_jax.rewards import code_asserts, sandbox
from magistral_jax.rewards.code_check import default_python
from magistral_jax.rewards.config import RewardConfig
from magistral_jax.rewards.reward import compute_reward
from magistral_jax.rewards.sandbox_limits import Limits

CFG = RewardConfig(language_bonus=0.0, test_timeout_s=2.0)


@pytest.fixture(params=["default", "userns"])
def sbx(request, private_sandbox):
  return private_sandbox(request.param, 230)


def _run(s, src, limits=Limits(cpu_s=2.0)):
  d = s.make_dir()
  try:
    with open(f"{d}/data.txt", "w") as f:
      f.write("input")
    return s.run(["/usr/bin/python3"], d, limits, python_src=src), d
  finally:
    s.remove_dir(d)


def test_the_mount_table_names_no_host_path_of_ours(sbx):
  r, d = _run(sbx, "print(open('/proc/self/mountinfo').read())\nprint(open('data.txt').read())")
  assert r.returncode == 0, r
  table = r.stdout.decode()
  assert table.rstrip().endswith("input")               # the input is there, as a copy
  assert d not in table and "mj_sbx" not in table, table


# vmsplice of one page, again and again: the program pays nothing per byte, a reader that reads
# it all pays for every copy.
_VMSPLICE = r"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
class Iov(ctypes.Structure):
  _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]
buf = ctypes.create_string_buffer(b"E" * 65536, 65536)
iov = Iov(ctypes.cast(buf, ctypes.c_void_p), 65536)
while True:
  if libc.syscall(ctypes.c_long(NR), ctypes.c_long(2), ctypes.byref(iov), ctypes.c_long(1),
                  ctypes.c_long(0)) < 0:
    os.write(2, buf.raw)
"""


@pytest.mark.skipif(platform.machine() not in ("x86_64", "aarch64"), reason="vmsplice number")
def test_a_stderr_flood_ends_at_the_output_cap(sbx):
  nr = {"x86_64": 278, "aarch64": 75}[platform.machine()]
  r, _ = _run(sbx, _VMSPLICE.replace("NR", str(nr)),
              Limits(cpu_s=5.0, max_output_bytes=4 << 20))
  assert r.output_truncated and not r.timed_out, r
  assert len(r.stderr) <= 4096 and r.stdout == b""


def _assert_task(*asserts):
  return {"kind": "code", "problem": "p", "language": "python", "test_list": list(asserts)}


def _score(task, src):
  return compute_reward(task, f"<think>\nx\n</think>\n```python\n{src}\n```\n", None, CFG)


def test_a_stderr_flood_in_a_call_fails_it(sbx):
  src = "import os\ndef f(x):\n  while True:\n    os.write(2, b'E' * 65536)\n"
  r = _score(_assert_task("assert f(1) == 2"), src)
  assert r.parts["correct"] == 0.0 and r.error is None, r
  assert "stderr" in r.info["code"], r.info


def test_a_huge_answer_is_refused_before_it_is_decoded(sbx):
  # 16 MB of answer line: read whole and decoded, it would cost us its size several times over
  # (millions of objects, for a list of small values).
  src = "def f(x):\n  return '[]' * (8 << 20)\n"
  limits = Limits(cpu_s=4.0, memory_mb=400)
  d = sbx.make_dir()
  tracemalloc.start()
  try:
    res = code_asserts.run_assert_tests(sbx, d, default_python(), src, "assert f(1) == []\n",
                                        None, limits)
    _, peak = tracemalloc.get_traced_memory()
  finally:
    tracemalloc.stop()
    sbx.remove_dir(d)
  assert not res.passed and "answer line over" in res.detail, res
  assert peak < 4 * code_asserts.MAX_ANSWER_BYTES + (8 << 20), peak


def test_shared_state_grown_call_by_call_is_bounded(sbx):
  # A candidate that grows what both sides hold (eight kept arguments) a little on every call:
  # each answer stays under its bound, but the shared state would grow without end.
  src = ("_k = []\ndef keep(x):\n  _k.append(x)\n"
         "def grow(i):\n  _k[i].append('x' * 60000)\n  return 0\n")
  tests = ("a = [[] for _ in range(8)]\nfor x in a:\n  keep(x)\n"
           "for _ in range(14):\n  for i in range(8):\n    grow(i)\n"
           "assert sum(map(len, a)) == 112\n")
  d = sbx.make_dir()
  tracemalloc.start()
  try:
    res = code_asserts.run_assert_tests(sbx, d, default_python(), src, tests, None,
                                        Limits(cpu_s=4.0, memory_mb=400))
    _, peak = tracemalloc.get_traced_memory()
  finally:
    tracemalloc.stop()
    sbx.remove_dir(d)
  # Whichever bound it meets first: the shared state's, or the conversation's output cap.
  assert not res.passed, res
  assert "shared containers over" in res.detail or "output limit" in res.detail, res
  assert peak < 8 * code_asserts.MAX_SHARED_BYTES, peak
