"""Attacks on the sandbox as a policy would try them (issue #33): escaping the private filesystem
and forging a pass. Every case must be contained (no file outside the run dir, nothing read from
outside it) and get no correctness reward. The reading attacks make the planted secret the
expected output, so reading it WOULD be a pass: "no pass" proves nothing was read."""
import glob
import logging
import os
import secrets
import sys
import time

import host_leaks
import hostile_programs as hp
import pytest
from known_verdicts import code_response as _code

from magistral_jax.rewards import code_asserts, code_check, code_codec, sandbox
from magistral_jax.rewards.config import RewardConfig
from magistral_jax.rewards.reward import compute_reward
from magistral_jax.rewards.sandbox_limits import Limits

CFG = RewardConfig(language_bonus=0.0, test_timeout_s=3.0)
PROJECT = hp.PROJECT
DATASET = os.path.join(PROJECT, "magistral_jax", "data", "sources", "humaneval_full.jsonl")
# The attacks (hostile_programs.py, shared with bench/sandbox_soak.py), by kind.
FORGERIES = {n: a.src for n, a in hp.ATTACKS.items() if a.kind == "forgery" and a.shape == "func"}
# A forgery that idles is stopped at the wall-clock backstop, which grows with the CPU limit: these
# get 1 CPU second (as test_sandbox_wave4.py's idling programs), which changes nothing in what
# stops them, only how long it waits.
IDLE_CFG = RewardConfig(language_bonus=0.0, test_timeout_s=1.0)
IDLING_FORGERIES = ("sleeps",)
assert set(IDLING_FORGERIES) <= set(FORGERIES)
STDIN_FORGERIES = [a.src for a in hp.ATTACKS.values()
                   if a.kind == "forgery" and a.shape == "stdin" and a.lang == "python"]
CPP_FORGERIES = [a.src for a in hp.ATTACKS.values() if a.kind == "forgery" and a.lang == "cpp"]


def _leftovers():
  found = []
  for d in hp.WRITE_TARGETS:
    found += glob.glob(os.path.join(d, hp.MARK + "*"))
  return [p for p in found if not os.path.basename(p).startswith(hp.MARK + "_planted")]


def _stdin_task(expected, lang="python"):
  return {"kind": "code", "problem": "p", "language": lang,
          "tests": [{"input": "1\n", "output": expected}]}


DOUBLE = {"kind": "code", "problem": "Write f(x) = 2x.", "language": "python",
          "test_code": "def check(candidate):\n  for x in (2, 3, -7, 10**12):\n"
                       "    assert candidate(x) == 2 * x\n", "entry_point": "f"}
MBPP = {"kind": "code", "problem": "Write f(x) = 2x.", "language": "python",
        "test_list": ["assert f(2) == 4", "assert f(5) == 10", "assert f((1,)) == (1, 1)"]}


@pytest.fixture(params=["default", "userns"])
def sbx(request, monkeypatch):
  """The process's sandbox, and the same in the user-namespace mode a non-root host gets (forced
  here: it works as root too), so both private-filesystem modes meet every attack."""
  s = sandbox.Sandbox(uid=sandbox.DEFAULT_UID_BASE + 4999)
  assert s.isolation in sandbox.PRIVATE_FS, s.isolation
  if request.param == "userns":
    s.isolation = sandbox.ISOLATION_USERNS
  monkeypatch.setattr(sandbox, "_default", s)
  yield s
  assert not _leftovers()


@pytest.fixture
def planted():
  """A secret in files outside any run dir: host /tmp and /dev/shm, the home and project dirs."""
  secret = secrets.token_hex(16)
  paths = host_leaks.plant_files(secret)
  yield secret, paths
  host_leaks.unplant_files(paths)


# ----------------------------------------------------------------------------- filesystem

@pytest.mark.parametrize("lang,src", [("python", hp.WRITE_PY), ("cpp", hp.WRITE_CPP)])
def test_writes_outside_the_run_dir_leave_nothing(sbx, lang, src):
  r = compute_reward(_stdin_task("2\n", lang), _code(src, lang), None, CFG)
  assert r.error is None, r
  assert r.parts["correct"] == 0.9, r.info    # the output is right; the writes went nowhere
  assert not _leftovers()


