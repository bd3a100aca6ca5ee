"""Code correctness: the FIRST fenced block of the answer, tagged or not, run against the task's
tests.

Two kinds of test:
  - stdin/stdout pairs (`tests: [{"input", "output"}]`): the output must match the expected one
    token by token, numbers within a tolerance;
  - assert tests, HumanEval style (`test_code` defining `check(candidate)` + `entry_point`) or
    MBPP style (`test_list` of assert lines, optional `test_setup_code`). The harness reads a
    per-run secret from stdin before running any candidate code and prints it after the last
    assertion, so `sys.exit(0)` / `os._exit(0)` before the tests cannot pass.
At most `num_tests` tests are drawn with `random.Random(group_seed)`, so every completion of a
group sees the same tests. The reward is binary: all drawn tests must pass.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import os
import random
import secrets
import shutil
import subprocess
import sys
import tempfile

from magistral_jax.rewards import format as fmt
from magistral_jax.rewards.sandbox import Limits, Sandbox

LANG_ALIASES = {
  "python": "python", "py": "python", "python3": "python", "py3": "python",
  "cpp": "cpp", "c++": "cpp", "cc": "cpp", "cxx": "cpp", "c++20": "cpp", "c++17": "cpp",
}
CXX_FLAGS = ("-std=c++20", "-O2", "-pipe")

_HARNESS = r'''
import sys as _sys
def _run():
  secret = _sys.stdin.readline().strip()
  ns = {"__name__": "solution", "__builtins__": __builtins__}
  with open("solution.py", encoding="utf-8") as f:
    exec(compile(f.read(), "solution.py", "exec"), ns)
  with open("tests.py", encoding="utf-8") as f:
    exec(compile(f.read(), "tests.py", "exec"), ns)
  ENTRY = _sys.argv[1]
  if ENTRY:
    ns["check"](ns[ENTRY])
  _sys.stdout.flush()
  _sys.stdout.write("\n" + secret + "\n")
  _sys.stdout.flush()
_run()
'''


@functools.lru_cache(maxsize=None)
def _harness_path() -> str:
  """The harness file, shared by all processes, world-readable (the sandbox uid runs it)."""
  d = os.path.join(tempfile.gettempdir(), "magistral_jax_harness")
  os.makedirs(d, mode=0o755, exist_ok=True)
  path = os.path.join(d, hashlib.sha1(_HARNESS.encode()).hexdigest()[:12] + ".py")
  if not os.path.exists(path):
    tmp = f"{path}.{os.getpid()}"
    _write(tmp, _HARNESS)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
  return path


@dataclasses.dataclass
class CodeResult:
  passed: bool
  detail: str = ""        # why it failed, for logging
  tests_run: int = 0


def task_language(task: dict) -> str:
  """The language a code task's solution must be in: python or cpp (default python)."""
  language = LANG_ALIASES.get(str(task.get("language", "python")).lower())
  if language is None:
    raise ValueError(f"task language must be python or cpp, got {task.get('language')!r}")
  return language


def extract_code_block(answer: str, untagged_language: str | None = None
                       ) -> tuple[str | None, str] | None:
  """(language, code) of the FIRST fenced block of the answer, tagged or not (SPEC §2 grades the
  first block; that some block carries a tag is the format rule, rewards/format.py). Language
  None when the tag names no language we run. An untagged block is taken to be in
  `untagged_language` (the task's language): the task states the language its solution must be
  in, so the block is run as that, and fails the tests unless it solves the task."""
  block = next(fmt.code_blocks(answer), None)
  if block is None:
    return None
  tag, code = block
  if tag is None:
    return untagged_language, code
  return LANG_ALIASES.get(tag.lower()), code


def _is_number(tok: str) -> float | None:
  try:
    x = float(tok)
  except ValueError:
    return None
  return x if math.isfinite(x) else None


