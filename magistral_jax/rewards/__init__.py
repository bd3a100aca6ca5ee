"""Rewards (paper §2): format gate, math and code correctness, length penalty, language bonus."""
from magistral_jax.rewards.format import FormatResult, check_format, find_boxed
from magistral_jax.rewards.length import length_penalty
from magistral_jax.rewards.reward import RewardResult, compute_reward, failed_result
from magistral_jax.rewards.config import RewardConfig

__all__ = ["FormatResult", "check_format", "find_boxed", "length_penalty", "RewardConfig",
           "RewardResult", "compute_reward", "failed_result"]