def test_writable_places_inside_are_private_and_size_limited(sbx):
  # /tmp and /dev/shm exist and are writable inside, but are tmpfs of the run: 100 MB do not fit.
  src = ("import os\nfor d in ('/tmp', '/dev/shm'):\n  try:\n    with open(d + '/big', 'wb') as f:\n"
         "      for _ in range(100):\n        f.write(b'x' * (1 << 20))\n    print('fit')\n"
         "  except OSError:\n    print('full')\n")
  r = compute_reward(_stdin_task("full\nfull\n"), _code(src), None, CFG)
  assert r.parts["correct"] == 0.9, r.info


def test_root_is_read_only_and_minimal(sbx):
  src = ("import os\nprint(sorted(os.listdir('/')))\n"
         "try:\n  open('/usr/x', 'w')\n  print('usr writable')\nexcept OSError:\n  print('ro')\n"
         "print(os.path.exists('/root'), os.path.exists('/home'), os.path.exists('/work'))\n"
         "print(len([p for p in os.listdir('/proc') if p.isdigit()]))\n")
  listing = sorted(["bin", "dev", "etc", "lib", "lib64", "proc", "sandbox", "sbin", "tmp", "usr"]
                   + [p.lstrip("/") for p in ("/lib32", "/libx32") if os.path.exists(p)])
  expected = f"{listing!r}\nro\nFalse False False\n1\n"
  r = compute_reward(_stdin_task(expected), _code(src), None, CFG)
  assert r.parts["correct"] == 0.9, r.info    # /proc shows only the run's own process


def test_reading_planted_files_finds_nothing(sbx, planted):
  secret, _ = planted
  for a in hp.ATTACKS.values():
    if a.kind == "read":
      r = compute_reward(_stdin_task(secret + "\n", a.lang), _code(a.src, a.lang), None, CFG)
      assert r.parts["correct"] == 0.0, (a, r.info)
      assert r.error is None


def test_the_dataset_and_its_answers_are_not_visible(sbx):
  src = f"import os\nprint(os.path.exists({DATASET!r}), os.path.exists({PROJECT!r}))"
  assert compute_reward(_stdin_task("False False\n"), _code(src), None,
                        CFG).parts["correct"] == 0.9


# ----------------------------------------------------------------------------- forged verdicts

@pytest.mark.parametrize("name", sorted(FORGERIES))
@pytest.mark.parametrize("task", [DOUBLE, MBPP], ids=["humaneval", "mbpp"])
def test_forged_verdicts_do_not_pass(sbx, name, task):
  cfg = IDLE_CFG if name in IDLING_FORGERIES else CFG
  t0 = time.monotonic()
  r = compute_reward(task, _code(FORGERIES[name]), None, cfg)
  assert r.parts["correct"] == 0.0, (name, r.info)
  assert r.error is None, r.error
  # Stopped by its CPU limit, or, idle, at the wall-clock backstop behind it.
  assert time.monotonic() - t0 < Limits(cpu_s=cfg.test_timeout_s).backstop_s + 5


def test_right_answers_still_pass_under_the_same_harness(sbx):
  right = "def f(x):\n  print('chatty', x)\n  return 2 * x if not isinstance(x, tuple) else x * 2"
  for task in (DOUBLE, MBPP):
    assert compute_reward(task, _code(right), None, CFG).parts["correct"] == 0.9
  # A stdlib module the solution imported is there for the tests too, as in a shared namespace;
  # one outside the allowed list is not imported on the candidate's word.
  task = {**MBPP, "test_list": ["assert math.isclose(f(0.5), 1.0)"]}
  assert compute_reward(task, _code("import math\ndef f(x):\n  return 2 * x"), None,
                        CFG).parts["correct"] == 0.9
  task = {**MBPP, "test_list": ["assert antigravity"]}
  assert compute_reward(task, _code("import os as antigravity\ndef f(x):\n  return x"), None,
                        CFG).parts["correct"] == 0.0


@pytest.mark.parametrize("src", STDIN_FORGERIES)
def test_stdin_forgeries_do_not_pass(sbx, src):
  task = {"kind": "code", "problem": "p", "language": "python",
          "tests": [{"input": f"{i}\n", "output": f"{3 * i + 1}\n"} for i in range(3)]}
  assert compute_reward(task, _code(src), None, CFG).parts["correct"] == 0.0


def test_cpp_forgeries_do_not_pass(sbx):
  task = {"kind": "code", "problem": "p", "language": "cpp",
          "tests": [{"input": f"{i}\n", "output": f"{3 * i + 1}\n"} for i in range(3)]}
  for src in CPP_FORGERIES:
    assert compute_reward(task, _code(src, "cpp"), None, CFG).parts["correct"] == 0.0, src


