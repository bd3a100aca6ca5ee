"""Decode attention over a paged KV cache: one query token per slot, reading only live positions.

The cache of a layer is a pool of pages, `[kv_heads, pages, page_size, head_dim]` for keys and for
values (the layout jax's Pallas paged kernels take), and each slot owns a row of a page table
(`[slots, max_pages]` int32: which pool page holds its positions `i * page_size ...`). Slot `b`
has `lengths[b]` live positions; table entries past them point at page 0, the null page that the
allocator (generate/pages.py) never hands out, so every gather reads a valid page.

Three ways to attend, one result (tests/model/test_paged_attention.py holds them to `dense`):
  - `dense`: every slot gathers all of its `max_pages` pages and masks past its length. It reads
    what a dense cache reads: the reference, and the ablation switch.
  - `ragged`: the live pages of all slots, flattened into one list and attended a chunk of pages
    at a time by a loop that ends after the last live page, each page by its slot's query, with
    a softmax per slot across its pages (segment max and sums, merged chunk by chunk). What it
    reads follows the sum of the live lengths, not slots x the longest, in one program for any
    lengths: the CPU path, and a portable fallback.
  - `pallas_gpu` / `pallas_tpu`: jax's own paged kernels (split-K over the sequence on GPU,
    `k_splits`), run in Pallas's interpreter on CPU by the tests.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from magistral_jax.parallel.sharding import logical_to_spec

Array = jax.Array

IMPLS = ("dense", "ragged", "pallas_gpu", "pallas_tpu")
NULL_PAGE = 0   # never allocated: table entries past a slot's pages point here
# The ragged path attends this many positions' pages per loop iteration: enough work per
# iteration to hide the loop's overhead, and at most one such partial chunk read past the live
# pages per step.
CHUNK_POSITIONS = 512
# Softmax masking value: finite, so a slot with no live position gives 0, not NaN.
_MASK = -1e30


def pages_for(length, page_size: int):
  """Pages that `length` positions fill (ceil); host ints or arrays alike."""
  return (length + page_size - 1) // page_size


def chunk_pages(page_size: int) -> int:
  """The ragged path's pages per loop iteration: CHUNK_POSITIONS positions' worth."""
  return max(1, CHUNK_POSITIONS // page_size)


def _grouped(q: Array, kv_heads: int) -> Array:
  b, hq, dh = q.shape
  return q.reshape(b, kv_heads, hq // kv_heads, dh)


def dense(q: Array, k_pages: Array, v_pages: Array, page_table: Array, lengths: Array) -> Array:
  """q [B, Hq, Dh]; pages [Hkv, P, ps, Dh]; page_table [B, max_pages]; lengths [B] -> [B, Hq, Dh]."""
  hkv, _, ps, dh = k_pages.shape
  b, max_pages = page_table.shape
  k = k_pages[:, page_table].reshape(hkv, b, max_pages * ps, dh)
  v = v_pages[:, page_table].reshape(hkv, b, max_pages * ps, dh)
  qg = _grouped(q, hkv).astype(jnp.float32)
  s = jnp.einsum("bkgd,kbsd->bkgs", qg, k.astype(jnp.float32)) / math.sqrt(dh)
  live = jnp.arange(max_pages * ps)[None, :] < lengths[:, None]                # [B, S]
  s = jnp.where(live[:, None, None, :], s, _MASK)
  m = jnp.max(s, axis=-1, keepdims=True)
  p = jnp.where(live[:, None, None, :], jnp.exp(s - m), 0.0)
  l = jnp.sum(p, axis=-1, keepdims=True)
  o = jnp.einsum("bkgs,kbsd->bkgd", p, v.astype(jnp.float32)) / jnp.maximum(l, 1e-30)
  return o.reshape(q.shape).astype(q.dtype)


def flat_pages(page_table: Array, lengths: Array, n_pages: int, page_size: int, start=0):
  """Entries start ... start + n_pages of the live pages of all slots as one list (slot by slot,
  padding past the total): (pool page, its slot, its first position, is it real) per entry."""
  b, max_pages = page_table.shape
  per_slot = pages_for(lengths, page_size)
  ends = jnp.cumsum(per_slot)
  starts = ends - per_slot
  j = start + jnp.arange(n_pages)
  slot = jnp.minimum(jnp.searchsorted(ends, j, side="right"), b - 1)
  local = jnp.clip(j - starts[slot], 0, max_pages - 1)
  real = j < ends[-1]
  page = jnp.where(real, page_table[slot, local], NULL_PAGE)
  return page, slot, local * page_size, real


def ragged(q: Array, k_pages: Array, v_pages: Array, page_table: Array, lengths: Array, *,
           chunk: int | None = None) -> Array:
  """`dense`'s result reading only the live pages: the pages of all slots as one list, attended
  `chunk` pages at a time (default chunk_pages) by a loop that stops after the last live one,
  each slot's partial softmaxes merged as they come (max, sum and weighted values, rescaled to
  the running max: flash-decoding's split-K, over a list rather than per slot). The loop's trip
  count is a value, not a shape: one program serves every mix of lengths."""
  hkv, _, ps, dh = k_pages.shape
  b = q.shape[0]
  chunk = min(chunk or chunk_pages(ps), b * page_table.shape[1])   # never past dense's read
  qg = _grouped(q, hkv).astype(jnp.float32) / math.sqrt(dh)               # [B, Hkv, G, Dh]
  n_chunks = (jnp.sum(pages_for(lengths, ps)) + chunk - 1) // chunk

  def body(carry):
    i, m, l, o = carry
    page, slot, first, real = flat_pages(page_table, lengths, chunk, ps, i * chunk)
    k = k_pages[:, page].astype(jnp.float32)                               # [Hkv, n, ps, Dh]
    v = v_pages[:, page].astype(jnp.float32)
    s = jnp.einsum("nkgd,knsd->nkgs", qg[slot], k)
    live = (first[:, None] + jnp.arange(ps)[None, :] < lengths[slot][:, None]) & real[:, None]
    s = jnp.where(live[:, None, None, :], s, _MASK)
    m_new = jnp.maximum(m, jax.ops.segment_max(jnp.max(s, axis=-1), slot, num_segments=b))
    p = jnp.where(live[:, None, None, :], jnp.exp(s - m_new[slot][..., None]), 0.0)
    scale = jnp.exp(m - m_new)
    l = l * scale + jax.ops.segment_sum(jnp.sum(p, axis=-1), slot, num_segments=b)
    o = o * scale[..., None] + jax.ops.segment_sum(jnp.einsum("nkgs,knsd->nkgd", p, v), slot,
                                                   num_segments=b)
    return i + 1, m_new, l, o

  g = q.shape[1] // hkv
  init = (jnp.int32(0), jnp.full((b, hkv, g), _MASK, jnp.float32),
          jnp.zeros((b, hkv, g), jnp.float32), jnp.zeros((b, hkv, g, dh), jnp.float32))
  _, _, l, o = jax.lax.while_loop(lambda c: c[0] < n_chunks, body, init)
  o = o / jnp.maximum(l, 1e-30)[..., None]
  return o.reshape(q.shape).astype(q.dtype)


def pallas_gpu(q: Array, k_pages: Array, v_pages: Array, page_table: Array, lengths: Array, *,
               interpret: bool = False, k_splits: int = 16, pages_per_compute_block: int = 8
               ) -> Array:
  """jax's GPU paged kernel: split-K over each slot's pages (k_splits partitions). The kernel
  takes the query already scaled (it computes q.k raw)."""
  from jax.experimental.pallas.ops.gpu import paged_attention as gpu_paged
  q = (q.astype(jnp.float32) / math.sqrt(q.shape[-1])).astype(q.dtype)
  max_pages = page_table.shape[1]
  ppcb = min(pages_per_compute_block, max_pages)
  splits = max(1, min(k_splits, max_pages // ppcb))
  while max_pages % (ppcb * splits):
    splits -= 1
  return gpu_paged.paged_attention(q, k_pages, v_pages, page_table, lengths,
                                   pages_per_compute_block=ppcb, k_splits=splits,
                                   interpret=interpret)


def pallas_tpu(q: Array, k_pages: Array, v_pages: Array, page_table: Array, lengths: Array, *,
               pages_per_compute_block: int = 8) -> Array:
  """jax's TPU paged kernel (the query scaled first, as for the GPU one)."""
  from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as tpu_paged
  q = (q.astype(jnp.float32) / math.sqrt(q.shape[-1])).astype(q.dtype)
  ppcb = math.gcd(pages_per_compute_block, page_table.shape[1])
  return tpu_paged(q, k_pages, v_pages, lengths, page_table, pages_per_compute_block=ppcb)


