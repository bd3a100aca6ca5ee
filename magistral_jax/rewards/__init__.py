"""Rewards (paper §2): format gate, math and code correctness, length penalty, language bonus."""
from magistral_jax.lazy_exports import lazy_exports

__getattr__, __all__ = lazy_exports(__name__, {
    "format": ("FormatResult", "check_format", "find_boxed"),
    "length": ("length_penalty",),
    "reward": ("RewardResult", "compute_reward", "failed_result"),
    "config": ("RewardConfig",),
})