def test_no_secret_token_exists_to_find():
  # The verdict mechanism is values compared here; the old per-run secret is gone.
  assert not hasattr(code_check, "_HARNESS") and "secret" not in code_asserts._DRIVER


def test_codec_round_trips_plain_values_and_rejects_the_rest():
  for v in [None, True, 0, -3, 2**70, 1.5, float("inf"), "s", [1, (2, 3)], {1: "a", (1,): {2}},
            frozenset({1}), b"\x00", 1 + 2j, [[[]]], {"t": 1}]:
    back = code_codec.decode_value(code_codec.encode_value(v))
    assert back == v and type(back) is type(v)
    # The driver writes the same JSON without the json module.
    assert code_codec.driver_write(v) == code_codec.encode_value(v)
  class I(int):
    pass
  for bad in [I(1), object(), [object()], lambda: 0, {1: object()}]:
    for write in (code_codec.encode_value, code_codec.driver_write):
      with pytest.raises((TypeError, ValueError)):
        write(bad)
  deep = []
  for _ in range(200):
    deep = [deep]
  for write in (code_codec.encode_value, code_codec.driver_write):
    with pytest.raises(ValueError):
      write(deep)


# ----------------------------------------------------------------------------- refusal

def test_without_a_mount_namespace_the_sandbox_refuses(monkeypatch, caplog):
  monkeypatch.setattr(sandbox.Sandbox, "_probe", lambda self, isolation: False)
  with caplog.at_level(logging.ERROR):
    s = sandbox.Sandbox()
  assert s.isolation == sandbox.ISOLATION_REFUSED and "REFUSING" in caplog.text
  with pytest.raises(sandbox.SandboxUnavailable):
    s.run(["true"], "/", Limits())
  monkeypatch.setattr(sandbox, "_default", s)
  assert sandbox.isolation_level() == sandbox.ISOLATION_REFUSED
  r = compute_reward(DOUBLE, _code("def f(x):\n  return 2 * x"), None, CFG)
  assert r.parts["correct"] == 0.0 and "refused" in r.error


def test_allow_weak_sandbox_runs_with_a_loud_warning(monkeypatch, caplog):
  monkeypatch.setattr(sandbox.Sandbox, "_probe", lambda self, isolation: False)
  monkeypatch.setattr(sandbox, "_default", None)
  with caplog.at_level(logging.WARNING):
    r = compute_reward(DOUBLE, _code("def f(x):\n  return 2 * x"), None,
                       RewardConfig(language_bonus=0.0, allow_weak_sandbox=True))
  assert sandbox.isolation_level() == sandbox.ISOLATION_FALLBACK
  assert "WEAK ISOLATION" in caplog.text
  assert r.parts["correct"] == 0.9, r


def test_the_program_has_no_capabilities(sbx):
  # In a user namespace the program is "root" inside; with no capability it cannot unmount,
  # remount read-write or mount anything, so the private root stays as built.
  src = ("import ctypes, os\nfor l in open('/proc/self/status'):\n  if l.startswith('Cap'):\n"
         "    print(l.split()[1])\nlibc = ctypes.CDLL(None, use_errno=True)\n"
         "print(libc.umount2(b'/usr', 2), libc.mount(b'none', b'/tmp', b'tmpfs', 0, None))\n"
         "print(libc.mount(None, b'/', None, 32, None))")
  expected = "0000000000000000\n" * 5 + "-1 -1\n-1\n"
  assert compute_reward(_stdin_task(expected), _code(src), None, CFG).parts["correct"] == 0.9


def test_an_interpreter_outside_usr_runs_with_only_its_prefix_bound(sbx, planted):
  # Our venv's interpreter (here a pyenv build under /root): its real path and prefix are bound
  # read-only; the rest of the home dir, the venv and the project stay out of sight.
  secret, paths = planted
  cfg = RewardConfig(language_bonus=0.0, test_timeout_s=3.0, python=sys.executable)
  assert compute_reward(DOUBLE, _code("def f(x):\n  return 2 * x"), None,
                        cfg).parts["correct"] == 0.9
  src = ("import sys, os\nfor p in " + repr(paths) + ":\n  try:\n    print(open(p).read())\n"
         "  except OSError:\n    pass\nprint(os.path.exists(" + repr(sys.prefix) + "))")
  r = compute_reward(_stdin_task("False\n"), _code(src), None, cfg)
  assert r.parts["correct"] == 0.9, r.info
