"""Magistral's GRPO loss (paper §1) as a pure function of per-token log-probs.

    ρ_t   = exp(log π_θ(o_t) − log π_old(o_t))
    obj_t = min(ρ_t·Â_t, clip(ρ_t, 1 − eps_low, 1 + eps_high)·Â_t)
    loss  = −Σ_t w_t·obj_t  [+ kl_coef·KL(π_θ‖π_ref)]  [− entropy_coef·Σ_t w_t·H_t]

w_t is the per-token normaliser weight made by collation (rl/collate.py) over the *whole*
minibatch: 1/N_tokens for token-level aggregation (DAPO, the paper), 1/(|o_i|·N_seq) for sequence
means, 1/(Σ_{j∈g}|o_j|·N_groups) for the group token-sum. Because every constant is global, the
loss of a microbatch is a plain sum of its tokens' terms: summing microbatch losses (and their
gradients) gives the unsplit minibatch's exactly.

Metrics come back as sums (and a max/min) so they too can be added across microbatches;
`summarize_metrics` turns them into fractions and means.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from magistral_jax.rl.config import GRPOConfig

sg = jax.lax.stop_gradient



def policy_objective(ratio, advantages, cfg: GRPOConfig):
  """Per-token clipped objective (to be maximised). Returns (objective, clip-event masks)."""
  unclipped = ratio * advantages
  clipped = jnp.clip(ratio, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high) * advantages
  obj = jnp.minimum(unclipped, clipped)
  events = {
      # The clipped branch is the active one and carries no gradient.
      "clip_low": (advantages < 0) & (ratio < 1.0 - cfg.eps_low),
      "clip_high": (advantages > 0) & (ratio > 1.0 + cfg.eps_high),
  }
  if cfg.dual_clip_c is not None:
    floor = cfg.dual_clip_c * advantages
    dual = (advantages < 0) & (obj < floor)
    obj = jnp.where(dual, floor, obj)
    events["dual_clip"] = dual
  if cfg.stale_weight_cap is not None:
    cap = cfg.stale_weight_cap
    capped = ratio > cap
    # Truncated importance weight: the effective weight of the token becomes min(ρ, cap).
    obj = obj * sg(jnp.where(capped, cap / jnp.maximum(ratio, 1e-30), 1.0))
    events["stale_capped"] = capped
  return obj, events


def _segment_reverse_cumsum(x, segment_ids):
  """Σ_{t' ≥ t, same segment} x_t' along the last axis (segments are contiguous runs of ids)."""
  length = x.shape[-1]
  csum = jnp.flip(jnp.cumsum(jnp.flip(x, -1), axis=-1), -1)           # Σ_{t' ≥ t} x_t'
  nxt = jnp.concatenate([segment_ids[..., 1:], jnp.full_like(segment_ids[..., :1], -1)], -1)
  is_last = segment_ids != nxt
  idx = jnp.broadcast_to(jnp.arange(length), x.shape)
  seg_end = jax.lax.cummin(jnp.where(is_last, idx, length), axis=x.ndim - 1, reverse=True)
  csum_pad = jnp.concatenate([csum, jnp.zeros_like(csum[..., :1])], -1)
  return csum - jnp.take_along_axis(csum_pad, seg_end + 1, axis=-1)


def kl_estimate(logprobs, ref_logprobs, estimator: str):
  """Per-token estimates of KL(π_θ‖π_ref) from tokens sampled by π (Schulman's k1/k2/k3).

      log r = log π_ref − log π_θ;  k1 = −log r;  k2 = ½(log r)²;  k3 = (r − 1) − log r
  """
  log_r = ref_logprobs - logprobs
  if estimator == "k1":
    return -log_r
  if estimator == "k2":
    return 0.5 * log_r ** 2
  if estimator == "k3":
    return jnp.expm1(log_r) - log_r
  raise ValueError(f"kl_estimator must be k1|k2|k3, got {estimator!r}")


def kl_penalty(logprobs, old_logprobs, ref_logprobs, weights, mask, segment_ids, estimator: str):
  """Sequence-level KL(π_θ‖π_ref) penalty whose *gradient* is the true KL gradient.

  Differentiating an estimate k_t as a loss is wrong in general: ∇k1 = ∇log π has zero mean, and
  ∇k3 = (1 − π_ref/π)·∇log π is the gradient of the *reverse* KL. The gradient of the sequence KL
  is the score-function form
      ∇ KL(π_θ(·|q) ‖ π_ref(·|q)) = E[ Σ_t ∇log π_θ(o_t) · Σ_{t'≥t} (log π_θ(o_t') − log π_ref(o_t')) ]
  (terms t' < t vanish by causality; dropping the t' > t terms, as per-token losses do, gives only
  a partial gradient). We build exactly that with stop-gradients, with the per-token importance
  ratio ρ_t correcting for tokens sampled by π_old, and the weights w inside the sum so the penalty
  is aggregated like the policy loss. The chosen estimator only sets the penalty's *value*
  (Σ w_t·k_t, logged and added with no gradient); for k1 and k3 the correct gradient of E[Σ k_t]
  is this same expression, so the choice cannot leak a wrong gradient.
  Returns (penalty with the right value and gradient, value).
  """
  k1 = sg(logprobs - ref_logprobs) * weights
  to_go = _segment_reverse_cumsum(k1, segment_ids)
  # Only completion tokens are actions: prompt tokens of the same segment get no score term.
  ratio = jnp.exp(jnp.where(mask, logprobs - old_logprobs, 0.0))
  surrogate = jnp.sum(jnp.where(mask, ratio * to_go, 0.0))
  value = jnp.sum(weights * sg(kl_estimate(logprobs, ref_logprobs, estimator)))
  return value + surrogate - sg(surrogate), value


def grpo_loss(logprobs, old_logprobs, advantages, weights, mask, cfg: GRPOConfig, *,
              segment_ids=None, ref_logprobs=None, entropy=None):
  """The microbatch's share of the minibatch loss, and additive metric sums.

  All arrays share one shape ([rows, row_len] for packed microbatches, or [B, T]):
    logprobs      log π_θ of each target token (differentiable)
    old_logprobs  the generator's log-probs of the same tokens (π_old)
    advantages    Â_norm of the token's completion, broadcast over its tokens
    weights       per-token normaliser weight (0 off the loss mask), see the module docstring
    mask          1 on completion tokens (the tokens the loss applies to)
    segment_ids   packed sequence ids (needed only for the KL term; default: one per row)
    ref_logprobs  log π_ref, required iff cfg.kl_coef > 0
    entropy       policy entropy over the vocabulary per token, for the metric and the bonus
  """
  f32 = jnp.float32
  logprobs = logprobs.astype(f32)
  old_logprobs = sg(old_logprobs.astype(f32))
  advantages = sg(advantages.astype(f32))
  weights = sg(weights.astype(f32))
  mask = mask.astype(bool)
  fmask = mask.astype(f32)

  log_ratio = jnp.where(mask, logprobs - old_logprobs, 0.0)
  ratio = jnp.exp(log_ratio)
  obj, events = policy_objective(ratio, advantages, cfg)
  pg_loss = -jnp.sum(weights * obj)
  loss = pg_loss

  ratio_m = sg(ratio)
  # |log π_θ − log π_old| on completion tokens: the trainer's recomputed log-probs against the
  # sampler's. On a batch's first optimizer step and tokens sampled by the same weights (version
  # lag 0) this is pure numerics (bf16 generator vs the trainer's forward, kernels); otherwise it
  # also holds the policy change since the tokens were sampled.
  abs_dlogp = jnp.abs(sg(log_ratio))
  metrics = {
      "tokens": jnp.sum(fmask),
      "pg_loss": sg(pg_loss),
      "ratio_sum": jnp.sum(ratio_m * fmask),
      "ratio_sq_sum": jnp.sum(ratio_m ** 2 * fmask),
      "ratio_max": jnp.max(jnp.where(mask, ratio_m, -jnp.inf)),
      "ratio_min": jnp.min(jnp.where(mask, ratio_m, jnp.inf)),
      # KL(π_old‖π_θ) from tokens sampled by π_old: k3 with r = π_θ/π_old.
      "kl_old_sum": jnp.sum((jnp.expm1(sg(log_ratio)) - sg(log_ratio)) * fmask),
      "adv_sum": jnp.sum(advantages * fmask),
      "logp_mismatch_sum": jnp.sum(abs_dlogp * fmask),
      "logp_mismatch_max": jnp.max(abs_dlogp * fmask),   # >= 0 everywhere: 0 with no tokens
  }
  for name, ev in events.items():
    metrics[f"{name}_count"] = jnp.sum((ev & mask).astype(f32))

  if cfg.kl_coef:
    if ref_logprobs is None:
      raise ValueError("grpo_loss: cfg.kl_coef > 0 needs ref_logprobs")
    if segment_ids is None:
      segment_ids = jnp.ones(logprobs.shape, jnp.int32)
    kl_term, kl_value = kl_penalty(logprobs, old_logprobs, sg(ref_logprobs.astype(f32)),
                                   weights, mask, segment_ids, cfg.kl_estimator)
    loss = loss + cfg.kl_coef * kl_term
    metrics["kl_ref"] = kl_value
  if entropy is not None:
    entropy = entropy.astype(f32)
    metrics["entropy_sum"] = jnp.sum(sg(entropy) * fmask)
    if cfg.entropy_coef:
      loss = loss - cfg.entropy_coef * jnp.sum(weights * entropy)
  elif cfg.entropy_coef:
    raise ValueError("grpo_loss: cfg.entropy_coef > 0 needs the per-token entropy")
  metrics["loss"] = sg(loss)
  return loss, metrics


def combine_metrics(a: dict, b: dict) -> dict:
  """Adds two microbatches' metric sums; keys ending in _max/_min combine by max/min."""
  out = {}
  for k in a:
    if k.endswith("_max"):
      out[k] = jnp.maximum(a[k], b[k])
    elif k.endswith("_min"):
      out[k] = jnp.minimum(a[k], b[k])
    else:
      out[k] = a[k] + b[k]
  return out


def empty_metrics(like: dict) -> dict:
  """The identity of combine_metrics for a metric dict shaped like `like`."""
  def init(k, v):
    fill = -jnp.inf if k.endswith("_max") else jnp.inf if k.endswith("_min") else 0.0
    return jnp.full(v.shape, fill, v.dtype)
  return {k: init(k, v) for k, v in like.items()}


def summarize_metrics(sums: dict) -> dict:
  """Turns accumulated sums into the logged values (fractions over completion tokens, means)."""
  n = jnp.maximum(sums["tokens"], 1.0)
  out = {k: v for k, v in sums.items() if not (k.endswith("_sum") or k.endswith("_count"))}
  mean_ratio = sums["ratio_sum"] / n
  out["ratio_mean"] = mean_ratio
  out["ratio_std"] = jnp.sqrt(jnp.maximum(sums["ratio_sq_sum"] / n - mean_ratio ** 2, 0.0))
  out["approx_kl_old_new"] = sums["kl_old_sum"] / n
  out["adv_mean_token"] = sums["adv_sum"] / n
  out["logp_mismatch_mean"] = sums["logp_mismatch_sum"] / n
  for k, v in sums.items():
    if k.endswith("_count"):
      out[k[:-len("_count")] + "_frac"] = v / n
  if "entropy_sum" in sums:
    out["entropy"] = sums["entropy_sum"] / n
  return out
