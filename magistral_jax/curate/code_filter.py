"""The paper's code-problem filter (paper §3): reference solutions vote on the tests.

Per problem:
  1. drop it if it has no reference solution (`no_solutions`) or fewer than `min_tests` tests
     (`too_few_tests`);
  2. run every reference solution on every test;
  3. per test: all solutions pass -> keep; no solution passes but (at least `fix_agreement` of)
     the solutions agree on one output -> the test is wrong: set its expected output to that
     output (`fixed`); otherwise the solutions disagree -> drop the test (`disagreement`);
  4. drop the problem if fewer than `min_tests` tests are left (`too_few_tests_after_cleaning`).
Generating tests where too few remain needs a model and is not done here.

Running is injected: run_fn(record, solution, tests) -> one output per test: the program's
stdout for stdin/stdout tests, "" for a passing assert test, None for a crash, a timeout or a
failed assert. `sandbox_run_fn()` is the real runner (the rewards' sandbox: namespaces, rlimits,
C++20 compiled once per solution). A failed run never passes and never votes.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import os
from typing import Callable, Iterable, Mapping, Sequence

from magistral_jax.data.format_filter import DropReport

log = logging.getLogger(__name__)

RunFn = Callable[[Mapping, Mapping, Sequence[Mapping]], Sequence]


@dataclasses.dataclass(frozen=True)
class CodeFilterConfig:
  min_tests: int = 5             # "too few tests": NOT STATED in the paper
  min_solutions: int = 1
  fix_agreement: float = 1.0     # fraction of solutions that must agree to rewrite a test


def _canon(out: str) -> str:
  return " ".join(out.split())


def _matches(got, expected: str) -> bool:
  from magistral_jax.rewards.code_stdio import outputs_match   # the reward's own comparison
  return got is not None and outputs_match(got, expected)


def vote_on_tests(tests: Sequence[Mapping], outputs: Sequence[Sequence], config: CodeFilterConfig):
  """(cleaned tests, Counter of per-test actions) from outputs[solution][test]."""
  kept, actions = [], collections.Counter()
  n_sol = len(outputs)
  for j, t in enumerate(tests):
    outs = [o[j] for o in outputs]
    passes = sum(_matches(o, t["output"]) for o in outs)
    if passes == n_sol:
      kept.append(dict(t))
      actions["kept"] += 1
      continue
    if passes == 0:
      votes = collections.Counter(_canon(o) for o in outs if o is not None)
      if votes:
        top, n = votes.most_common(1)[0]
        if n >= config.fix_agreement * n_sol:
          # The raw output of a solution that produced the winning form keeps its line breaks.
          raw = next(o for o in outs if o is not None and _canon(o) == top)
          kept.append({"input": t["input"], "output": raw})
          actions["fixed"] += 1
          continue
    actions["disagreement"] += 1
  return kept, actions


@dataclasses.dataclass
class CodeFilterReport(DropReport):
  tests: collections.Counter = dataclasses.field(default_factory=collections.Counter)

  def to_json(self) -> dict:
    return {**super().to_json(), "tests": dict(self.tests)}


def code_filter(recs: Iterable[Mapping], run_fn: RunFn, config: CodeFilterConfig = CodeFilterConfig(),
                report: CodeFilterReport | None = None):
  """Yields cleaned code records (see the module docstring); counts everything in `report`."""
  report = report if report is not None else CodeFilterReport()
  for rec in recs:
    report.seen += 1
    sols, tests = rec["solutions"], rec["tests"]
    if len(sols) < config.min_solutions:
      report.drop(rec["id"], "no_solutions")
      continue
    if len(tests) < config.min_tests:
      report.drop(rec["id"], "too_few_tests")
      continue
    outputs = []
    for s in sols:
      outs = list(run_fn(rec, s, tests))
      if len(outs) != len(tests):
        raise ValueError(f"run_fn returned {len(outs)} outputs for {len(tests)} tests ({rec['id']})")
      outputs.append(outs)
    cleaned, actions = vote_on_tests(tests, outputs, config)
    report.tests.update(actions)
    if len(cleaned) < config.min_tests:
      report.drop(rec["id"], "too_few_tests_after_cleaning")
      continue
    report.kept += 1
    yield {**rec, "tests": cleaned}


# ---- the real runner -------------------------------------------------------------------------
def sandbox_run_fn(*, timeout_s: float = 4.0, memory_mb: int = 300, compile_timeout_s: float = 10.0,
                   python: str | None = None) -> RunFn:
  """Runs solutions in the rewards' sandbox with the reward's limits (4 s, 300 MB per test)."""
  from magistral_jax.rewards import code_check
  from magistral_jax.rewards.code_cpp import compile_cpp
  from magistral_jax.rewards.sandbox import default_sandbox
  from magistral_jax.rewards.sandbox_limits import Limits
  limits = Limits(cpu_s=timeout_s, memory_mb=memory_mb)
  py = python or code_check.default_python()

  def run(rec, solution, tests):
    sbx = default_sandbox()
    lang = code_check.LANG_ALIASES.get(str(solution["language"]).lower())
    if rec["test_type"] == "assert":
      if lang != "python":
        return [None] * len(tests)
      out = []
      for t in tests:
        task = {"kind": "code", "language": "python", "test_list": [t["input"]],
                "test_setup_code": rec.get("test_setup", "")}
        res = code_check.check_code(task, "python", solution["code"], sandbox=sbx, num_tests=1,
                                    test_timeout_s=timeout_s, memory_mb=memory_mb,
                                    compile_timeout_s=compile_timeout_s, python=py)
        out.append("" if res.passed else None)
      return out
    workdir = sbx.make_dir()
    try:
      if lang == "cpp":
        ok, msg = compile_cpp(sbx, workdir, solution["code"], compile_timeout_s)
        if not ok:
          log.info("%s: reference solution does not compile: %s", rec["id"], msg)
          return [None] * len(tests)
        argv = ["./prog"]
      elif lang == "python":
        with open(os.path.join(workdir, "solution.py"), "w", encoding="utf-8") as f:
          f.write(solution["code"])
        os.chmod(os.path.join(workdir, "solution.py"), 0o644)
        argv = [py, "-I", "solution.py"]
      else:
        return [None] * len(tests)
      out = []
      for t in tests:
        r = sbx.run(argv, workdir, limits, stdin=t["input"].encode("utf-8"))
        ok = r.returncode == 0 and not r.timed_out and not r.output_truncated
        out.append(r.stdout.decode("utf-8", errors="replace") if ok else None)
      return out
    finally:
      sbx.remove_dir(workdir)
  return run
