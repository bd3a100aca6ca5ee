"""Code filter: reference solutions, run in the real sandbox, vote on the tests."""
import pytest

from magistral_jax.curate import code_filter as cf

SUM_OK = "a, b = map(int, input().split())\nprint(a + b)\n"
SUM_OK2 = "import sys\nprint(sum(int(x) for x in sys.stdin.read().split()))\n"
SUM_ABS = "a, b = map(int, input().split())\nprint(abs(a) + abs(b))\n"   # wrong on negatives


def _stdin(i, tests, sols):
  return {"id": f"p{i}", "statement": "Print a+b.", "language": "en", "source": "t",
          "test_type": "stdin_stdout", "test_setup": "", "entry_point": "",
          "tests": [{"input": x, "output": y} for x, y in tests],
          "solutions": [{"language": "python", "code": c} for c in sols]}


GOOD_TESTS = [("1 2\n", "3\n"), ("5 5\n", "10\n"), ("0 0\n", "0\n"), ("7 1\n", "8")]


@pytest.fixture(scope="module")
def run_fn():
  return cf.sandbox_run_fn(timeout_s=4.0)


def test_a_wrong_expected_output_that_all_solutions_agree_on_is_fixed(run_fn):
  rec = _stdin(0, GOOD_TESTS + [("2 2\n", "5\n")], [SUM_OK, SUM_OK2])
  report = cf.CodeFilterReport()
  (out,) = cf.code_filter([rec], run_fn, cf.CodeFilterConfig(min_tests=3), report)
  assert out["tests"][:4] == rec["tests"][:4]
  assert out["tests"][4] == {"input": "2 2\n", "output": "4\n"}
  assert report.tests == {"kept": 4, "fixed": 1}


def test_tests_the_solutions_disagree_on_are_dropped(run_fn):
  rec = _stdin(1, GOOD_TESTS + [("-1 2\n", "1\n"), ("-3 -4\n", "-7\n")], [SUM_OK, SUM_ABS])
  report = cf.CodeFilterReport()
  (out,) = cf.code_filter([rec], run_fn, cf.CodeFilterConfig(min_tests=3), report)
  assert out["tests"] == rec["tests"][:4]
  assert report.tests == {"kept": 4, "disagreement": 2}


def test_problems_are_dropped_per_reason(run_fn):
  recs = [
      _stdin(2, GOOD_TESTS, []),                                           # no solutions
      _stdin(3, GOOD_TESTS[:2], [SUM_OK]),                                 # too few tests
      _stdin(4, [("-1 -1\n", "-2\n")] * 3 + GOOD_TESTS[:1], [SUM_OK, SUM_ABS]),  # 1 left
      _stdin(5, GOOD_TESTS, [SUM_OK, "import sys\nsys.exit(3)\n"]),        # a crashing solution
      _stdin(6, GOOD_TESTS, [SUM_OK]),
  ]
  report = cf.CodeFilterReport()
  kept = list(cf.code_filter(recs, run_fn, cf.CodeFilterConfig(min_tests=3), report))
  assert [r["id"] for r in kept] == ["p6"]
  assert report.to_json()["dropped"] == {"no_solutions": 1, "too_few_tests": 1,
                                         "too_few_tests_after_cleaning": 2}
  assert report.kept == 1 and report.seen == 5


def test_assert_tests_are_voted_on_by_passing(run_fn):
  rec = {"id": "a", "statement": "add", "language": "en", "source": "t", "test_type": "assert",
         "test_setup": "", "entry_point": "",
         "tests": [{"input": "assert add(1, 2) == 3", "output": ""},
                   {"input": "assert add(2, 2) == 5", "output": ""},        # wrong: nobody passes
                   {"input": "assert add(0, 0) == 0", "output": ""}],
         "solutions": [{"language": "python", "code": "def add(a, b):\n  return a + b\n"}]}
  report = cf.CodeFilterReport()
  (out,) = cf.code_filter([rec], run_fn, cf.CodeFilterConfig(min_tests=2), report)
  assert [t["input"] for t in out["tests"]] == ["assert add(1, 2) == 3", "assert add(0, 0) == 0"]
  assert report.tests == {"kept": 2, "disagreement": 1}


def test_majority_fix_needs_the_configured_agreement():
  tests = [{"input": "x", "output": "1"}]
  outputs = [["2\n"], ["2"], ["3"]]           # none pass; 2 of 3 agree
  assert cf.vote_on_tests(tests, outputs, cf.CodeFilterConfig(fix_agreement=1.0))[0] == []
  fixed, actions = cf.vote_on_tests(tests, outputs, cf.CodeFilterConfig(fix_agreement=0.6))
  assert fixed == [{"input": "x", "output": "2\n"}] and actions == {"fixed": 1}
