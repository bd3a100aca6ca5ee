"""The paired bootstrap's interval against the exact one of small cases, its coverage, and the
pairing of two evaluations' rows by problem id."""
import itertools

import numpy as np
import pytest

from magistral_jax.eval.paired import compare_evals, paired_bootstrap, pass1_by_id


def test_interval_matches_the_exact_bootstrap_distribution():
  # 4 problems: every one of the 4^4 resamples enumerated gives the exact distribution of the
  # resampled mean difference; the Monte-Carlo quantiles must sit near its quantiles.
  before, after = [0.0, 0.25, 0.5, 1.0], [0.5, 0.25, 1.0, 0.75]
  d = np.subtract(after, before)
  exact = np.sort([d[list(i)].mean() for i in itertools.product(range(4), repeat=4)])
  got = paired_bootstrap(before, after, n_boot=200_000, seed=1)
  assert got["gain"] == pytest.approx(d.mean())
  assert got["ci_low"] == pytest.approx(np.quantile(exact, 0.025), abs=0.02)
  assert got["ci_high"] == pytest.approx(np.quantile(exact, 0.975), abs=0.02)
  assert got["before"] == pytest.approx(np.mean(before))
  assert got["after"] == pytest.approx(np.mean(after))


def test_no_change_gives_an_interval_around_zero_and_a_real_gain_excludes_it():
  rng = np.random.default_rng(0)
  p = rng.uniform(0.1, 0.9, size=256)           # problem difficulties
  before = rng.binomial(4, p) / 4
  same = rng.binomial(4, p) / 4                  # a second draw of the same model
  better = rng.binomial(4, np.minimum(p + 0.15, 1.0)) / 4
  flat = paired_bootstrap(before, same, seed=0)
  assert flat["ci_low"] < 0.0 < flat["ci_high"]
  up = paired_bootstrap(before, better, seed=0)
  assert up["ci_low"] > 0.0 and up["p_le_0"] < 0.025


def test_coverage_is_near_the_nominal_level():
  # 200 repeated experiments with a true gain of 0.1: the 95 % interval should hold it in about
  # 95 % of them (the percentile bootstrap runs a little short at n=64; 88 % is the floor).
  rng = np.random.default_rng(3)
  hits = 0
  for t in range(200):
    p = rng.uniform(0.2, 0.7, size=64)
    b = rng.binomial(8, p) / 8
    a = rng.binomial(8, p + 0.1) / 8
    r = paired_bootstrap(b, a, n_boot=2000, seed=t)
    hits += r["ci_low"] <= 0.1 <= r["ci_high"]
  assert hits / 200 >= 0.88


def test_bad_input_is_refused():
  with pytest.raises(ValueError, match="equal-length"):
    paired_bootstrap([0.1, 0.2], [0.3])
  with pytest.raises(ValueError, match="equal-length"):
    paired_bootstrap([], [])
  with pytest.raises(ValueError, match="level"):
    paired_bootstrap([0.1], [0.2], level=1.5)


def test_compare_evals_pairs_rows_by_id_and_refuses_different_sets():
  before = [{"id": "a", "n": 4, "correct": 1}, {"id": "b", "n": 4, "correct": 0}]
  after = [{"id": "b", "n": 4, "correct": 2}, {"id": "a", "n": 4, "correct": 3}]
  assert pass1_by_id(before) == {"a": 0.25, "b": 0.0}
  r = compare_evals(before, after, n_boot=1000)
  assert r["gain"] == pytest.approx(((0.75 - 0.25) + (0.5 - 0.0)) / 2)
  with pytest.raises(ValueError, match="different problems"):
    compare_evals(before, [{"id": "c", "n": 4, "correct": 1}, after[0]])
