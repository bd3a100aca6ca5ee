"""Magistral's GRPO variant as pure functions: advantages, group filtering, the loss, collation."""
from magistral_jax.rl.advantages import (filter_groups, group_advantages, group_mean, group_std,
                                         normalize_advantages)
from magistral_jax.rl.collate import (Completion, aggregation_weights, collate_minibatch, first_fit,
                                      make_minibatches, pack, split_minibatches, unpack_tokens)
from magistral_jax.rl.config import GRPOConfig
from magistral_jax.rl.loss import (combine_metrics, grpo_loss, kl_estimate, kl_penalty,
                                   policy_objective, summarize_metrics)

__all__ = ["Completion", "GRPOConfig", "aggregation_weights", "collate_minibatch", "combine_metrics",
           "filter_groups", "first_fit", "group_advantages", "group_mean", "group_std", "grpo_loss",
           "kl_estimate", "kl_penalty", "make_minibatches", "normalize_advantages", "pack",
           "policy_objective", "split_minibatches", "summarize_metrics", "unpack_tokens"]
