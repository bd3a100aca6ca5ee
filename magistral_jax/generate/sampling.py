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
fold_in(slot_key, position); the token is drawn by inverse CDF from one uniform per row
(`draw`). A sample is therefore the same whether it ran alone or batched with others, and
whichever slot it landed in.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

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


def _order_keys(x: Array) -> Array:
  """int32 keys that sort like the float32 values x (-0.0 just below +0.0; no NaN expected)."""
  i = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
  return jnp.where(i < 0, i ^ jnp.int32(0x7FFFFFFF), i)


def _from_order_keys(k: Array) -> Array:
  return jax.lax.bitcast_convert_type(jnp.where(k < 0, k ^ jnp.int32(0x7FFFFFFF), k), jnp.float32)


def _smallest_value_where(lg: Array, below: Callable[[Array], Array]) -> Array:
  """Per row of lg [..., V]: the smallest value t of the row such that below(t) holds, for a
  predicate below(t [..., 1]) -> bool [...] that is monotone (once true, true for every larger
  t) and only changes at values of the row. Found by bisection over the float32 order (at most
  32 rounds of one [..., V] pass each) instead of a sort; returns [..., 1]."""
  lo = _order_keys(jnp.min(lg, axis=-1, keepdims=True))
  hi = _order_keys(jnp.max(lg, axis=-1, keepdims=True))

  def body(_, bounds):
    lo, hi = bounds
    mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)   # floor((lo + hi) / 2) without overflow
    ok = below(_from_order_keys(mid))[..., None]
    return jnp.where(ok, lo, mid + 1), jnp.where(ok, mid, hi)

  _, hi = jax.lax.fori_loop(0, 32, body, (lo, hi))
  return _from_order_keys(hi)


TRUNCATE_BLOCK_ROWS = 8
# Up to this k the k-th largest logit comes from lax.top_k (a partial selection, faster than
# bisection for a small k and slower for a large one on CPU: docs/design_notes.md); above it, by
# bisection. Either way every token tied with the k-th value is kept.
TOP_K_SELECT_MAX = 256


