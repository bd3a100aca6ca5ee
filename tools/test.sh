#!/usr/bin/env bash
# The test suite in two parts (tests/conftest.py says which tests go where, and why):
#   1. the tests not marked serial, on 2 pytest-xdist workers; a file's tests stay on one worker,
#      so module fixtures run once; the files with long tests go first (tests/conftest.py,
#      _LongestFilesFirst), so that no long file is left for one worker at the end;
#      a worker that crashes (pytest-timeout ends a hung test by ending its worker) ends part 1 at
#      once with the test named (--max-worker-restart=0): xdist's loadfile scheduler can deadlock
#      when it replaces a crashed worker (pytest-xdist #784, #1378), which once spent CI's whole
#      time limit;
#   2. the serial ones (compute-bound end-to-end runs, wall-time-bounded and host-scanning
#      tests), one at a time;
#   3. the tests marked own_process, in a pytest process of their own (tests/conftest.py says
#      why).
# Two tiers: `make test` (CI's, tools/test.sh) leaves out the tests marked `long`, the end-to-end
# learning proofs whose figures BENCHMARKS.md records from their benches; `make test-full`
# (MAGISTRAL_TEST_FULL=1) runs them too, in part 2 beside the serial tests.
# The parts share one XLA compilation cache (unless MAGISTRAL_TEST_XLA_CACHE is set: a directory
# to keep, or 0 for none), removed at the end. Every part runs; the suite fails if any does.
# Extra arguments go to all three (a part they leave empty counts as passed).
cd "$(dirname "$0")/.."
if [ -z "${MAGISTRAL_TEST_XLA_CACHE:-}" ]; then
  MAGISTRAL_TEST_XLA_CACHE=$(mktemp -d "${TMPDIR:-/tmp}/magistral_jax_xla_cache_XXXXXXXX")
  trap 'rm -rf "$MAGISTRAL_TEST_XLA_CACHE"' EXIT
fi
export MAGISTRAL_TEST_XLA_CACHE
part() {
  .venv/bin/python -m pytest -q "$@"
  local rc=$?
  [ "$rc" -eq 5 ] && rc=0   # no test selected
  return "$rc"
}
second="serial and not long"
[ "${MAGISTRAL_TEST_FULL:-0}" = 1 ] && second="serial or long"
start=$(date +%s)
part --durations=25 -n 2 --dist loadfile --no-loadscope-reorder --max-worker-restart=0 \
  -m "not serial and not long and not own_process" tests "$@"; a=$?
part --durations=25 -m "($second) and not own_process" tests "$@"; b=$?
part -m "own_process" tests "$@"; c=$?
echo "tools/test.sh: part 1 exit $a, part 2 exit $b, part 3 exit $c," \
  "$(( $(date +%s) - start )) s in all"
[ "$a" -eq 0 ] && [ "$b" -eq 0 ] && [ "$c" -eq 0 ]
