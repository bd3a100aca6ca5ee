"""Token sampling and the sampled token's log-prob.

Which distribution the log-prob is under
----------------------------------------
Every sampled token carries  log π_T(y | ·) = log_softmax(logits / T)[y]  in float32, where T is
the sampling temperature and `logits` is `transformer.logits(params, cfg, hidden)`. This is the
*untruncated* tempered policy: top-p / top-k only decide which token is drawn, they do not
renormalise the log-prob. It is the quantity the trainer computes as π_θ with
`transformer.token_logprobs(..., temperature=T)` (same logits formula, fp32, divide by T, subtract
the logsumexp, no truncation; the trainer may sum its logsumexp over vocab pieces, which agrees to
fp32 rounding), so the GRPO ratio π_θ / π_old compares like with like. With
`greedy=True` the argmax is taken and the log-prob is still log π_T of that token.

Sampling is per slot: each slot has its own PRNG key, and the key for a token is
fold_in(slot_key, position). A sample is therefore the same whether it ran alone or batched with
others, and whichever slot it landed in.

How the token is chosen depends on the platform (lax.platform_dependent: only one is compiled).
Off CPU, by jax's own: top-k / top-p thresholds from lax.top_k, a Gumbel-max draw
(jax.random.categorical), jnp.argmax. On CPU, by the primitives of xla_cpu.py (bisection instead
of a sort, inverse CDF with one uniform per row, a blocked argmax), measured many times faster
there. Both keep the same tokens (the rule in `truncate`); the draws differ, each exact.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from magistral_jax.generate import xla_cpu
from magistral_jax.generate.config import SamplingConfig

Array = jax.Array


def _tempered(logits: Array, temperature) -> Array:
  """logits / T in float32. T: a float, or an array of one temperature per row (logits'
  shape without the vocabulary axis, e.g. each decode slot's)."""
  t = temperature
  if isinstance(t, (jax.Array, np.ndarray)) and t.ndim:
    t = t.astype(jnp.float32)[..., None]
  return logits.astype(jnp.float32) / t


def token_logprob(logits: Array, tokens: Array, temperature) -> Array:
  """log π_T(tokens) for logits [..., V] and tokens [...]: the π_old the loss uses. T: a float
  or one per row ([...])."""
  lg = _tempered(logits, temperature)
  lse = jax.nn.logsumexp(lg, axis=-1)
  return jnp.take_along_axis(lg, tokens[..., None], axis=-1)[..., 0] - lse


def truncate(lg: Array, top_k: int, top_p: float) -> Array:
  """Masks (to -inf) the tokens outside the top-k and outside the top-p nucleus, from a descending
  lax.top_k of each row (the path off CPU; xla_cpu.truncate keeps the same tokens without a sort).

  top-k keeps every token whose logit is >= the k-th largest (ties at the k-th value are all
  kept). top-p then keeps the smallest set of most likely tokens whose mass reaches top_p: a
  token is kept while the mass of the tokens strictly more likely than it is < top_p (so the most
  likely token always is, and tied tokens go together), with the probabilities renormalised over
  the k selected values when top_k is on."""
  if top_k == 0 and top_p >= 1.0:
    return lg
  v = lg.shape[-1]
  vals = jax.lax.top_k(lg, v if top_k == 0 else min(top_k, v))[0]
  edge = vals[..., -1:]
  if top_p < 1.0:
    probs = jax.nn.softmax(vals, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs
    edge = jnp.min(jnp.where(before < top_p, vals, jnp.inf), axis=-1, keepdims=True)
  return jnp.where(lg >= edge, lg, -jnp.inf)


def choose(lg: Array, keys: Array, cfg: SamplingConfig) -> Array:
  """One token per row of tempered fp32 logits lg [B, V]: the argmax (cfg.greedy), or a draw
  under keys [B] from the top-k / top-p truncated softmax. Returns int32 [B]."""
  if cfg.greedy:
    return jax.lax.platform_dependent(
        lg, cpu=xla_cpu.argmax, default=lambda lg: jnp.argmax(lg, axis=-1).astype(jnp.int32))

  def on_cpu(keys, lg):
    return xla_cpu.draw(keys, xla_cpu.truncate(lg, cfg.top_k, cfg.top_p))

  def elsewhere(keys, lg):
    masked = truncate(lg, cfg.top_k, cfg.top_p)
    return jax.vmap(jax.random.categorical)(keys, masked).astype(jnp.int32)

  return jax.lax.platform_dependent(keys, lg, cpu=on_cpu, default=elsewhere)


def sample(logits: Array, keys: Array, positions: Array, cfg: SamplingConfig, temperature):
  """Draws one token per row. logits [B, V] (any float dtype), keys [B] typed PRNG keys,
  positions [B] (folded into the key). `temperature`: fp32 [B], one per row (each decode slot's,
  set by the request that started it); cfg gives only what is compiled in (top-p, top-k,
  greedy), never the temperature, so one engine serves loops that sample at different
  temperatures (training and evaluation). Returns (tokens [B] int32, logprobs [B] fp32)."""
  # Greedy draws nothing: no per-token keys on its hot path.
  step_keys = keys if cfg.greedy else jax.vmap(jax.random.fold_in)(keys, positions)
  tokens = choose(_tempered(logits, temperature), step_keys, cfg).astype(jnp.int32)
  return tokens, token_logprob(logits, tokens, temperature)