def attend(impl: str, q: Array, k_pages: Array, v_pages: Array, page_table: Array,
           lengths: Array, *, interpret: bool = False) -> Array:
  """Decode attention by `impl` (one of IMPLS)."""
  if impl == "dense":
    return dense(q, k_pages, v_pages, page_table, lengths)
  if impl == "ragged":
    return ragged(q, k_pages, v_pages, page_table, lengths)
  if impl == "pallas_gpu":
    return pallas_gpu(q, k_pages, v_pages, page_table, lengths, interpret=interpret)
  if impl == "pallas_tpu":
    return pallas_tpu(q, k_pages, v_pages, page_table, lengths)
  raise ValueError(f"paged attention impl must be one of {IMPLS}, got {impl!r}")


class PagedStep(NamedTuple):
  """What one decode step over a paged cache needs besides the pools (model/transformer.decode
  builds it): page_table [B, max_pages]; write_pos [B], where each slot's new token goes (-1: the
  slot is idle and writes to the null page, so a page it gave back is never touched); lengths
  [B], the positions each slot attends to, its new token's included (0 for an idle slot, so the
  ragged list holds only live pages); impl (one of IMPLS, static)."""
  page_table: Array
  write_pos: Array
  lengths: Array
  impl: str


def decode_step(q: Array, k_new: Array, v_new: Array, k_pages: Array, v_pages: Array,
                step: PagedStep, shard=None) -> tuple[Array, Array, Array]:
  """One layer's decode attention on a paged cache: the new keys/values (k_new, v_new [B, Hkv,
  Dh]) are written at step.write_pos, then q [B, Hq, Dh] attends to each slot's live positions.
  Returns (out [B, Hq, Dh], k_pages, v_pages).

  With a pool per data replica both run per shard (shard_map): each replica's slots write to
  and read from its own pool, the shard of the pages it holds, so no page crosses devices (XLA,
  seeing a gather by page ids, could not know that every id is local); so do the Pallas kernels
  under any mesh (XLA does not partition them). The table numbers pages across the pools, so
  that the programs outside (prompt writes) index the whole array; here it is renumbered within
  the replica's. With one pool, dense and ragged are plain XLA, partitioned by it."""
  interpret = jax.devices()[0].platform not in ("gpu", "cuda", "tpu")

  def run(q, k_new, v_new, k_pages, v_pages, table, write_pos, lengths, first_page=0):
    table = table - first_page
    k_pages, v_pages = write_tokens(k_pages, v_pages, table, write_pos, k_new, v_new)
    return (attend(step.impl, q, k_pages, v_pages, table, lengths, interpret=interpret),
            k_pages, v_pages)

  args = (q, k_new, v_new, k_pages, v_pages, step.page_table, step.write_pos, step.lengths)
  pool = ("act_kv_heads", "cache_pages", None, None)
  if shard is None or shard.mesh.size == 1 or (
      not step.impl.startswith("pallas")
      and logical_to_spec(pool, shard.rules, k_pages.shape, shard.mesh)[1] is None):
    return run(*args)   # one pool: XLA partitions dense and ragged itself
  axes = (("cache_batch", "act_heads", None), ("cache_batch", "act_kv_heads", None),
          ("cache_batch", "act_kv_heads", None), pool, pool, ("cache_batch", None),
          ("cache_batch",), ("cache_batch",))
  specs = [logical_to_spec(a, shard.rules, x.shape, shard.mesh) for x, a in zip(args, axes)]
  if specs[3][0] is None:   # KV heads too few to split: every shard takes all the heads
    specs[:3] = [P(s[0], None, None) for s in specs[:3]]
  replica = specs[3][1]   # the mesh axes the pages are split over (None: one pool)

  def per_shard(*local):
    first = 0 if replica is None else jax.lax.axis_index(replica) * local[3].shape[1]
    return run(*local, first_page=first)
  return jax.shard_map(per_shard, mesh=shard.mesh, in_specs=tuple(specs),
                       out_specs=(specs[0], specs[3], specs[4]), check_vma=False)(*args)


