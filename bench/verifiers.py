"""Benchmark: the verifier pool and the sandbox against their bare baselines: (a) VerifierPool(N)
against direct math-verify calls, math_pool_overhead; (b) sandboxed HumanEval programs against
bare subprocess.run, python_sandbox_over_bare; (c) C++ compiles with and without the PCH.

  python bench/verifiers.py [--workers=2] [--math_items=400] [--code_items=100]

Last line: one JSON object.
"""
import json
import os
import random
import shutil
import statistics
import subprocess
import tempfile
import time

import common

from magistral_jax.rewards.config import RewardConfig
from magistral_jax.rewards import code_check, code_cpp, math_check, sandbox
from magistral_jax.rewards.code_asserts import run_assert_tests
from magistral_jax.rewards.sandbox_limits import Limits
from magistral_jax.verify.pool import VerifierPool

SOURCES = os.path.join(common.ROOT, "magistral_jax", "data", "sources")


def _jsonl(name):
  with open(os.path.join(SOURCES, name)) as f:
    return [json.loads(l) for l in f]


def math_items(n):
  """(gold, predicted) pairs: each MATH-500 answer as given and in an equivalent format."""
  items = []
  for row in _jsonl("math500.jsonl"):
    g = row["answer"]
    variants = [g, g.replace("\\dfrac", "\\frac").replace("\\left", "").replace("\\right", ""),
                "\\text{ }" + g if not g.startswith("\\text") else g, " " + g + " "]
    items += [(g, v) for v in variants]
  random.Random(0).shuffle(items)
  return items[:n]


def bench_math(n_workers, n):
  items = math_items(n)
  cfg = RewardConfig(language_bonus=0.0)
  # Direct: math-verify in this process's main thread (its SIGALRM timeout works here too).
  def direct(p, g):
    try:
      return math_check.math_equal(p, g)
    except ValueError:     # unparsable reference: the pool reports it as an error, reward 0
      return False

  direct("1", "1")
  t, direct_ok = common.time_once(lambda: sum(direct(p, g) for g, p in items), block=False)
  direct_rate = len(items) / t
  math_check.parse_reference.cache_clear()
  with VerifierPool(n_workers, cfg, task_timeout_s=60, max_queue=4 * n_workers) as pool:
    task = lambda g: {"kind": "math", "problem": "p", "answer": g}
    resp = lambda p: "<think>\nworking\n</think>\nSo \\boxed{" + p + "}"
    for f in [pool.submit(task("1"), resp("1")) for _ in range(2 * n_workers)]:   # warm, ready
      f.result()
    t, res = common.time_once(lambda: [f.result() for f in [pool.submit(task(g), resp(p))
                                                            for g, p in items]], block=False)
    pool_rate = len(items) / t
    m = pool.metrics()
  pool_ok = sum(r.parts["correct"] > 0 for r in res)
  return dict(math_items=len(items), math_direct_per_s=direct_rate, math_pool_per_s=pool_rate,
              math_pool_per_worker_per_s=pool_rate / n_workers,
              math_pool_overhead=1.0 - (pool_rate / n_workers) / direct_rate,
              math_accepted_direct=direct_ok, math_accepted_pool=pool_ok,
              math_pool_latency_p95_s=m["latency_p95_s"])


def bench_python(n):
  progs = [(r["prompt"] + r["canonical_solution"], r["test"], r["entry_point"])
           for r in random.Random(0).sample(_jsonl("humaneval_full.jsonl"), n)]
  python = code_check.default_python()
  sbx = sandbox.default_sandbox()
  limits = Limits(cpu_s=4.0, memory_mb=300)
  d = tempfile.mkdtemp()
  bare_s = sbx_s = 0.0
  bare_ok = sbx_ok = 0
  # Interleaved (bare, sandboxed) per program, so load from other processes hits both alike.
  for i, (code, test, entry) in enumerate(progs):
    path = os.path.join(d, f"p{i}.py")   # bare: the same program in a file, run by subprocess.run
    with open(path, "w") as f:
      f.write(f"{code}\n{test}\ncheck({entry})\nprint('ok')\n")
    t = time.perf_counter()
    bare_ok += b"ok" in subprocess.run([python, "-I", path], capture_output=True, timeout=10).stdout
    bare_s += time.perf_counter() - t
    # Sandboxed: fresh dir, private root, the JSON call driver, namespaces, uid, rlimits (what a
    # pool worker does).
    t = time.perf_counter()
    w = sbx.make_dir()
    try:
      sbx_ok += run_assert_tests(sbx, w, python, code, test, entry, limits).passed
    finally:
      sbx.remove_dir(w)
    sbx_s += time.perf_counter() - t
  shutil.rmtree(d)
  bare_rate, sbx_rate = n / bare_s, n / sbx_s
  return dict(python_programs=n, python_bare_per_s=bare_rate, python_sandbox_per_s=sbx_rate,
              python_sandbox_over_bare=sbx_rate / bare_rate, python_bare_passed=bare_ok,
              python_sandbox_passed=sbx_ok, sandbox_isolation=sbx.isolation)


CPP = """#include <bits/stdc++.h>
using namespace std;
int main() { int n; cin >> n; vector<long long> a(n); for (auto &x : a) cin >> x;
  sort(a.begin(), a.end()); map<long long, int> c; for (auto x : a) c[x]++;
  cout << a.back() << " " << c.size() << endl; }
"""


def bench_cpp(repeats):
  sbx = sandbox.default_sandbox()
  code_cpp._pch_dirs.clear()
  pch_ready_s, pch = common.time_once(code_cpp.precompiled_header_dir, block=False)
  out = {"cpp_pch_ready_s": pch_ready_s, "cpp_pch_available": pch is not None}
  for name, use in (("pch", True), ("no_pch", False)):
    times = []
    for _ in range(repeats):   # the compile alone, each in a fresh sandbox dir
      w = sbx.make_dir()
      t, (ok, msg) = common.time_once(
          lambda: code_cpp.compile_cpp(sbx, w, CPP, timeout_s=60, use_pch=use), block=False)
      times.append(t)
      sbx.remove_dir(w)
      assert ok, msg
    out[f"cpp_compile_s_{name}"] = statistics.median(times)   # common.Timing's statistic
  return out


def main():
  args = common.argument_parser(
      __doc__, workers=(max(1, (os.cpu_count() or 2) - 1), "the math pool's size"),
      math_items=(400, "answers verified"), code_items=(100, "HumanEval programs run"),
      cpp_repeats=(3, "compiles each way")).parse_args()
  res = dict(bench="verifiers", workers=args.workers, cpus=os.cpu_count())
  res.update(bench_math(args.workers, args.math_items))
  print("math", {k: v for k, v in res.items() if k.startswith("math")}, flush=True)
  res.update(bench_python(args.code_items))
  print("python", {k: v for k, v in res.items() if k.startswith("python")}, flush=True)
  res.update(bench_cpp(args.cpp_repeats))
  common.emit(res, ndigits=4)


if __name__ == "__main__":
  main()
