"""A group's advantages and drop decision (scored once, when the group completes), and the three
minibatch normalisation modes."""
import numpy as np
import pytest

from magistral_jax.rewards.reward import RewardResult, failed_result
from magistral_jax.rl import advantages as A
from magistral_jax.rl.collate import Completion
from magistral_jax.rl.config import GRPOConfig
from magistral_jax.rl.minibatch import normalize_advantages


def test_advantage_is_reward_minus_group_mean_without_std_division():
  np.testing.assert_allclose(A.group_advantages([1.0, 0.0, 0.0, 0.0]), [0.75, -0.25, -0.25, -0.25])
  np.testing.assert_allclose(A.group_advantages([0.1, 0.1, 1.1, 1.1]), [-0.5, -0.5, 0.5, 0.5])


def test_minibatch_normalisation_uses_statistics_over_sequences():
  rng = np.random.default_rng(0)
  r = rng.random((3, 4))
  adv = np.concatenate([A.group_advantages(row) for row in r])
  g = np.repeat(np.arange(3), 4)
  out = normalize_advantages(adv, g, "minibatch", eps=0.0)
  np.testing.assert_allclose(out, (adv - adv.mean()) / adv.std())
  np.testing.assert_allclose([out.mean(), out.std()], [0.0, 1.0], atol=1e-12)


def test_group_normalisation_divides_by_group_std():
  r = [[1.0, 0.0], [0.5, 0.5], [0.2, 0.0]]
  adv = np.concatenate([A.group_advantages(row) for row in r])
  g = np.array([0, 0, 1, 1, 2, 2])
  out = normalize_advantages(adv, g, "group", eps=0.0 + 1e-12)
  np.testing.assert_allclose(out[[0, 1, 4, 5]], [1, -1, 1, -1], atol=1e-9)
  np.testing.assert_array_equal(out[[2, 3]], [0, 0])   # zero std: stays zero, no NaN
  np.testing.assert_array_equal(normalize_advantages(adv, g, "none"), adv)


def test_zero_advantage_groups_are_dropped():
  assert A.drop_reason([1.1, 1.1]) == A.ZERO_ADVANTAGE
  assert A.drop_reason([0.0, 0.0]) == A.ZERO_ADVANTAGE
  assert A.drop_reason([1.1, 0.1]) is None


def test_length_penalty_only_groups_follow_the_config_choice():
  # Both correct, one pays a small overlong penalty: the rewards differ only through it.
  lp = np.array([0.0, -0.03])
  r = np.array([1.1, 1.1]) + lp
  assert A.drop_reason(r, lp, "keep") is None
  assert A.drop_reason(r, lp, "drop") == A.LENGTH_ONLY
  # A real correctness split is kept either way.
  assert A.drop_reason(np.array([0.1, 1.1]) + [0.0, -0.1], [0.0, -0.1], "drop") is None


def _result(reward, length_penalty=0.0):
  return RewardResult(reward, {"format": 0.1, "correct": 0.9 if reward > 0.5 else 0.0,
                               "language": 0.0, "length_penalty": length_penalty})


def test_score_group_puts_the_group_centred_advantage_on_each_completion():
  comps = [Completion([1], [2, 3], [-0.1, -0.2]) for _ in range(4)]
  g = A.score_group(7, comps, [_result(r) for r in (1.0, 0.0, 0.0, 0.0)], GRPOConfig())
  assert g.group_id == 7 and g.dropped is None
  assert [c.group_id for c in g.completions] == [7] * 4
  np.testing.assert_allclose([c.advantage for c in g.completions], [0.75, -0.25, -0.25, -0.25])
  np.testing.assert_array_equal(g.rewards, [1.0, 0.0, 0.0, 0.0])
  assert comps[0].advantage == 0.0   # the inputs are not modified
  same = A.score_group(8, comps[:2], [_result(0.1), _result(0.1)], GRPOConfig())
  assert same.dropped == A.ZERO_ADVANTAGE
  lp = A.score_group(9, comps[:2], [_result(1.1), _result(1.07, -0.03)],
                     GRPOConfig(length_only_groups="drop"))
  assert lp.dropped == A.LENGTH_ONLY


def test_bad_rewards_raise_clear_errors():
  with pytest.raises(ValueError, match="non-finite rewards at completion indices \\[1\\]"):
    A.group_advantages([0.0, np.nan])
  with pytest.raises(ValueError, match="1-D"):
    A.group_advantages([[0.0, 1.0]])
  with pytest.raises(ValueError, match="adv_norm"):
    normalize_advantages([0.0], [0], "batch")
  with pytest.raises(ValueError, match="2 completions but 1 reward"):
    A.score_group(0, [Completion([1], [2])] * 2, [_result(1.0)], GRPOConfig())


def test_a_failed_verification_drops_its_group():
  # A timed-out or crashed verification is no answer: scored 0 and kept, it would give its
  # completion, maybe a correct one, a negative advantage (here 0 - 0.575) and the others a
  # share of a mean they did not earn.
  comps = [Completion([1], [2, 3], [-0.1, -0.2]) for _ in range(4)]
  crashed = failed_result("verifier worker died (exit code -9)")
  g = A.score_group(3, comps, [crashed, _result(1.1), _result(0.1), _result(1.1)], GRPOConfig())
  assert g.dropped == A.VERIFIER_ERROR
  # It outranks the other reasons: equal rewards, one of them a failed verification.
  same = A.score_group(4, comps[:2], [failed_result("timed out"), _result(0.0)], GRPOConfig())
  assert same.dropped == A.VERIFIER_ERROR
  assert A.VERIFIER_ERROR in A.DROP_REASONS