def _truncate(lg: Array, top_k: int, top_p: float) -> Array:
  """Masks (to -inf) the tokens outside the top-k and outside the top-p nucleus.

  top-k keeps every token whose logit is >= the k-th largest (ties at the k-th value are all
  kept). top-p then keeps the smallest set of most likely tokens whose mass reaches top_p: a
  token is kept while the mass of the tokens strictly more likely than it is < top_p (so the
  most likely token always is, and tied tokens go together), with the probabilities
  renormalised over the top-k set when top_k is on (over the k selected values for
  k <= TOP_K_SELECT_MAX, so a tie at the k-th value counts once per selected copy there).

  Without a small top-k, the nucleus edge (and the k-th value for k > TOP_K_SELECT_MAX) is found
  by bisection over the logits' values (_smallest_value_where), not by sorting the vocabulary:
  at V = 49152 and 16 rows a full sort cost more than the rest of a SmolLM2 decode step on CPU.
  Only the mass sums differ from a sort-based nucleus (a masked sum instead of a sorted cumsum),
  so a token whose preceding mass lies within float32 rounding of top_p may fall on the other
  side."""
  if top_k == 0 and top_p >= 1.0:
    return lg
  v = lg.shape[-1]
  rows = math.prod(lg.shape[:-1])
  if rows > 2 * TRUNCATE_BLOCK_ROWS and rows % TRUNCATE_BLOCK_ROWS == 0:
    # Blocks of rows, one after another, so each block's logits and probabilities stay in cache
    # across the bisection's passes (faster on CPU: docs/design_notes.md).
    blocks = lg.reshape(rows // TRUNCATE_BLOCK_ROWS, TRUNCATE_BLOCK_ROWS, v)
    return jax.lax.map(lambda b: _truncate_rows(b, top_k, top_p), blocks).reshape(lg.shape)
  return _truncate_rows(lg, top_k, top_p)


def _truncate_rows(lg: Array, top_k: int, top_p: float) -> Array:
  v = lg.shape[-1]
  if 0 < top_k <= min(TOP_K_SELECT_MAX, v - 1):
    # XLA's partial top-k selection is cheaper for a small k; the nucleus then needs only the k
    # selected values (sorted: a cumsum gives the mass before each). (jnp.min, not the last
    # element: a slice of lax.top_k's output made XLA:CPU sort the whole row.)
    vals = jax.lax.top_k(lg, top_k)[0]
    edge = jnp.min(vals, axis=-1, keepdims=True)
    if top_p < 1.0:
      probs = jax.nn.softmax(vals, axis=-1)
      before = jnp.cumsum(probs, axis=-1) - probs
      edge = jnp.min(jnp.where(before < top_p, vals, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(lg >= edge, lg, -jnp.inf)
  if 0 < top_k < v:   # the k-th value: the smallest value with fewer than k logits above it
    kth = _smallest_value_where(lg, lambda t: jnp.sum(lg > t, axis=-1) < top_k)
    lg = jnp.where(lg >= kth, lg, -jnp.inf)
  if top_p < 1.0:
    probs = jax.nn.softmax(lg, axis=-1)
    # The smallest kept logit: the smallest value with less than top_p of mass strictly above.
    edge = _smallest_value_where(
        lg, lambda t: jnp.sum(jnp.where(lg > t, probs, 0.0), axis=-1) < top_p)
    lg = jnp.where(lg >= edge, lg, -jnp.inf)
  return lg


ARGMAX_BLOCK = 1024


def argmax(lg: Array) -> Array:
  """jnp.argmax(lg, -1) for lg [B, V] (the first index of the row's largest value), as two small
  reductions: the largest value of each block of ARGMAX_BLOCK logits, the first block holding
  the row's largest, then the argmax inside that block. XLA:CPU lowers a flat argmax over V to a
  (value, index) pair reduction, many times slower than these two plain reductions and a
  noticeable share of a small model's greedy decode step (docs/design_notes.md). Blocks
  past V are padded with -inf, which the flat argmax of a row that is all -inf also never picks
  over index 0. A row holding a NaN gets some index in [0, V), not necessarily jnp.argmax's
  (XLA:CPU's block max may skip the NaN); its log-prob is NaN, which the decode step's and the
  loop's finiteness checks stop on. Returns int32 [B]."""
  b, v = lg.shape
  if v <= ARGMAX_BLOCK:
    return jnp.argmax(lg, axis=-1).astype(jnp.int32)
  nb = -(-v // ARGMAX_BLOCK)
  if nb * ARGMAX_BLOCK != v:
    lg = jnp.pad(lg, ((0, 0), (0, nb * ARGMAX_BLOCK - v)), constant_values=-jnp.inf)
  blocks = lg.reshape(b, nb, ARGMAX_BLOCK)
  blk = jnp.argmax(jnp.max(blocks, axis=-1), axis=-1)
  inner = jnp.take_along_axis(blocks, blk[:, None, None], axis=1)[:, 0]
  return jnp.minimum(blk * ARGMAX_BLOCK + jnp.argmax(inner, axis=-1), v - 1).astype(jnp.int32)


DRAW_BLOCK = 256


def draw(keys: Array, lg: Array) -> Array:
  """One token per row of lg [B, V] (fp32 logits, -inf = excluded) from softmax(lg), by inverse
  CDF with one uniform per row: u * total falls in one block of DRAW_BLOCK probabilities (found
  from the cumulative block sums) and then on one token of that block (from the block's own
  cumulative sums). An exact categorical draw up to the fp32 rounding of those partial sums, and
  a token of probability 0 is never drawn. jax.random.categorical (Gumbel-max) draws V random
  numbers per row instead, an order of magnitude slower on CPU at SmolLM2's V
  (docs/design_notes.md). keys: [B] typed PRNG keys. Returns int32 [B]."""
  b, v = lg.shape
  nb = -(-v // DRAW_BLOCK)
  p = jax.nn.softmax(lg, axis=-1)
  if nb * DRAW_BLOCK != v:
    p = jnp.pad(p, ((0, 0), (0, nb * DRAW_BLOCK - v)))
  p = p.reshape(b, nb, DRAW_BLOCK)
  cum_blocks = jnp.cumsum(p.sum(-1), axis=-1)                            # [B, nb], inclusive
  target = jax.vmap(lambda k: jax.random.uniform(k, ()))(keys) * cum_blocks[:, -1]
  blk = jnp.minimum(jnp.sum(cum_blocks <= target[:, None], axis=-1), nb - 1)
  before = jnp.take_along_axis(cum_blocks, jnp.maximum(blk - 1, 0)[:, None], axis=-1)[:, 0]
  before = jnp.where(blk > 0, before, 0.0)
  inner = jnp.take_along_axis(p, blk[:, None, None], axis=1)[:, 0]      # [B, DRAW_BLOCK]
  idx = jnp.sum(jnp.cumsum(inner, axis=-1) <= (target - before)[:, None], axis=-1)
  # Rounding can put the target past the block's own sum: take its last nonzero token then.
  last = DRAW_BLOCK - 1 - jnp.argmax((inner > 0)[:, ::-1], axis=-1)
  return (blk * DRAW_BLOCK + jnp.minimum(idx, last)).astype(jnp.int32)


def sample(logits: Array, keys: Array, positions: Array, cfg: SamplingConfig, temperature):
  """Draws one token per row. logits [B, V] (any float dtype), keys [B] typed PRNG keys,
  positions [B] (folded into the key). `temperature`: fp32 [B], one per row (each decode slot's,
  set by the request that started it); cfg gives only what is compiled in (top-p, top-k,
  greedy), never the temperature, so one engine serves loops that sample at different
  temperatures (training and evaluation). Returns (tokens [B] int32, logprobs [B] fp32)."""
  t = temperature
  lg = _tempered(logits, t)
  if cfg.greedy:
    tokens = argmax(lg)
  else:
    masked = _truncate(lg, cfg.top_k, cfg.top_p)
    step_keys = jax.vmap(jax.random.fold_in)(keys, positions)
    tokens = draw(step_keys, masked)
  tokens = tokens.astype(jnp.int32)
  return tokens, token_logprob(logits, tokens, t)