def default_impl(platform: str) -> str:
  """What reads only live positions on each platform."""
  return {"gpu": "pallas_gpu", "cuda": "pallas_gpu", "tpu": "pallas_tpu"}.get(platform, "ragged")


# ----------------------------------------------------------------------------- writes

def write_tokens(k_pages: Array, v_pages: Array, page_table: Array, positions: Array,
                 k_new: Array, v_new: Array) -> tuple[Array, Array]:
  """Each slot's new token into its page: positions [B] (where the token goes, < its reserved
  pages' span), k_new/v_new [B, Hkv, Dh]. A slot without a token this step writes to the null
  page (position -1)."""
  ps = k_pages.shape[2]
  b = positions.shape[0]
  pos = jnp.maximum(positions, 0)
  page = jnp.where(positions >= 0, page_table[jnp.arange(b), pos // ps], NULL_PAGE)
  off = pos % ps
  k_pages = k_pages.at[:, page, off].set(jnp.swapaxes(k_new, 0, 1).astype(k_pages.dtype))
  v_pages = v_pages.at[:, page, off].set(jnp.swapaxes(v_new, 0, 1).astype(v_pages.dtype))
  return k_pages, v_pages


def write_prompt(k_pages: Array, v_pages: Array, pages: Array, k: Array, v: Array
                 ) -> tuple[Array, Array]:
  """A prefilled prompt's keys and values into its pages: pages [n] (pool pages, in order), k/v
  [T, Hkv, Dh] with T <= n * page_size (the tail of the last page is left as it was)."""
  hkv, _, ps, dh = k_pages.shape
  n = pages.shape[0]
  t = k.shape[0]
  pad = n * ps - t
  kk = jnp.pad(k, ((0, pad), (0, 0), (0, 0))).reshape(n, ps, hkv, dh).transpose(2, 0, 1, 3)
  vv = jnp.pad(v, ((0, pad), (0, 0), (0, 0))).reshape(n, ps, hkv, dh).transpose(2, 0, 1, 3)
  if pad:   # keep what the last page held past the prompt (a shared page's other tokens: none)
    keep = (jnp.arange(n * ps) >= t).reshape(n, ps)[None, :, :, None]
    kk = jnp.where(keep, k_pages[:, pages], kk.astype(k_pages.dtype))
    vv = jnp.where(keep, v_pages[:, pages], vv.astype(v_pages.dtype))
  return (k_pages.at[:, pages].set(kk.astype(k_pages.dtype)),
          v_pages.at[:, pages].set(vv.astype(v_pages.dtype)))


def bytes_read(impl: str, lengths, page_size: int, max_pages: int, bytes_per_position: int
               ) -> int:
  """KV bytes one decode step's attention reads per layer by `impl` (host-side accounting for the
  benchmarks: dense reads every slot's whole table, ragged the live pages rounded up to whole
  chunks, the kernels the live pages)."""
  pages = int(pages_for(np.asarray(lengths), page_size).sum())
  if impl == "dense":
    pages = len(lengths) * max_pages
  elif impl == "ragged":
    chunk = min(chunk_pages(page_size), len(lengths) * max_pages)
    pages = -(-pages // chunk) * chunk
  return pages * page_size * bytes_per_position
