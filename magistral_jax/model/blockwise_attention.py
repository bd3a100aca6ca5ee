"""Blockwise attention with an online softmax: memory linear in the sequence length.

Queries are split into blocks of `block_q` and keys into blocks of `block_k`; for each query
block a scan over the key blocks keeps a running max, a running sum and an fp32 accumulator
(the online softmax of FlashAttention), so no more than one [block_q, block_k] score tile per
head is live at a time. A key block that no query of the query block may see (causal, another
segment, outside the sliding window, past the slot's length) is skipped with a lax.cond, so a
causal row costs about half of the dense product, and a packed row of many short sequences far
less.

The gradient is a custom VJP (the FlashAttention-2 backward): the forward saves only its inputs,
the output and the per-row log-sum-exp, and the backward recomputes each score tile, so
training memory is linear in T as well.

Which keys a query sees is described by a MaskSpec (model/attention.py builds them; `visible`
is the one definition the dense reference shares).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

Array = jax.Array
NEG_INF = -1e30  # finite, so fully masked rows stay NaN-free


class MaskSpec(NamedTuple):
  """Key j (its index along the key axis) is visible to query i of row b iff
    j <= q_limit[b, i]                    causal: by index when packed, by position in a cache
    j < kv_len[b]                         the slot's filled length (None: every key)
    q_seg[b, i] == k_seg[b, j]            packed segments (None: one sequence per row)
    q_pos[b, i] - k_pos[b, j] < window    the sliding window (window is a static argument)
  """
  q_limit: Array          # [B, T] int
  q_pos: Array            # [B, T] int
  k_pos: Array            # [B, S] int
  q_seg: Array | None     # [B, T] int
  k_seg: Array | None     # [B, S] int
  kv_len: Array | None    # [B] int


def visible(q_limit, q_pos, q_seg, k_idx, k_pos, k_seg, kv_len, window) -> Array:
  """[B, Tq, Sk] bool: which keys (indices k_idx [Sk]) the queries see; see MaskSpec."""
  m = k_idx[None, None, :] <= q_limit[:, :, None]
  if kv_len is not None:
    m &= k_idx[None, None, :] < kv_len[:, None, None]
  if q_seg is not None:
    m &= q_seg[:, :, None] == k_seg[:, None, :]
  if window is not None:
    m &= (q_pos[:, :, None] - k_pos[:, None, :]) < window
  return m


class _Static(NamedTuple):
  scale: float
  window: int | None


def _tile_mask(st: _Static, qm, km, kv_len):
  """The [B, bq, bk] mask of one (query block, key block) tile."""
  lim, qp, qs = qm
  ki, kp, ks = km
  return visible(lim, qp, qs, ki, kp, ks, kv_len, st.window)


def _scores(st: _Static, q_i, k_j):
  return jnp.einsum("bkgqd,bksd->bkgqs", q_i, k_j,
                    preferred_element_type=jnp.float32) * st.scale


def _forward(st: _Static, qb, kb, vb, qm, km, kv_len):
  """Blocked inputs (qb [nq, B, K, G, bq, Dh], kb/vb [nk, B, K, bk, Dh], masks blocked the same
  way) -> (out [nq, B, K, G, bq, Dh] in the input dtype, lse [nq, B, K, G, bq] fp32)."""
  dt = qb.dtype
  # Under a differentiated scan over layers the masks' inputs (positions, segments) are loop
  # invariants, and JAX's partial evaluation hoists loop-invariant work out of the loop: it
  # would precompute every tile's mask, all [T, S] of them. Tying the masks' inputs to the
  # queries keeps that work in the loop.
  qb, qm, km, kv_len = jax.lax.optimization_barrier((qb, qm, km, kv_len))

  def q_block(_, xq):
    q_i, qm_i = xq
    shape = q_i.shape[:-1]

    def k_block(carry, xk):
      k_j, v_j, km_j = xk
      mask = _tile_mask(st, qm_i, km_j, kv_len)[:, None, None]

      def tile(c):
        m, l, acc = c
        s = jnp.where(mask, _scores(st, q_i, k_j), NEG_INF)
        m_new = jnp.maximum(m, s.max(-1))
        # A row with nothing visible yet keeps m = NEG_INF: zeroing its masked entries keeps
        # exp(NEG_INF - NEG_INF) = 1 out of the sum.
        p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
        corr = jnp.exp(m - m_new)
        acc = acc * corr[..., None] + jnp.einsum("bkgqs,bksd->bkgqd", p.astype(dt), v_j,
                                                 preferred_element_type=jnp.float32)
        return m_new, l * corr + p.sum(-1), acc

      return jax.lax.cond(mask.any(), tile, lambda c: c, carry), None

    init = (jnp.full(shape, NEG_INF, jnp.float32), jnp.zeros(shape, jnp.float32),
            jnp.zeros(q_i.shape, jnp.float32))
    (m, l, acc), _ = jax.lax.scan(k_block, init, (kb, vb, km))
    l_safe = jnp.where(l == 0, 1.0, l)   # a row that sees nothing gets 0 (never used)
    return None, ((acc / l_safe[..., None]).astype(dt), m + jnp.log(l_safe))

  _, (out, lse) = jax.lax.scan(q_block, None, (qb, qm))
  return out, lse


def _backward(st: _Static, qb, kb, vb, qm, km, kv_len, out, lse, dout):
  """FlashAttention-2 backward: per tile, P = exp(S - lse) is recomputed; dV += Pᵀ dO,
  dS = P (dO Vᵀ - rowsum(dO ∘ O)), dQ += dS K, dK += dSᵀ Q (scale folded into dS)."""
  dt = qb.dtype
  delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)

  def k_block(dq_all, xk):
    k_j, v_j, km_j = xk

    def q_block(carry, xq):
      q_i, do_i, lse_i, delta_i, dq_i, qm_i = xq
      mask = _tile_mask(st, qm_i, km_j, kv_len)[:, None, None]

      def tile(c):
        dk, dv, dq = c
        p = jnp.where(mask, jnp.exp(_scores(st, q_i, k_j) - lse_i[..., None]), 0.0)
        dv = dv + jnp.einsum("bkgqs,bkgqd->bksd", p.astype(dt), do_i,
                             preferred_element_type=jnp.float32)
        dp = jnp.einsum("bkgqd,bksd->bkgqs", do_i, v_j, preferred_element_type=jnp.float32)
        ds = (p * (dp - delta_i[..., None]) * st.scale).astype(dt)
        dq = dq + jnp.einsum("bkgqs,bksd->bkgqd", ds, k_j, preferred_element_type=jnp.float32)
        dk = dk + jnp.einsum("bkgqs,bkgqd->bksd", ds, q_i, preferred_element_type=jnp.float32)
        return dk, dv, dq

      dk, dv, dq_i = jax.lax.cond(mask.any(), tile, lambda c: c, (*carry, dq_i))
      return (dk, dv), dq_i

    zeros = jnp.zeros(k_j.shape, jnp.float32)
    (dk, dv), dq_all = jax.lax.scan(q_block, (zeros, zeros),
                                    (qb, dout, lse, delta, dq_all, qm))
    return dq_all, (dk, dv)

  dq, (dk, dv) = jax.lax.scan(k_block, jnp.zeros(qb.shape, jnp.float32), (kb, vb, km))
  return dq.astype(qb.dtype), dk.astype(kb.dtype), dv.astype(vb.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attend_blocks(st, qb, kb, vb, qm, km, kv_len):
  return _forward(st, qb, kb, vb, qm, km, kv_len)[0]


def _attend_blocks_fwd(st, qb, kb, vb, qm, km, kv_len):
  out, lse = _forward(st, qb, kb, vb, qm, km, kv_len)
  return out, (qb, kb, vb, qm, km, kv_len, out, lse)


def _attend_blocks_bwd(st, res, dout):
  qb, kb, vb, qm, km, kv_len, out, lse = res
  dq, dk, dv = _backward(st, qb, kb, vb, qm, km, kv_len, out, lse, dout)
  return dq, dk, dv, None, None, None


_attend_blocks.defvjp(_attend_blocks_fwd, _attend_blocks_bwd)


def _blocked(x: Array, axis: int, block: int, fill=0) -> Array:
  """x with `axis` padded to a multiple of `block` (with `fill`), split into [n, block], and
  the block-count axis moved to the front."""
  n = -(-x.shape[axis] // block)
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, n * block - x.shape[axis])
  x = jnp.pad(x, pad, constant_values=fill)
  x = x.reshape(x.shape[:axis] + (n, block) + x.shape[axis + 1:])
  return jnp.moveaxis(x, axis, 0)


def blockwise_attention(q: Array, keys: Array, values: Array, spec: MaskSpec, *,
                        window: int | None = None, block_q: int = 512, block_k: int = 512,
                        keys_t: bool = False) -> Array:
  """softmax(q kᵀ / sqrt(Dh) masked by `spec`) v, one [block_q, block_k] tile at a time.

  q [B, T, H, Dh]; keys [B, K, S, Dh] (or [B, K, Dh, S] with keys_t, the per-layer cache's
  layout); values [B, K, S, Dh]; H a multiple of K (grouped-query heads h = k·G + g).
  Returns [B, T, H, Dh] in q's dtype. A query that sees no key gets zeros (the dense reference
  averages every value there; neither is ever used). T and S need not be multiples of the
  blocks: padded queries see nothing and padded keys are never seen."""
  b, t, h, dh = q.shape
  if keys_t:
    keys = keys.swapaxes(-1, -2)
  kh, s = keys.shape[1], keys.shape[2]
  g = h // kh
  bq, bk = min(block_q, t), min(block_k, s)
  st = _Static(1.0 / float(dh) ** 0.5, window)
  # [B, T, H, Dh] -> [B, K, G, T, Dh] -> [nq, B, K, G, bq, Dh]
  qb = _blocked(q.reshape(b, t, kh, g, dh).transpose(0, 2, 3, 1, 4), 3, bq)
  kb = _blocked(keys.astype(q.dtype), 2, bk)
  vb = _blocked(values.astype(q.dtype), 2, bk)
  seg = lambda x, block: None if x is None else _blocked(x, 1, block)
  qm = (_blocked(spec.q_limit, 1, bq, fill=-1), _blocked(spec.q_pos, 1, bq),
        seg(spec.q_seg, bq))
  km = (_blocked(jnp.arange(s), 0, bk, fill=s), _blocked(spec.k_pos, 1, bk),
        seg(spec.k_seg, bk))
  kv_len = jnp.full((b,), s, jnp.int32) if spec.kv_len is None else \
      jnp.minimum(spec.kv_len, s).astype(jnp.int32)
  out = _attend_blocks(st, qb, kb, vb, qm, km, kv_len)   # [nq, B, K, G, bq, Dh]
  out = jnp.moveaxis(out, 0, 3).reshape(b, kh, g, -1, dh)[:, :, :, :t]
  return out.transpose(0, 3, 1, 2, 4).reshape(b, t, h, dh)
