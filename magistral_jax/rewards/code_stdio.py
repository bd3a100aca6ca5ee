"""stdin/stdout tests: one sandboxed run per test, its output compared here, in our process, to
the expected one (`outputs_match`: token by token, exact; a task's `tolerance` lets non-integer
numbers match within it). Python runs through RUN_SOLUTION; C++ is compiled first (code_cpp.py).
"""
from __future__ import annotations

import math
import random
import re
import secrets

from magistral_jax.rewards.code_result import CodeResult, VerifierFault


# A stdin/stdout Python program, run as __main__ by the interpreter that set up the sandbox (see
# Sandbox.run's python_src). An uncaught exception exits non-zero with its traceback, as usual.
RUN_SOLUTION = """
with open("solution.py", encoding="utf-8") as f:
  src = f.read()
exec(compile(src, "solution.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
"""

_INTEGER = re.compile(r"[+-]?\d+")


def _is_number(tok: str) -> float | None:
  try:
    x = float(tok)
  except ValueError:
    return None
  return x if math.isfinite(x) else None


def outputs_match(got: str, expected: str, tolerance: float | None = None) -> bool:
  """Token-by-token comparison, exact. Only where the task gives a `tolerance` (its statement's
  "absolute or relative error at most ..."), a non-integer expected number matches a number
  within it: |got - expected| <= tolerance * max(1, |expected|). An integer is always exact: a
  modular answer off by one is wrong at any size."""
  a, b = got.split(), expected.split()
  if len(a) != len(b):
    return False
  for x, y in zip(a, b):
    if x == y:
      continue
    if tolerance is None or _INTEGER.fullmatch(y):
      return False
    fx, fy = _is_number(x), _is_number(y)
    if fx is None or fy is None or abs(fx - fy) > tolerance * max(1.0, abs(fy)):
      return False
  return True


def task_tolerance(task: dict) -> float | None:
  """The task's numeric tolerance for stdin/stdout answers (None: exact)."""
  tol = task.get("tolerance")
  if tol is None:
    return None
  if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not 0 <= tol < 1:
    raise ValueError(f"task 'tolerance' must be a number in [0, 1), got {tol!r}")
  return float(tol)


def run_stdin_tests(sandbox, workdir, argv, tests, limits, ro_binds=(), python_src=None,
                    inputs=None, tolerance=None, order_seed: int | None = None) -> CodeResult:
  """One run per test; the output is compared here, in our process, to the expected one.

  No verdict oracle (as for assert tests, code_guard.py): a wrong answer does not stop the
  check, so which tests run, and how many, never depends on whether an answer was right (a
  program that counts its runs through some channel between them learns nothing); they run in
  an order shuffled by `order_seed` (None: a fresh secret of ours). The check stops early only
  where the program's own conduct decided it (a time limit, the output cap, a non-zero exit):
  that tells it nothing it did not know. A verifier fault ends the check with no verdict, unless
  a wrong answer has already decided it."""
  order = list(range(len(tests)))
  random.Random(secrets.randbits(64) if order_seed is None else order_seed).shuffle(order)
  wrong = None
  for ran, k in enumerate(order, 1):
    t = tests[k]
    r = sandbox.run(argv, workdir, limits, ro_binds=ro_binds, python_src=python_src,
                    stdin=str(t["input"]).encode("utf-8", errors="replace"), inputs=inputs)
    if r.fault:
      if wrong is not None:
        wrong.tests_run = ran
        return wrong
      raise VerifierFault(f"test {k}: {r.fault}")
    if r.timed_out:
      return CodeResult(False, f"test {k}: time limit", ran)
    if r.output_truncated:
      return CodeResult(False, f"test {k}: output limit", ran)
    if r.returncode != 0:
      return CodeResult(False, f"test {k}: exit code {r.returncode}: "
                        + r.stderr.decode(errors="replace")[-200:], ran)
    if wrong is None and not outputs_match(r.stdout.decode("utf-8", errors="replace"),
                                           str(t["output"]), tolerance):
      wrong = CodeResult(False, f"test {k}: wrong answer")
  if wrong is not None:
    wrong.tests_run = len(tests)
  return wrong or CodeResult(True, "", len(tests))
