"""Code correctness: the FIRST fenced block of the answer, tagged or not, run against the task's
tests.

Two kinds of test:
  - stdin/stdout pairs (`tests: [{"input", "output"}]`): the output must match the expected one
    token by token, exactly; only where the task gives a `tolerance` do non-integer numbers
    match within it (`outputs_match`). Integers are always exact: a relative tolerance let a
    modular answer plus one, or 10^10 + 1,000, pass. The runs and the comparison:
    rewards/code_stdio.py; C++ is compiled first (rewards/code_cpp.py).
  - assert tests, HumanEval style (`test_code` defining `check(candidate)` + `entry_point`) or
    MBPP style (`test_list` of assert lines, optional `test_setup_code`). The test code runs in
    OUR process and calls the candidate's functions, loaded in a sandboxed process, through
    proxies that pass only plain values, so the verdict never exists where the candidate could
    reach it (rewards/code_asserts.py says how, and what the boundary puts back).
Limits are CPU seconds; a run stopped at the wall-clock backstop by a loaded host (not by its
own CPU use or idling) raises VerifierFault: no verdict, the group is dropped (rewards/reward.py).
At most `num_tests` tests are drawn with `random.Random(group_seed)`, so every completion of a
group sees the same tests. The reward is binary: all drawn tests must pass. No test's result
decides what runs next: every drawn test runs, in an order shuffled by a secret of ours, and the
verdict is formed at the end (code_guard.py), so a program cannot learn its verdict from the
sequence of tests or calls it is given.
"""
from __future__ import annotations

import os
import random
import sys

from magistral_jax.rewards import format as fmt
from magistral_jax.rewards.code_asserts import run_assert_tests
from magistral_jax.rewards.code_cpp import compile_cpp
from magistral_jax.rewards.code_result import CodeResult, write_source
from magistral_jax.rewards.humaneval import prompt_helpers
from magistral_jax.rewards.code_stdio import RUN_SOLUTION, run_stdin_tests, task_tolerance
from magistral_jax.rewards.sandbox import Sandbox
from magistral_jax.rewards.sandbox_limits import Limits
from magistral_jax.rewards.sandbox_root import interpreter_binds

LANG_ALIASES = {
  "python": "python", "py": "python", "python3": "python", "py3": "python",
  "cpp": "cpp", "c++": "cpp", "cc": "cpp", "cxx": "cpp", "c++20": "cpp", "c++17": "cpp",
}


def task_language(task: dict) -> str:
  """The language a code task's solution must be in: python or cpp (default python)."""
  language = LANG_ALIASES.get(str(task.get("language", "python")).lower())
  if language is None:
    raise ValueError(f"task language must be python or cpp, got {task.get('language')!r}")
  return language


def extract_code_block(answer: str, untagged_language: str | None = None
                       ) -> tuple[str | None, str] | None:
  """(language, code) of the FIRST fenced block of the answer, tagged or not (paper §2 grades the
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


def draw_tests(n: int, num_tests: int, group_seed: int) -> list[int]:
  """Indices of the tests to run: the same for every completion sharing `group_seed`."""
  if n <= num_tests:
    return list(range(n))
  return sorted(random.Random(group_seed).sample(range(n), num_tests))


# What a run costs beyond its backstop, generously: starting the namespaces, the judgement, the
# kill and the reaping (Sandbox.run waits up to 1 s past the backstop), a loaded host's latency.
RUN_OVERHEAD_S = 3.0


def worst_case_s(task, num_tests: int, test_timeout_s: float, compile_timeout_s: float) -> float:
  """The longest checking `task` may take in the sandbox: every run at its wall-clock backstop
  (each drawn stdin test is a run; the assert tests are one run; C++ adds its compile), plus
  RUN_OVERHEAD_S each. 0 for a task that runs no code, or one too malformed to say (its check
  fails fast). The verifier pool sets a task's deadline from this, so a slow honest program is
  never cut short by the pool."""
  try:
    if not isinstance(task, dict) or task.get("kind") != "code":
      return 0.0
    per_run = Limits(cpu_s=test_timeout_s).backstop_s + RUN_OVERHEAD_S
    if "tests" not in task:
      return per_run
    runs = min(len(task["tests"]), num_tests)
    total = runs * per_run
    if task_language(task) == "cpp":
      total += Limits(cpu_s=compile_timeout_s).backstop_s + RUN_OVERHEAD_S
    return float(total)
  except (TypeError, ValueError, KeyError):
    return 0.0


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
      tolerance = task_tolerance(task)
      if want == "cpp":
        ok, msg = compile_cpp(sandbox, workdir, code, compile_timeout_s)
        if not ok:
          return CodeResult(False, msg)
        argv, binds, src, inputs = ["./prog"], [], None, ["prog"]
      else:
        write_source(os.path.join(workdir, "solution.py"), code)
        exe, binds = interpreter_binds(python)
        argv, src, inputs = [exe], RUN_SOLUTION, ["solution.py"]
      return run_stdin_tests(sandbox, workdir, argv, chosen, limits, binds, src, inputs,
                             tolerance)
    if want != "python":
      raise ValueError("assert tests (test_code / test_list) are Python only")
    setup = str(task.get("test_setup_code") or "")
    if "test_code" in task:
      entry = task.get("entry_point")
      if not entry or not isinstance(entry, str):
        raise ValueError("task with 'test_code' needs 'entry_point'")
      # HumanEval: the helpers the prompt defines come from the prompt (when no setup is given).
      setup = setup or prompt_helpers(str(task.get("problem", "")), entry) or ""
      return run_assert_tests(sandbox, workdir, python, code, str(task["test_code"]), entry,
                              limits, setup)
    if "test_list" in task:
      asserts = list(task["test_list"])
      if not asserts:
        raise ValueError("task 'test_list' is empty")
      chosen = [asserts[i] for i in draw_tests(len(asserts), num_tests, group_seed)]
      return run_assert_tests(sandbox, workdir, python, code, "\n".join(chosen) + "\n", None,
                              limits, setup)
    raise ValueError("code task needs 'tests', 'test_code' + 'entry_point', or 'test_list'")
  finally:
    sandbox.remove_dir(workdir)


def default_python() -> str:
  """An interpreter the sandbox uid can execute (our venv may live under a private home)."""
  for p in ("/usr/bin/python3", "/usr/local/bin/python3"):
    if os.access(p, os.X_OK):
      return p
  return sys.executable
