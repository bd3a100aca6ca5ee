"""The tiny task's synthetic arithmetic and its cold-start traces (with and without slips)."""
import itertools
import re

import pytest

from magistral_jax.data import synthetic
from magistral_jax.rewards.format import check_format
from magistral_jax.rewards.math_check import last_boxed_answer, math_equal

TINY = dict(min_steps=1, max_steps=3, max_operand=9, allow_negative=False)
STEP = re.compile(r"^(-?\d+)([+-])(\d+)=(-?\d+)$")


def _steps(trace):
  body = trace.split("<think>\n")[1].split("\n</think>")[0]
  return [STEP.match(line).groups() for line in body.split("\n")]


def test_problems_are_correct_and_never_negative():
  for p in synthetic.take(500, seed=3, **TINY):
    assert eval(p["problem"][len("Compute "):-1]) == int(p["answer"])
    t = synthetic.trace(p)
    assert check_format(t, "math").ok
    assert math_equal(last_boxed_answer(t.split("</think>")[1]), p["answer"])
    for a, op, x, new in _steps(t):
      assert int(new) == (int(a) + int(x) if op == "+" else int(a) - int(x))
      assert int(new) >= 0 and int(x) <= 9


def test_sft_pairs_without_slips_are_the_plain_traces():
  plain = [(p["problem"], synthetic.trace(p))
           for p in itertools.islice(synthetic.problems(0, "sft", **TINY), 300)]
  assert list(itertools.islice(synthetic.sft_pairs(0, 0.0, **TINY), 300)) == plain


def test_slipped_traces_make_exactly_one_slip_and_follow_it():
  n, rate = 2000, 0.3
  pairs = list(itertools.islice(synthetic.sft_pairs(0, rate, **TINY), n))
  # The problems are the same stream as without slips: only traces change.
  assert [q for q, _ in pairs] == [q for q, _ in itertools.islice(synthetic.sft_pairs(0, 0.0, **TINY), n)]
  assert pairs == list(itertools.islice(synthetic.sft_pairs(0, rate, **TINY), n))  # seeded
  slipped = 0
  for problem, t in pairs:
    steps = _steps(t)
    wrong = [int(new) != (int(a) + int(x) if op == "+" else int(a) - int(x))
             for a, op, x, new in steps]
    for (_, _, _, prev), (a, _, _, _) in zip(steps, steps[1:]):
      assert a == prev   # each step starts from the previous step's (possibly wrong) result
    boxed = last_boxed_answer(t.split("</think>")[1])
    assert boxed == steps[-1][3]
    reference = str(eval(problem[len("Compute "):-1]))
    assert sum(wrong) <= 1
    if any(wrong):
      slipped += 1
      i = wrong.index(True)
      a, op, x, new = steps[i]
      assert abs(int(new) - (int(a) + int(x) if op == "+" else int(a) - int(x))) == 1
      assert not math_equal(boxed, reference)   # the real verifier scores it wrong
    else:
      assert boxed == reference
    assert check_format(t, "math").ok
  assert abs(slipped / n - rate) < 0.04, slipped / n


def test_slip_rate_out_of_range_is_rejected():
  with pytest.raises(ValueError, match="sft_slip_rate"):
    next(synthetic.sft_pairs(0, 1.5, **TINY))


def test_rambling_traces_never_close_and_keep_the_problem_stream():
  n, rate = 1000, 0.25
  pairs = list(itertools.islice(synthetic.sft_pairs(0, 0.4, rate, **TINY), n))
  assert [q for q, _ in pairs] == [q for q, _ in itertools.islice(synthetic.sft_pairs(0, 0.0, **TINY), n)]
  rambles = [t for _, t in pairs if "</think>" not in t]
  assert abs(len(rambles) / n - rate) < 0.04, len(rambles) / n
  for t in rambles:   # longer than any cold-start row; never meets the format
    assert t.startswith("<think>\n") and len(t) >= synthetic.RAMBLE_CHARS and "\\boxed" not in t
    assert not check_format(t, "math").ok
  with pytest.raises(ValueError, match="sft_ramble_rate"):
    next(synthetic.sft_pairs(0, 0.0, -0.1, **TINY))


def test_evaluation_set_names_give_a_difficulty():
  from magistral_jax.data.synthetic import set_options
  assert set_options("synthetic/99/2-3") == {"max_operand": 99, "min_steps": 2, "max_steps": 3}
  assert set_options("synthetic/20/2") == {"max_operand": 20, "min_steps": 2, "max_steps": 2}
  assert set_options("synthetic") is None and set_options("gsm8k_test") is None
  for bad in ("synthetic/x/2", "synthetic/20", "synthetic/20/3-1", "synthetic/0/1"):
    with pytest.raises(ValueError, match="evaluation set"):
      set_options(bad)
