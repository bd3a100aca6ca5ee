"""Magistral's GRPO variant as pure functions, in the order a reward flows through them:
group advantages and the drop decision (advantages), minibatches with normalised advantages
(minibatch), greedy collation into packed microbatches (collate), and the loss (loss)."""
from magistral_jax.lazy_exports import lazy_exports

__getattr__, __all__ = lazy_exports(__name__, {
    "advantages": ("DROP_REASONS", "LENGTH_ONLY", "VERIFIER_ERROR", "ZERO_ADVANTAGE", "ScoredGroup",
                   "drop_reason", "group_advantages", "score_group"),
    "collate": ("Completion", "aggregation_weights", "first_fit", "pack", "unpack_tokens"),
    "config": ("GRPOConfig",),
    "loss": ("combine_metrics", "grpo_loss", "kl_estimate", "kl_penalty", "policy_objective",
             "summarize_metrics"),
    "minibatch": ("Minibatch", "collate_minibatch", "group_std", "make_minibatches",
                  "normalize_advantages", "split_minibatches"),
})
