"""Magistral's GRPO variant as pure functions, in the order a reward flows through them:
group advantages and the drop decision (advantages), minibatches with normalised advantages
(minibatch), greedy collation into packed microbatches (collate), and the loss (loss)."""
from magistral_jax.rl.advantages import (DROP_REASONS, LENGTH_ONLY, VERIFIER_ERROR, ZERO_ADVANTAGE,
                                         ScoredGroup, drop_reason, group_advantages, score_group)
from magistral_jax.rl.collate import (Completion, aggregation_weights, first_fit, pack,
                                      unpack_tokens)
from magistral_jax.rl.config import GRPOConfig
from magistral_jax.rl.loss import (combine_metrics, grpo_loss, kl_estimate, kl_penalty,
                                   policy_objective, summarize_metrics)
from magistral_jax.rl.minibatch import (Minibatch, collate_minibatch, group_std, make_minibatches,
                                        normalize_advantages, split_minibatches)

__all__ = ["Completion", "DROP_REASONS", "GRPOConfig", "LENGTH_ONLY", "Minibatch", "ScoredGroup",
           "VERIFIER_ERROR", "ZERO_ADVANTAGE", "aggregation_weights", "collate_minibatch", "combine_metrics", "drop_reason",
           "first_fit", "group_advantages", "group_std", "grpo_loss", "kl_estimate", "kl_penalty",
           "make_minibatches", "normalize_advantages", "pack", "policy_objective", "score_group",
           "split_minibatches", "summarize_metrics", "unpack_tokens"]