def outputs_match(got: str, expected: str, rel_tol: float = 1e-6, abs_tol: float = 1e-6) -> bool:
  """Token-by-token comparison; two numeric tokens match within tolerance."""
  a, b = got.split(), expected.split()
  if len(a) != len(b):
    return False
  for x, y in zip(a, b):
    if x == y:
      continue
    fx, fy = _is_number(x), _is_number(y)
    if fx is None or fy is None or not math.isclose(fx, fy, rel_tol=rel_tol, abs_tol=abs_tol):
      return False
  return True


def draw_tests(n: int, num_tests: int, group_seed: int) -> list[int]:
  """Indices of the tests to run: the same for every completion sharing `group_seed`."""
  if n <= num_tests:
    return list(range(n))
  return sorted(random.Random(group_seed).sample(range(n), num_tests))


def _write(path: str, text: str):
  with open(path, "w", encoding="utf-8", errors="replace") as f:
    f.write(text)


# ----------------------------------------------------------------------------- C++

@functools.lru_cache(maxsize=None)
def _gxx_version() -> str:
  return subprocess.run(["g++", "--version"], capture_output=True, text=True).stdout.split("\n")[0]


_pch_dirs: dict = {}


def precompiled_header_dir(flags: tuple[str, ...] = CXX_FLAGS) -> str | None:
  """A directory holding `bits/stdc++.h.gch` built with `flags` (built once, then reused).

  g++ looks for `<name>.gch` in each include directory before the header itself, so `-I<dir>`
  is enough. The build runs unsandboxed: its input is the system header, not model output.
  """
  if flags in _pch_dirs:
    return _pch_dirs[flags]
  key = hashlib.sha1(("|".join(flags) + _gxx_version()).encode()).hexdigest()[:12]
  root = os.path.join(tempfile.gettempdir(), "magistral_jax_pch", key)
  gch = os.path.join(root, "bits", "stdc++.h.gch")
  if not os.path.exists(gch):
    try:
      deps = subprocess.run(["g++", *flags, "-x", "c++", "-M", "-"], input="#include <bits/stdc++.h>\n",
                            capture_output=True, text=True, timeout=60).stdout
      header = next(t for t in deps.split() if t.endswith("bits/stdc++.h"))
      os.makedirs(os.path.dirname(root), exist_ok=True)
      tmp = tempfile.mkdtemp(dir=os.path.dirname(root))
      os.makedirs(os.path.join(tmp, "bits"))
      r = subprocess.run(["g++", *flags, "-x", "c++-header", header, "-o",
                          os.path.join(tmp, "bits", "stdc++.h.gch")], capture_output=True, timeout=120)
      if r.returncode != 0:
        raise RuntimeError(r.stderr.decode(errors="replace")[:500])
      os.chmod(tmp, 0o755)
      try:
        os.rename(tmp, root)      # atomic: concurrent builders keep whichever lands first
      except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    except (StopIteration, RuntimeError, OSError, subprocess.SubprocessError):
      _pch_dirs[flags] = None
      return None
  _pch_dirs[flags] = root
  return root


def compile_cpp(sandbox: Sandbox, workdir: str, source: str, timeout_s: float,
                use_pch: bool = True) -> tuple[bool, str]:
  """Compiles `source` to `workdir/prog` inside the sandbox. Returns (ok, message)."""
  _write(os.path.join(workdir, "prog.cpp"), source)
  argv = ["g++", *CXX_FLAGS]
  pch = precompiled_header_dir() if use_pch else None
  if pch:
    argv.append(f"-I{pch}")
  argv += ["prog.cpp", "-o", "prog"]
  limits = Limits(cpu_s=timeout_s, memory_mb=2048, file_size_mb=256, nproc=16, nofile=256,
                  max_output_bytes=1 << 20)
  r = sandbox.run(argv, workdir, limits, wall_s=timeout_s)
  if r.timed_out:
    return False, f"compile timed out after {timeout_s}s"
  if r.returncode != 0:
    return False, "compile error: " + r.stderr.decode(errors="replace")[:300]
  return True, ""


# ----------------------------------------------------------------------------- runners

