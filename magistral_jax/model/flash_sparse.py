"""Flash attention over packed rows that visits only the tiles where a sequence meets itself.

A packed training row holds many sequences one after another (segment ids [B, T]), and each
token attends causally to its own sequence only. A flash kernel that masks by segment but loops
over every key block up to the diagonal does the work of the row's whole causal triangle,
T^2 / 2 scores, though the mask keeps only sum(len_i^2) / 2 of them: with 25 sequences in a 32K
row that is about 25x more tiles than can hold anything. Here a (query block, key block) tile is
computed only if some query and key in it share a segment and the key is not after the query:

  forward, dq   the query block [i*bq, (i+1)*bq) loops over key blocks from the one holding the
                first token of its first token's sequence to the diagonal;
  dk, dv        the key block [j*bk, (j+1)*bk) loops over query blocks from the diagonal to the
                one holding the last token of its last token's sequence.

Segments are contiguous runs of equal ids in a packed row, so those two indices bound every
tile that can interact, and every tile between them does (each key there belongs to one of the
query block's sequences). A row's segments are numbered by run here (segment_runs): two runs with
the same id (which packing does not produce) are two sequences, as in cuDNN's packed layout.

The kernels are Pallas, lowered through Triton on NVIDIA GPUs (and run by Pallas's interpreter
in the tests on CPU), written after FlashAttention-2 (Dao, 2023): an online softmax in base 2
with fp32 accumulators, and a backward that recomputes each tile's probabilities from the
forward's log-sum-exp, in two kernels: dq (one program per query block) and dk/dv (one program
per key block and KV head, looping over the G query heads of its group, so grouped-query
attention needs no repeated keys and no sum over repeated gradients). `skip=False` runs the
same kernels over the whole causal triangle: the baseline bench/packed_attention.py times.
GPU timings are pending the next GPU session (bench/gpu_suite.sh flash).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

Array = jax.Array
LOG2E = math.log2(math.e)
# Masked scores: finite, so that a row with nothing visible yet subtracts no -inf from -inf.
MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)


@dataclasses.dataclass(frozen=True)
class Blocks:
  """Tile sizes (powers of 2, at least 16: Triton's dot) of the forward and the backward
  kernels, and the Triton launch parameters (num_warps None: 4 up to head_dim 64, else 8)."""
  q: int = 128
  k: int = 64
  bwd_q: int = 64
  bwd_k: int = 64
  num_warps: int | None = None
  num_stages: int = 2

  @property
  def multiple(self) -> int:
    """T must be a multiple of this (every kernel's blocks tile the row)."""
    return max(self.q, self.k, self.bwd_q, self.bwd_k)


def supports(head_dim: int, t: int, blocks: Blocks = Blocks()) -> bool:
  """Shapes the kernels take: head_dim a power of 2 from 16 to 128, T a multiple of the
  blocks."""
  return head_dim in (16, 32, 64, 128) and t % blocks.multiple == 0


# ----------------------------------------------------------------------------------------------
# Which tiles are visited
# ----------------------------------------------------------------------------------------------
def segment_runs(segments: Array) -> tuple[Array, Array, Array]:
  """Packed segment ids [B, T] -> (runs, first, end), int32 [B, T]: each token's run number
  along the row (what the kernels mask by), the index of its run's first token, and one past
  its run's last token."""
  b, t = segments.shape
  idx = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  change = segments[:, 1:] != segments[:, :-1]
  starts = jnp.concatenate([jnp.ones((b, 1), bool), change], axis=1)
  ends = jnp.concatenate([change, jnp.ones((b, 1), bool)], axis=1)
  runs = jnp.cumsum(starts, axis=1, dtype=jnp.int32)
  first = lax.cummax(jnp.where(starts, idx, 0), axis=1)
  end = lax.cummin(jnp.where(ends, idx + 1, t), axis=1, reverse=True)
  return runs, first, end


def _ceil_div(x, d: int):
  return lax.div(x + (d - 1), d)   # `//` on Triton's scalars does not lower


def key_blocks(i, first, bq: int, bk: int, skip: bool):
  """Key blocks [lo, hi) that query block i visits; `first`: its tokens' run starts."""
  hi = _ceil_div((i + 1) * bq, bk)                 # up to the diagonal
  return (lax.div(jnp.min(first), bk) if skip else 0), hi


def query_blocks(j, end, bq: int, bk: int, n_q: int, skip: bool):
  """Query blocks [lo, hi) that key block j is visited by; `end`: its tokens' run ends."""
  lo = lax.div(j * bk, bq)                         # from the diagonal
  return lo, (_ceil_div(jnp.max(end), bq) if skip else n_q)


def tile_counts(segments: Array, bq: int, bk: int, skip: bool = True) -> tuple[Array, Array]:
  """(key blocks each query block visits [B, T / bq], query blocks each key block is visited
  by [B, T / bk]): the kernels' loop lengths, from the same bounds."""
  b, t = segments.shape
  _, first, end = segment_runs(segments)
  qi, kj = jnp.arange(t // bq), jnp.arange(t // bk)
  def per_row(first, end):
    lo, hi = jax.vmap(lambda i, f: key_blocks(i, f, bq, bk, skip))(qi, first.reshape(-1, bq))
    lo2, hi2 = jax.vmap(lambda j, e: query_blocks(j, e, bq, bk, t // bq, skip))(
        kj, end.reshape(-1, bk))
    return hi - lo, hi2 - lo2
  return jax.vmap(per_row)(first, end)


# ----------------------------------------------------------------------------------------------
# Kernels. Scores are kept in base 2 (s * log2(e)), so every exponential is an exp2.
# ----------------------------------------------------------------------------------------------
def _dot(a, b, a_t=False, b_t=False):
  """a @ b with either operand transposed, accumulated in fp32."""
  dims = (((0,) if a_t else (1,)), ((1,) if b_t else (0,)))
  return lax.dot_general(a, b, (dims, ((), ())), preferred_element_type=jnp.float32)


def _visible(q_idx, q_run, k_idx, k_run):
  """[bq, bk]: the key is in the query's run and not after it."""
  return (q_run[:, None] == k_run[None, :]) & (q_idx[:, None] >= k_idx[None, :])


def _forward_kernel(runs_ref, first_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *count_ref,
                    scale, bq, bk, skip):
  i = pl.program_id(0)
  rows = pl.ds(i * bq, bq)
  q = q_ref[...]
  q_idx, q_run = i * bq + jnp.arange(bq), runs_ref[rows]
  lo, hi = key_blocks(i, first_ref[rows], bq, bk, skip)

  def tile(j, carry):
    acc, m, l = carry
    cols = pl.ds(j * bk, bk)
    s = _dot(q, k_ref[cols, :], b_t=True) * (scale * LOG2E)
    keep = _visible(q_idx, q_run, j * bk + jnp.arange(bk), runs_ref[cols])
    m_new = jnp.maximum(m, jnp.max(jnp.where(keep, s, MASKED), axis=1))
    p = jnp.where(keep, jnp.exp2(s - m_new[:, None]), 0.0)
    rescale = jnp.exp2(m - m_new)                  # the running sums were relative to m
    v = v_ref[cols, :]
    acc = acc * rescale[:, None] + _dot(p.astype(v.dtype), v)
    return acc, m_new, l * rescale + jnp.sum(p, axis=1)

  init = (jnp.zeros(q.shape, jnp.float32), jnp.full((bq,), MASKED, jnp.float32),
          jnp.zeros((bq,), jnp.float32))
  # Every query sees itself, in the diagonal block: l > 0.
  acc, m, l = lax.fori_loop(lo, hi, tile, init)
  o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)
  lse_ref[...] = m + jnp.log2(l)
  if count_ref:   # tests: how many key blocks this query block visited
    count_ref[0][...] = jnp.full((bq,), hi - lo, jnp.int32)


def _dq_kernel(runs_ref, first_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref,
               *, scale, bq, bk, skip):
  i = pl.program_id(0)
  rows = pl.ds(i * bq, bq)
  q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]
  q_idx, q_run = i * bq + jnp.arange(bq), runs_ref[rows]
  lo, hi = key_blocks(i, first_ref[rows], bq, bk, skip)

  def tile(j, dq):
    cols = pl.ds(j * bk, bk)
    k, v = k_ref[cols, :], v_ref[cols, :]
    s = _dot(q, k, b_t=True) * (scale * LOG2E)
    keep = _visible(q_idx, q_run, j * bk + jnp.arange(bk), runs_ref[cols])
    p = jnp.where(keep, jnp.exp2(s - lse[:, None]), 0.0)
    ds = p * (_dot(do, v, b_t=True) - delta[:, None])   # d(loss)/d(score), unscaled
    return dq + _dot(ds.astype(k.dtype), k)

  dq = lax.fori_loop(lo, hi, tile, jnp.zeros(q.shape, jnp.float32))
  dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def _dkv_kernel(runs_ref, end_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref,
                dv_ref, *, scale, bq, bk, skip, groups, n_q):
  j = pl.program_id(0)
  cols = pl.ds(j * bk, bk)
  k, v = k_ref[...], v_ref[...]
  k_idx, k_run = j * bk + jnp.arange(bk), runs_ref[cols]
  lo, hi = query_blocks(j, end_ref[cols], bq, bk, n_q, skip)
  dk = dv = jnp.zeros(k.shape, jnp.float32)
  for g in range(groups):   # the query heads that share this KV head

    def tile(i, carry, g=g):
      dk, dv = carry
      rows = pl.ds(i * bq, bq)
      q, do = q_ref[rows, g, :], do_ref[rows, g, :]
      s = _dot(q, k, b_t=True) * (scale * LOG2E)
      keep = _visible(i * bq + jnp.arange(bq), runs_ref[rows], k_idx, k_run)
      p = jnp.where(keep, jnp.exp2(s - lse_ref[g, rows][:, None]), 0.0)
      ds = p * (_dot(do, v, b_t=True) - delta_ref[g, rows][:, None])
      return dk + _dot(ds.astype(q.dtype), q, a_t=True), dv + _dot(p.astype(do.dtype), do,
                                                                   a_t=True)

    dk, dv = lax.fori_loop(lo, hi, tile, (dk, dv))
  dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


# ----------------------------------------------------------------------------------------------
# The calls: q, do, o [B, T, H, D]; k, v [B, K, T, D]; lse, delta [B, H, T]; runs etc. [B, T]
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Static:
  blocks: Blocks
  skip: bool
  interpret: bool


def _params(blocks: Blocks, head_dim: int):
  warps = blocks.num_warps or (4 if head_dim <= 64 else 8)
  return plgpu.CompilerParams(num_warps=warps, num_stages=blocks.num_stages)


def _row(t):
  return pl.BlockSpec((None, t), lambda i, b, h: (b, 0))


def _forward(q, k, v, runs, first, st: _Static, count: bool = False):
  b, t, h, d = q.shape
  groups, bq, bk = h // k.shape[1], st.blocks.q, st.blocks.k
  q_block = pl.BlockSpec((None, bq, None, d), lambda i, b, h: (b, i, h, 0))
  kv_all = pl.BlockSpec((None, None, t, d), lambda i, b, h: (b, lax.div(h, groups), 0, 0))
  per_row = pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i))
  out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype),
               jax.ShapeDtypeStruct((b, h, t), jnp.float32)]
  if count:
    out_shape.append(jax.ShapeDtypeStruct((b, h, t), jnp.int32))
  kernel = functools.partial(_forward_kernel, scale=1 / math.sqrt(d), bq=bq, bk=bk,
                             skip=st.skip)
  return pl.pallas_call(
      kernel, grid=(t // bq, b, h), out_shape=out_shape,
      in_specs=[_row(t), _row(t), q_block, kv_all, kv_all],
      out_specs=[q_block, per_row] + [per_row] * count,
      compiler_params=_params(st.blocks, d), interpret=st.interpret,
      name="flash_sparse_forward")(runs, first, q, k, v)


def _backward(q, k, v, runs, first, end, o, lse, do, st: _Static):
  b, t, h, d = q.shape
  kh = k.shape[1]
  groups, bq, bk = h // kh, st.blocks.bwd_q, st.blocks.bwd_k
  delta = jnp.einsum("bthd,bthd->bht", o.astype(jnp.float32), do.astype(jnp.float32))
  scale = 1 / math.sqrt(d)
  params = _params(st.blocks, d)

  q_block = pl.BlockSpec((None, bq, None, d), lambda i, b, h: (b, i, h, 0))
  kv_all = pl.BlockSpec((None, None, t, d), lambda i, b, h: (b, lax.div(h, groups), 0, 0))
  per_row = pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i))
  dq = pl.pallas_call(
      functools.partial(_dq_kernel, scale=scale, bq=bq, bk=bk, skip=st.skip),
      grid=(t // bq, b, h), out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      in_specs=[_row(t), _row(t), q_block, kv_all, kv_all, q_block, per_row, per_row],
      out_specs=q_block, compiler_params=params, interpret=st.interpret,
      name="flash_sparse_dq")(runs, first, q, k, v, do, lse, delta)

  group_all = pl.BlockSpec((None, t, groups, d), lambda j, b, g: (b, 0, g, 0))
  group_rows = pl.BlockSpec((None, groups, t), lambda j, b, g: (b, g, 0))
  kv_block = pl.BlockSpec((None, None, bk, d), lambda j, b, g: (b, g, j, 0))
  dk, dv = pl.pallas_call(
      functools.partial(_dkv_kernel, scale=scale, bq=bq, bk=bk, skip=st.skip, groups=groups,
                        n_q=t // bq),
      grid=(t // bk, b, kh), out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype),
                                        jax.ShapeDtypeStruct(v.shape, v.dtype)],
      in_specs=[_row(t), _row(t), group_all, kv_block, kv_block, group_all, group_rows,
                group_rows],
      out_specs=[kv_block, kv_block], compiler_params=params, interpret=st.interpret,
      name="flash_sparse_dkv")(runs, end, q, k, v, do, lse, delta)
  return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _attention(q, k, v, runs, first, end, st: _Static):
  return _forward(q, k, v, runs, first, st)[0]


def _attention_fwd(q, k, v, runs, first, end, st):
  o, lse = _forward(q, k, v, runs, first, st)
  return o, (q, k, v, runs, first, end, o, lse)


def _attention_bwd(st, res, do):
  q, k, v, runs, first, end, o, lse = res
  return _backward(q, k, v, runs, first, end, o, lse, do, st) + (None, None, None)


_attention.defvjp(_attention_fwd, _attention_bwd)


def _prepare(q, k, segments, blocks):
  b, t, h, d = q.shape
  if h % k.shape[1]:
    raise ValueError(f"{h} query heads are not a multiple of {k.shape[1]} KV heads")
  if not supports(d, t, blocks):
    raise ValueError(f"flash_sparse takes head_dim in 16..128 (a power of 2) and T a multiple "
                     f"of {blocks.multiple}, got head_dim {d}, T {t}")
  if segments is None:   # one sequence per row
    segments = jnp.zeros((b, t), jnp.int32)
  return segment_runs(segments)


def flash_attention(q: Array, keys: Array, values: Array, segments: Array | None, *,
                    skip: bool = True, blocks: Blocks = Blocks(),
                    interpret: bool = False) -> Array:
  """Causal attention within each packed segment: q [B, T, H, D], keys/values [B, K, T, D]
  (H a multiple of K: grouped-query attention), segments [B, T] or None (one sequence per row)
  -> [B, T, H, D], differentiable in q, keys and values. `skip`: visit only the tiles where a
  segment meets itself (False: the whole causal triangle, masked)."""
  runs, first, end = _prepare(q, keys, segments, blocks)
  return _attention(q, keys, values, runs, first, end, _Static(blocks, skip, interpret))


def visited_key_blocks(q: Array, keys: Array, values: Array, segments: Array | None, *,
                       skip: bool = True, blocks: Blocks = Blocks(),
                       interpret: bool = False) -> Array:
  """[B, H, T / blocks.q]: the key blocks the forward kernel's loop ran over, per query block,
  counted by the kernel itself (tests check it against tile_counts)."""
  runs, first, _ = _prepare(q, keys, segments, blocks)
  counts = _forward(q, keys, values, runs, first, _Static(blocks, skip, interpret), count=True)
  return counts[2][:, :, ::blocks.q]
