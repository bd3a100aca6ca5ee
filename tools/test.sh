#!/usr/bin/env bash
# The test suite in two parts (tests/conftest.py SERIAL says which tests and why):
#   1. every other test on 2 pytest-xdist workers; a file's tests stay on one worker, so module
#      fixtures run once;
#   2. the wall-time-bounded and host-scanning tests, one at a time.
# Both parts always run; the suite fails if either does. Extra arguments go to both (a part
# they leave empty counts as passed).
cd "$(dirname "$0")/.."
part() {
  .venv/bin/python -m pytest -q "$@"
  local rc=$?
  [ "$rc" -eq 5 ] && rc=0   # no test selected
  return "$rc"
}
part --durations=25 -n 2 --dist loadfile -m "not serial" tests "$@"; a=$?
part --durations=10 -m serial tests "$@"; b=$?
[ "$a" -eq 0 ] && [ "$b" -eq 0 ]