def _run_stdin_tests(sandbox, workdir, argv, tests, limits) -> CodeResult:
  for k, t in enumerate(tests):
    r = sandbox.run(argv, workdir, limits,
                    stdin=str(t["input"]).encode("utf-8", errors="replace"))
    if r.timed_out:
      return CodeResult(False, f"test {k}: time limit", k + 1)
    if r.output_truncated:
      return CodeResult(False, f"test {k}: output limit", k + 1)
    if r.returncode != 0:
      return CodeResult(False, f"test {k}: exit code {r.returncode}: "
                        + r.stderr.decode(errors="replace")[-200:], k + 1)
    if not outputs_match(r.stdout.decode("utf-8", errors="replace"), str(t["output"])):
      return CodeResult(False, f"test {k}: wrong answer", k + 1)
  return CodeResult(True, "", len(tests))


def _run_assert_tests(sandbox, workdir, python, code, test_src, entry_point, limits) -> CodeResult:
  secret = secrets.token_hex(16)
  _write(os.path.join(workdir, "solution.py"), code)
  _write(os.path.join(workdir, "tests.py"), test_src)
  # One process runs all assertions, so the wall limit covers the whole test program. The entry
  # point goes in argv; the secret goes through stdin, read before any candidate code runs.
  r = sandbox.run([python, "-I", _harness_path(), entry_point or ""], workdir, limits,
                  stdin=(secret + "\n").encode())
  if r.timed_out:
    return CodeResult(False, "time limit", 1)
  lines = r.stdout.decode("utf-8", errors="replace").splitlines()
  if r.returncode == 0 and secret in lines:
    return CodeResult(True, "", 1)
  return CodeResult(False, f"exit code {r.returncode}, secret {'seen' if secret in lines else 'missing'}: "
                    + r.stderr.decode(errors="replace")[-300:], 1)


def check_code(task: dict, language: str | None, code: str, *, sandbox: Sandbox, num_tests: int,
               test_timeout_s: float, memory_mb: int, compile_timeout_s: float, python: str,
               group_seed: int = 0) -> CodeResult:
  """Runs the candidate `code` on the task's tests; passed only if every drawn test passes."""
  want = task_language(task)
  if language != want:
    return CodeResult(False, f"code block language {language!r} does not match task {want!r}")
  limits = Limits(cpu_s=test_timeout_s, memory_mb=memory_mb)
  workdir = sandbox.make_dir()
  try:
    if "tests" in task:
      tests = task["tests"]
      if not isinstance(tests, list) or not tests or not all(
          isinstance(t, dict) and "input" in t and "output" in t for t in tests):
        raise ValueError("task 'tests' must be a non-empty list of {input, output} objects")
      chosen = [tests[i] for i in draw_tests(len(tests), num_tests, group_seed)]
      if want == "cpp":
        ok, msg = compile_cpp(sandbox, workdir, code, compile_timeout_s)
        if not ok:
          return CodeResult(False, msg)
        argv = ["./prog"]
      else:
        _write(os.path.join(workdir, "solution.py"), code)
        argv = [python, "-I", "solution.py"]
      return _run_stdin_tests(sandbox, workdir, argv, chosen, limits)
    if want != "python":
      raise ValueError("assert tests (test_code / test_list) are Python only")
    if "test_code" in task:
      if not task.get("entry_point"):
        raise ValueError("task with 'test_code' needs 'entry_point'")
      return _run_assert_tests(sandbox, workdir, python, code, str(task["test_code"]),
                               str(task["entry_point"]), limits)
    if "test_list" in task:
      asserts = list(task["test_list"])
      if not asserts:
        raise ValueError("task 'test_list' is empty")
      chosen = [asserts[i] for i in draw_tests(len(asserts), num_tests, group_seed)]
      src = str(task.get("test_setup_code") or "") + "\n" + "\n".join(chosen) + "\n"
      return _run_assert_tests(sandbox, workdir, python, code, src, None, limits)
    raise ValueError("code task needs 'tests', 'test_code' + 'entry_point', or 'test_list'")
  finally:
    sandbox.remove_dir(workdir)


def default_python() -> str:
  """An interpreter the sandbox uid can execute (our venv may live under a private home)."""
  for p in ("/usr/bin/python3", "/usr/local/bin/python3"):
    if os.access(p, os.X_OK):
      return p
  return sys.executable
