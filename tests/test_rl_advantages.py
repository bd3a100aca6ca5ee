"""Group-relative advantages, zero-advantage filtering and the three normalisation modes."""
import numpy as np
import pytest

from magistral_jax.rl import advantages as A


def test_advantage_is_reward_minus_group_mean_without_std_division():
  r = np.array([1.0, 0.0, 0.0, 0.0, 0.1, 0.1, 1.1, 1.1])
  g = np.array([7, 7, 7, 7, 3, 3, 3, 3])
  adv = A.group_advantages(r, g)
  np.testing.assert_allclose(adv[:4], [0.75, -0.25, -0.25, -0.25])
  np.testing.assert_allclose(adv[4:], [-0.5, -0.5, 0.5, 0.5])


def test_minibatch_normalisation_uses_statistics_over_sequences():
  rng = np.random.default_rng(0)
  r = rng.random(12)
  g = np.repeat(np.arange(3), 4)
  adv = A.group_advantages(r, g)
  out = A.normalize_advantages(adv, g, "minibatch", eps=0.0)
  np.testing.assert_allclose(out, (adv - adv.mean()) / adv.std())
  np.testing.assert_allclose([out.mean(), out.std()], [0.0, 1.0], atol=1e-12)


def test_group_normalisation_divides_by_group_std():
  r = np.array([1.0, 0.0, 0.5, 0.5, 0.2, 0.0])
  g = np.array([0, 0, 1, 1, 2, 2])
  adv = A.group_advantages(r, g)
  out = A.normalize_advantages(adv, g, "group", eps=0.0 + 1e-12)
  np.testing.assert_allclose(out[[0, 1, 4, 5]], [1, -1, 1, -1], atol=1e-9)
  np.testing.assert_array_equal(out[[2, 3]], [0, 0])   # zero std: stays zero, no NaN
  np.testing.assert_array_equal(A.normalize_advantages(adv, g, "none"), adv)


def test_zero_advantage_groups_are_dropped_with_counts():
  r = np.array([1.1, 1.1, 0.0, 0.0, 1.1, 0.1])
  g = np.array([0, 0, 1, 1, 2, 2])
  keep, stats = A.filter_groups(r, g)
  np.testing.assert_array_equal(keep, [False, False, False, False, True, True])
  assert stats["groups"] == 3 and stats["groups_zero_advantage"] == 2
  assert stats["groups_dropped"] == 2 and stats["completions_dropped"] == 4


def test_length_penalty_only_groups_follow_the_config_choice():
  # Group 0: both correct, one pays a small overlong penalty. Group 1: a real correctness split.
  lp = np.array([0.0, -0.03, 0.0, -0.1])
  r = np.array([1.1, 1.1, 0.1, 1.1]) + lp
  g = np.array([0, 0, 1, 1])
  keep, stats = A.filter_groups(r, g, lp, "keep")
  assert keep.all() and stats["groups_length_only"] == 1 and stats["groups_dropped"] == 0
  keep, stats = A.filter_groups(r, g, lp, "drop")
  np.testing.assert_array_equal(keep, [False, False, True, True])
  assert stats["groups_dropped"] == 1


def test_bad_rewards_raise_clear_errors():
  with pytest.raises(ValueError, match="non-finite rewards at completion indices \\[1\\]"):
    A.group_advantages([0.0, np.nan], [0, 0])
  with pytest.raises(ValueError, match="shape"):
    A.group_advantages([0.0, 1.0], [0, 0, 1])
  with pytest.raises(ValueError, match="adv_norm"):
    A.normalize_advantages([0.0], [0], "batch")
