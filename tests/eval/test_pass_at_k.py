"""The unbiased pass@k estimator against brute force: the share of k-subsets of the n samples
that hold a correct one, enumerated exactly for every n <= 8, c and k."""
import itertools
import math
from fractions import Fraction

import pytest

from magistral_jax.eval.pass_at_k import curve_ks, format_curves, pass_at_k, pass_at_k_curve


def _brute_force(n, c, k):
  samples = [True] * c + [False] * (n - c)
  subsets = list(itertools.combinations(samples, k))
  return Fraction(sum(any(s) for s in subsets), len(subsets))


def test_estimator_equals_the_share_of_k_subsets_with_a_correct_sample():
  for n in range(1, 9):
    for c in range(n + 1):
      for k in range(1, n + 1):
        assert pass_at_k(n, c, k) == pytest.approx(float(_brute_force(n, c, k)), abs=1e-12), \
            (n, c, k)


def test_edge_cases():
  for n in (1, 5, 16, 64):
    assert pass_at_k(n, 0, 1) == 0.0 and pass_at_k(n, 0, n) == 0.0       # never right
    assert pass_at_k(n, n, 1) == 1.0 and pass_at_k(n, n, n) == 1.0       # always right
    assert pass_at_k(n, 1, n) == 1.0                                     # k = n: any correct one
    for c in range(n + 1):
      assert pass_at_k(n, c, 1) == pytest.approx(c / n)                  # pass@1 is c / n
  for bad in ((4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)):
    with pytest.raises(ValueError):
      pass_at_k(*bad)


def test_large_n_stays_finite_and_matches_exact_binomials():
  # C(2000, 1000) is past a float's range; the product form never builds it.
  n, c, k = 2000, 3, 1000
  exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
  assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-12)


def test_curve_ks_are_powers_of_two_then_n():
  assert curve_ks(1) == [1]
  assert curve_ks(4) == [1, 2, 4]
  assert curve_ks(6) == [1, 2, 4, 6]
  assert curve_ks(16) == [1, 2, 4, 8, 16]
  assert curve_ks(0) == []


def test_curve_averages_over_problems():
  counts = [(4, 0), (4, 1), (4, 4)]
  curve = pass_at_k_curve(counts)
  assert list(curve) == [1, 2, 4]
  assert curve[1] == pytest.approx((0 + 0.25 + 1) / 3)
  assert curve[2] == pytest.approx((0 + 0.5 + 1) / 3)
  assert curve[4] == pytest.approx((0 + 1 + 1) / 3)
  # Up to the fewest samples a problem has.
  assert list(pass_at_k_curve([(4, 1), (3, 1)])) == [1, 2, 3]
  assert pass_at_k_curve([]) == {}


def test_curve_table_has_a_column_per_k_and_the_headroom():
  results = {"gsm8k_test": {"pass_at": {1: 0.25, 2: 0.4, 4: 0.5}, "headroom": 0.25},
             "math500": {"pass_at": {"1": 0.1, "2": 0.15}, "headroom": 0.05}}   # as from JSON
  lines = format_curves(results).splitlines()
  assert lines[0].split() == ["set", "pass@1", "pass@2", "pass@4", "headroom"]
  assert lines[2].split() == ["gsm8k_test", "0.250", "0.400", "0.500", "0.250"]
  assert lines[3].split() == ["math500", "0.100", "0.150", "-", "0.050"]
