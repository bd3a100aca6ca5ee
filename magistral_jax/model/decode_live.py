"""Decode attention that reads only the cache positions each slot has reached.

A decode step attends one new query per slot over that slot's KV cache. The engine's cache is
dense, [slots, S] positions per layer, and XLA's attention reads all S of them for every slot
(the engine's attention windows bound S by the longest active slot, not by each slot's own
length). In an RL batch the slots are at every length from the prompt to max_new_tokens, so
most of the bytes a step reads are positions no sequence has reached: the bottleneck the scale
model (analysis/scale_model.py) names for Medium and Small. Decode is bound by memory
bandwidth, so the bytes read are the step's time.

Here one program per (slot, KV head) loops over the key blocks [0, ceil(n / block_k)), n the
slot's attended length, with an online softmax (FlashAttention-2's, in base 2 with fp32
accumulators): a slot at 1K of a 32K cache reads 1K positions. The G query heads of the KV
head's group are the rows of one [G, Dh] x [Dh, block_k] tile, padded to Triton's minimum of 16
rows, so grouped-query attention reads each key once. The cache layouts are the decode
layout's (model/transformer.py: keys transposed [B, K, Dh, S], values [B, K, S, Dh]), read where
they lie. Lowered through Triton on NVIDIA GPUs; Pallas's interpreter runs it in the tests on
CPU against the dense reference.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from magistral_jax.model.flash_sparse import LOG2E, MASKED, _ceil_div, _dot

Array = jax.Array
MIN_ROWS = 16          # Triton's dot takes tiles of at least 16 rows
BLOCK_CHOICES = (128, 64, 32, 16)
_LANES = 16            # the per-slot length travels as a [B, 16] row (a power-of-2 block)


def block_for(cache_length: int) -> int | None:
  """The largest key block (a power of 2 from 16 to 128) that tiles the cache; None if none."""
  return next((b for b in BLOCK_CHOICES if cache_length % b == 0), None)


def supports(head_dim: int, cache_length: int) -> bool:
  """Shapes the kernel takes: head_dim a power of 2 from 16 to 128, a cache length that a key
  block of 16 to 128 positions tiles."""
  return head_dim in (16, 32, 64, 128) and block_for(cache_length) is not None


def _kernel(n_ref, q_ref, k_ref, v_ref, o_ref, *count_ref, scale: float, bk: int):
  n = jnp.max(n_ref[...])     # the positions this slot attends to: [0, n)
  q = q_ref[...]              # [R, Dh]: this KV head's query heads, zero rows past G

  def tile(j, carry):
    acc, m, l = carry
    cols = pl.ds(j * bk, bk)
    s = _dot(q, k_ref[:, cols].astype(q.dtype)) * (scale * LOG2E)  # [R, bk]
    keep = (j * bk + jnp.arange(bk) < n)[None, :]
    m_new = jnp.maximum(m, jnp.max(jnp.where(keep, s, MASKED), axis=1))
    p = jnp.where(keep, jnp.exp2(s - m_new[:, None]), 0.0)
    rescale = jnp.exp2(m - m_new)                  # the running sums were relative to m
    v = v_ref[cols, :].astype(q.dtype)
    acc = acc * rescale[:, None] + _dot(p.astype(v.dtype), v)
    return acc, m_new, l * rescale + jnp.sum(p, axis=1)

  rows = q.shape[0]
  init = (jnp.zeros(q.shape, jnp.float32), jnp.full((rows,), MASKED, jnp.float32),
          jnp.zeros((rows,), jnp.float32))
  blocks = _ceil_div(n, bk)
  acc, _, l = lax.fori_loop(0, blocks, tile, init)
  # A slot that attends to nothing (inactive, n = 0) reads nothing and returns zeros.
  o_ref[...] = (acc / jnp.maximum(l, 1e-30)[:, None]).astype(o_ref.dtype)
  if count_ref:   # tests: how many key blocks this program read
    count_ref[0][...] = jnp.full((_LANES,), blocks, jnp.int32)


@functools.partial(jax.jit, static_argnames=("interpret", "count"))
def _call(q, keys_t, values, n, *, interpret: bool, count: bool = False):
  b, kh, rows, d = q.shape
  s = values.shape[2]
  bk = block_for(s)
  per_head = lambda *shape: pl.BlockSpec((None, None) + shape, lambda i, h: (i, h, 0, 0))
  lanes = pl.BlockSpec((None, _LANES), lambda i, h: (i, 0))
  out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
  out_specs = [per_head(rows, d)]
  if count:
    out_shape.append(jax.ShapeDtypeStruct((b, kh, _LANES), jnp.int32))
    out_specs.append(pl.BlockSpec((None, None, _LANES), lambda i, h: (i, h, 0)))
  return pl.pallas_call(
      functools.partial(_kernel, scale=1 / math.sqrt(d), bk=bk),
      grid=(b, kh), out_shape=out_shape,
      in_specs=[lanes, per_head(rows, d), per_head(d, s), per_head(s, d)],
      out_specs=out_specs,
      compiler_params=plgpu.CompilerParams(num_warps=4 if d <= 64 else 8, num_stages=2),
      interpret=interpret, name="decode_live")(n, q, keys_t, values)


def _prepare(q: Array, keys_t: Array, values: Array, n: Array):
  """q [B, 1, H, Dh] -> [B, K, R, Dh] (each KV head's group of query heads, zero rows up to R,
  a power of 2 of at least 16) and n [B] -> [B, 16] int32."""
  b, t, h, d = q.shape
  kh, s = keys_t.shape[1], values.shape[2]
  if t != 1:
    raise ValueError(f"decode_live attends one new token per slot, got {t}")
  if h % kh:
    raise ValueError(f"{h} query heads are not a multiple of {kh} KV heads")
  if not supports(d, s):
    raise ValueError(f"decode_live takes head_dim in 16..128 (a power of 2) and a cache length "
                     f"that a block of 16..128 tiles, got head_dim {d}, cache length {s}")
  g = h // kh
  rows = max(MIN_ROWS, 1 << (g - 1).bit_length())
  qg = q.reshape(b, kh, g, d)
  qg = jnp.pad(qg, ((0, 0), (0, 0), (0, rows - g), (0, 0))) if rows > g else qg
  # Never past the cache: a block beyond it would be read out of bounds.
  n = jnp.clip(n.astype(jnp.int32), 0, s)
  lanes = jnp.broadcast_to(n[:, None], (b, _LANES))
  return qg, lanes, g


def decode_attention(q: Array, keys_t: Array, values: Array, n: Array, *,
                     interpret: bool = False) -> Array:
  """Attention of one new query per slot, q [B, 1, H, Dh], over the first n[b] positions of its
  cache (keys_t [B, K, Dh, S], values [B, K, S, Dh]) -> [B, 1, H, Dh]; slot b reads only the
  key blocks that hold those positions. H a multiple of K (grouped-query attention)."""
  b, _, h, d = q.shape
  qg, lanes, g = _prepare(q, keys_t, values, n)
  (out,) = _call(qg, keys_t, values, lanes, interpret=interpret)
  return out[:, :, :g].reshape(b, 1, h, d)


def blocks_read(q: Array, keys_t: Array, values: Array, n: Array, *,
                interpret: bool = False) -> Array:
  """[B, K]: the key blocks each program read, counted by the kernel itself (tests check it
  against ceil(n / block))."""
  qg, lanes, _ = _prepare(q, keys_t, values, n)
  return _call(qg, keys_t, values, lanes, interpret=interpret, count=True)[1][:, :, 0]


def reference(q: Array, keys_t: Array, values: Array, n: Array) -> Array:
  """The same attention, dense, in fp32: what the tests compare the kernel with."""
  b, _, h, d = q.shape
  kh, s = keys_t.shape[1], values.shape[2]
  qg = q.reshape(b, kh, h // kh, d).astype(jnp.float32)
  scores = jnp.einsum("bkgd,bkds->bkgs", qg, keys_t.astype(jnp.float32)) / math.sqrt(d)
  keep = (jnp.arange(s)[None, :] < n[:, None])[:, None, None, :]
  p = jax.nn.softmax(jnp.where(keep, scores, -jnp.inf), axis=-1)
  p = jnp.where(keep, p, 0.0)
  out = jnp.einsum("bkgs,bksd->bkgd", p, values.astype(jnp.float32))
  return out.reshape(b, 1, h, d).astype(q.dtype)
