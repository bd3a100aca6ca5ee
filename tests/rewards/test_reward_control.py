"""reward.control=random: the control run of a learning claim (issue #51) is paid a coin of the
verifier run's mean accuracy instead of the verdict, which stays in the parts."""
import pytest

from magistral_jax.rewards.config import RewardConfig
from magistral_jax.rewards.reward import compute_reward, control_coin, reward_metrics

TASK = {"kind": "math", "problem": "What is 2+3?", "answer": "5"}


def _answer(i, box):
  return f"<think>\nattempt {i}\n</think>\n\\boxed{{{box}}}"


def test_the_random_control_pays_a_coin_of_the_given_rate_blind_to_correctness():
  cfg = RewardConfig(language_bonus=0.0, control="random", control_rate=0.3)
  n = 1500
  right = [compute_reward(TASK, _answer(i, "5"), None, cfg, group_seed=i % 7) for i in range(n)]
  wrong = [compute_reward(TASK, _answer(i, "6"), None, cfg, group_seed=i % 7) for i in range(n)]
  for results, verdict in ((right, 0.9), (wrong, 0.0)):
    assert all(r.parts["correct"] == verdict for r in results)     # the verdict is kept
    paid = [r.info["control_paid"] for r in results]
    assert set(paid) <= {0.0, 0.9}
    assert sum(p > 0 for p in paid) / n == pytest.approx(0.3, abs=0.04)   # ~4.5 sigma
    assert all(r.reward == pytest.approx(0.1 + r.info["control_paid"]) for r in results)
  assert reward_metrics(right)["accuracy"] == 1.0 and reward_metrics(wrong)["accuracy"] == 0.0
  # Reproducible: the same completion draws the same coin, in any process.
  again = compute_reward(TASK, _answer(3, "5"), None, cfg, group_seed=3)
  assert again.info["control_paid"] == right[3].info["control_paid"]
  assert 0.0 <= control_coin(3, "x") < 1.0 and control_coin(3, "x") == control_coin(3, "x")


def test_rates_zero_and_one_and_the_default_off():
  for rate, paid in ((0.0, 0.0), (1.0, 0.9)):
    cfg = RewardConfig(language_bonus=0.0, control="random", control_rate=rate)
    assert compute_reward(TASK, _answer(0, "6"), None, cfg).reward == pytest.approx(0.1 + paid)
  off = compute_reward(TASK, _answer(0, "5"), None, RewardConfig(language_bonus=0.0))
  assert off.reward == pytest.approx(1.0) and "control_paid" not in off.info


def test_bad_control_settings_are_refused():
  with pytest.raises(ValueError, match="control must be"):
    RewardConfig(control="shuffle")
  with pytest.raises(ValueError, match="control_rate"):
    RewardConfig(control="random", control_rate=1.5)
