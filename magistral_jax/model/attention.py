"""The attention core behind layers.Attention, and which implementation computes it.

Implementations (ModelConfig.attention_impl):
  dense      the [T, S] score matrix per head, materialised: the reference, and what a call
             whose queries fit one block uses (its matrix is then no larger than a tile, and no
             loop runs).
  blockwise  one [block_q, block_k] tile at a time with an online softmax and a recomputing
             custom VJP (model/blockwise_attention.py): memory linear in T, portable, exact up
             to summation order. Handles every mask the model builds.
  cudnn      cuDNN's flash attention on NVIDIA GPUs, for attention among one row's own tokens:
             jax.nn.dot_product_attention(implementation="cudnn") with a causal mask for one
             sequence per row (prefill from an empty cache, scoring without segment ids); for
             packed training rows (several sequences per row), cuDNN's packed layout (each
             row's segments as lengths and offsets, causal within each segment), which needs
             compute capability 9.0 (Hopper) or newer and rows of at most CUDNN_PACKED_MAX_T
             tokens (its memory grows with T^2 beyond). The public jax.nn entry point takes no
             segments, so the packed call goes through the function behind it,
             jax._src.cudnn.fused_attention_stablehlo.dot_product_attention.
  tpu_flash  jax.experimental.pallas.ops.tpu.flash_attention on TPU: causal with segment ids,
             so it takes packed training rows, and prefill from an empty cache; no sliding
             window, and T a multiple of its 128-token blocks.
  gpu_flash  our Pallas GPU flash kernel (model/flash_sparse.py; Pallas lowered through Triton on
             NVIDIA GPUs): causal with segment ids, the same calls as tpu_flash, memory linear in
             T, grouped-query attention without repeated KV heads, and block-sparse: a tile
             whose queries and keys share no sequence of a packed row is not computed, forward
             or backward, so its work is each sequence's causal triangle, not the row's. It
             takes head_dim 16..128 (a power of 2) and T a multiple of 128.
  auto       the accelerator's kernel where it applies: on NVIDIA GPUs cuDNN, and for packed rows
             that cuDNN's packed layout does not take (past CUDNN_PACKED_MAX_T tokens, or before
             Hopper) the gpu_flash kernel in half precision, once a tiny call of it has compiled
             on this machine (gpu_flash_compiles: checked once per head_dim and dtype; where it
             fails, auto says why and takes blockwise); on TPU tpu_flash. Otherwise dense while
             the queries fit one block (the score matrix is then block_q x S: already linear in
             S; decode is T = 1), and blockwise beyond.
             (GPU timings of gpu_flash, with and without its skipping, against blockwise:
             pending the next GPU session, bench/gpu_suite.sh flash.)
An implementation that does not apply to a call (the kernel of another platform, a mask it
cannot express) falls back to blockwise, so one config serves the trainer and the generators
wherever they run.

Decode (one query per slot over a KV cache of S positions): XLA builds a [1, S] score row per
head, reading the whole cache (or the engine's attention window) for every slot; "live"
(model/decode_live.py, chosen by model/decode_choice.py) reads only the positions each slot has
reached, which is
what bounds an RL batch's decode step. The TPU paged-attention kernels read a paged cache; the
cache here is contiguous per slot ([B, K, S, Dh]), so they do not apply.
"""
from __future__ import annotations

import functools
import logging
import math

import jax
import jax.numpy as jnp

from magistral_jax.model import flash_sparse
from magistral_jax.model.blockwise_attention import (NEG_INF, MaskSpec, blockwise_attention,
                                                     visible)
from magistral_jax.model.config import ATTENTION_IMPLS as IMPLS

Array = jax.Array
log = logging.getLogger(__name__)
# The default (forward) block of both Pallas flash kernels, TPU and GPU: T must be a multiple.
PALLAS_FLASH_BLOCK = 128
_HALF = (jnp.bfloat16, jnp.float16)


# ----------------------------------------------------------------------------------------------
# Masks
# ----------------------------------------------------------------------------------------------
def packed_spec(positions: Array, segments: Array | None) -> MaskSpec:
  """Training / scoring over packed rows: causal by index within the row, never across
  segments (segments None: one sequence per row); the sliding window counts positions."""
  b, t = positions.shape
  idx = jnp.broadcast_to(jnp.arange(t), (b, t))
  return MaskSpec(idx, positions, positions, segments, segments, None)


def cache_spec(positions: Array, valid_len: Array, s: int) -> MaskSpec:
  """New tokens at `positions` [B, T] over a cache of S positions of which the first
  valid_len[b] are filled: key j is at position j, so causal is j <= position."""
  b = positions.shape[0]
  return MaskSpec(positions, positions, jnp.broadcast_to(jnp.arange(s), (b, s)), None, None,
                  valid_len)


def dense_mask(spec: MaskSpec, window: int | None) -> Array:
  s = spec.k_pos.shape[1]
  return visible(spec.q_limit, spec.q_pos, spec.q_seg, jnp.arange(s), spec.k_pos, spec.k_seg,
                 spec.kv_len, window)


# ----------------------------------------------------------------------------------------------
# Choosing an implementation
# ----------------------------------------------------------------------------------------------
def platform() -> str:
  """'cpu', 'cuda', 'rocm' or 'tpu' (jax.default_backend() says 'gpu' for both GPU kinds)."""
  backend = jax.default_backend()
  if backend == "gpu":
    version = getattr(jax.devices()[0].client, "platform_version", "")
    return "rocm" if "rocm" in str(version).lower() else "cuda"
  return backend


def _window_inert(window: int | None, span: int) -> bool:
  """The sliding window masks nothing when no two tokens are `window` apart."""
  return window is None or window >= span


def cuda_capability() -> float:
  """The first device's CUDA compute capability (9.0 for Hopper); 0.0 where unknown."""
  try:
    return float(getattr(jax.devices()[0], "compute_capability", 0.0) or 0.0)
  except (TypeError, ValueError):
    return 0.0


def cudnn_applies(*, platform: str, dtype, head_dim: int, q_len: int, kv_len: int,
                  segments: bool, self_only: bool, window: int | None,
                  capability: float = 9.0) -> bool:
  """cuDNN flash takes fp16/bf16, head_dim a multiple of 8 up to 128, and here only causal
  attention among a row's own tokens (self_only: no cached prefix) with no effective sliding
  window; packed rows (segments) need its packed layout, compute capability 9.0 or newer, and
  at most CUDNN_PACKED_MAX_T tokens."""
  return (platform == "cuda" and jnp.dtype(dtype) in _HALF
          and head_dim % 8 == 0 and head_dim <= 128 and self_only
          and (not segments or (capability >= 9.0 and q_len <= CUDNN_PACKED_MAX_T))
          and q_len == kv_len and _window_inert(window, q_len))


def pallas_flash_applies(kernel_platform: str, *, platform: str, q_len: int, kv_len: int,
                         self_only: bool, window: int | None) -> bool:
  """A Pallas flash kernel of `kernel_platform` ("tpu", "cuda"): causal attention among a row's
  own tokens (segment ids allowed), no effective sliding window, T a multiple of its block."""
  return (platform == kernel_platform and self_only and q_len == kv_len
          and q_len % PALLAS_FLASH_BLOCK == 0 and _window_inert(window, q_len))


def gpu_flash_applies(*, platform: str, head_dim: int, q_len: int, kv_len: int,
                      self_only: bool, window: int | None) -> bool:
  """Our Pallas GPU kernel (model/flash_sparse.py): a Pallas flash kernel's mask, and the
  shapes it takes (head_dim a power of 2 up to 128)."""
  return (pallas_flash_applies("cuda", platform=platform, q_len=q_len, kv_len=kv_len,
                               self_only=self_only, window=window)
          and flash_sparse.supports(head_dim, q_len))


@functools.cache
def gpu_flash_compiles(head_dim: int, dtype: str) -> bool:
  """Whether the gpu_flash kernel, forward and backward, compiles on this machine for this
  head_dim and dtype: a tiny call (one packed 256-token row, two query heads over one KV
  head) is lowered and compiled once per process. Triton's limits (shared memory, the GPU's
  generation) are only known there; where it fails, auto takes blockwise attention instead
  and says why, once."""
  shape = lambda *s: jax.ShapeDtypeStruct(s, jnp.dtype(dtype))
  def fwd_bwd(q, k, v, seg):
    out, vjp = jax.vjp(lambda q, k, v: flash_sparse.flash_attention(q, k, v, seg), q, k, v)
    return vjp(out)
  try:
    jax.jit(fwd_bwd).lower(shape(1, 256, 2, head_dim), shape(1, 1, 256, head_dim),
                           shape(1, 1, 256, head_dim),
                           jax.ShapeDtypeStruct((1, 256), jnp.int32)).compile()
    return True
  except Exception as e:   # noqa: BLE001: any failure means "not here"
    log.warning("attention: the gpu_flash kernel does not compile here (head_dim %d, %s): "
                "%s: %s; auto takes blockwise attention for the packed rows it would have "
                "taken", head_dim, dtype, type(e).__name__, str(e)[:300])
    return False


def choose_impl(requested: str, *, platform: str, dtype, head_dim: int, q_len: int,
                kv_len: int, segments: bool, self_only: bool, window: int | None,
                block_q: int, capability: float = 9.0, flash_compiles: bool = True) -> str:
  """The implementation that computes one attention call: 'dense', 'blockwise', 'cudnn',
  'tpu_flash' or 'gpu_flash'. `self_only`: the queries attend to their own row's tokens only
  (training, scoring, prefill from an empty cache), not to a cache; `segments`: packed segment
  ids; `flash_compiles`: gpu_flash_compiles's answer on this machine (auto only)."""
  if requested not in IMPLS:
    raise ValueError(f"attention_impl must be one of {IMPLS}, got {requested!r}")
  if requested in ("dense", "blockwise"):
    return requested
  kw = dict(platform=platform, q_len=q_len, kv_len=kv_len, self_only=self_only, window=window)
  if requested in ("auto", "cudnn") and cudnn_applies(dtype=dtype, head_dim=head_dim,
                                                      segments=segments, capability=capability,
                                                      **kw):
    return "cudnn"
  if requested in ("auto", "tpu_flash") and pallas_flash_applies("tpu", **kw):
    return "tpu_flash"
  if requested == "gpu_flash" and gpu_flash_applies(head_dim=head_dim, **kw):
    return "gpu_flash"
  # auto: the packed rows cuDNN did not take (past its packed layout's length, or before
  # Hopper), in half precision, where the kernel compiles.
  if (requested == "auto" and segments and jnp.dtype(dtype) in _HALF and flash_compiles
      and gpu_flash_applies(head_dim=head_dim, **kw)):
    return "gpu_flash"
  if requested == "auto" and q_len <= block_q:
    return "dense"
  return "blockwise"


# ----------------------------------------------------------------------------------------------
# Implementations
# ----------------------------------------------------------------------------------------------
def dense_attention(q: Array, keys: Array, values: Array, mask: Array, keys_t: bool) -> Array:
  """The reference: q [B, T, H, Dh], keys [B, K, S, Dh] (or [B, K, Dh, S] with keys_t), values
  [B, K, S, Dh], mask [B, T, S] -> [B, T, H, Dh].

  Both products are plain batched matmuls over (b, k), with the G query heads that share a KV
  head folded into the rows: [B, K, G*T, Dh] x [B, K, S, Dh]. (On XLA:CPU this layout is faster
  than einsums over [B, T, K, G, Dh], which leave XLA to transpose around every product:
  docs/design_notes.md, "XLA:CPU and the model's layouts".) Transposed keys [B, K, Dh, S] (the per-layer cache)
  make the score product a plain [G*T, Dh] x [Dh, S] matmul per (b, k), which XLA:CPU runs faster
  at T = 1 than the [S, Dh] form."""
  b, t, h, dh = q.shape
  k = values.shape[1]
  g, sk = h // k, values.shape[2]
  dt = q.dtype
  qg = q.reshape(b, t, k, g, dh).transpose(0, 2, 3, 1, 4).reshape(b, k, g * t, dh)
  scores = jnp.einsum("bkmd,bkds->bkms" if keys_t else "bkmd,bksd->bkms", qg,
                      keys).astype(jnp.float32) / math.sqrt(dh)
  scores = jnp.where(mask[:, None, None, :, :], scores.reshape(b, k, g, t, sk), NEG_INF)
  probs = jax.nn.softmax(scores, axis=-1).astype(dt).reshape(b, k, g * t, sk)
  out = jnp.einsum("bkms,bksd->bkmd", probs, values).reshape(b, k, g, t, dh)
  return out.transpose(0, 3, 1, 2, 4).reshape(b, t, h, dh)


def cudnn_attention(q: Array, keys: Array, values: Array, implementation: str = "cudnn"
                    ) -> Array:
  """Causal self-attention of one sequence per row through jax.nn.dot_product_attention:
  q [B, T, H, Dh], keys/values [B, K, T, Dh]. `implementation` is "cudnn" on GPU ("xla" lets
  tests check this call's layout and mask on CPU)."""
  return jax.nn.dot_product_attention(q, keys.swapaxes(1, 2), values.swapaxes(1, 2),
                                      is_causal=True, implementation=implementation)


# A packed row's segments are passed to cuDNN as a fixed number of (offset, length) slots per
# row: T // CUDNN_TOKENS_PER_SEGMENT of them (at least 2), so rows whose sequences average at
# least this many tokens fit; a row with more segments than slots takes the blockwise path.
# The program's memory grows with slots x T^2 (bench/packed_attention.py, bench/train_mfu.py on a
# GPU; docs/design_notes.md, "XLA:CPU and the model's layouts"), so the packed layout is used up
# to CUDNN_PACKED_MAX_T and longer packed rows take blockwise attention (linear memory).
CUDNN_TOKENS_PER_SEGMENT = 128
CUDNN_PACKED_MAX_T = 8192


def segment_layout(segments: Array, max_segments: int) -> tuple[Array, Array, Array]:
  """Packed segment ids [B, T] (each sequence's tokens contiguous; the padding tail, id 0, is a
  run too) -> (lengths [B, M], offsets [B, M + 1], fits): cuDNN's packed layout, one entry per
  run of equal ids, -1 past a row's last run. Padding is its own segment so that every output
  position is computed (finite) like the blockwise path's, though the loss never reads it.
  `fits`: every row has at most M = max_segments runs."""
  b, t = segments.shape
  start = jnp.concatenate([jnp.ones((b, 1), bool), segments[:, 1:] != segments[:, :-1]], 1)
  count = jnp.sum(start, axis=1)
  offsets = jax.vmap(lambda r: jnp.nonzero(r, size=max_segments + 1, fill_value=-1)[0])(start)
  offsets = offsets.astype(jnp.int32)
  nxt = offsets[:, 1:]
  used = jnp.arange(max_segments)[None, :] < count[:, None]
  lengths = jnp.where(used, jnp.where(nxt >= 0, nxt, t) - offsets[:, :-1], -1)
  return lengths.astype(jnp.int32), offsets, jnp.all(count <= max_segments)


def cudnn_packed_attention(q: Array, keys: Array, values: Array, segments: Array,
                           fallback, kernel=None) -> Array:
  """Causal attention within each packed segment through cuDNN's packed layout: q [B, T, H, Dh],
  keys/values [B, K, T, Dh], segments [B, T]. Rows with more segments than the layout has slots
  run `fallback()` instead (a lax.cond: both are compiled, one runs). `kernel` replaces the
  cuDNN call (tests check the layout on CPU with a reference that reads it)."""
  t, dh = q.shape[1], q.shape[-1]
  m = max(2, t // CUDNN_TOKENS_PER_SEGMENT)
  lengths, offsets, fits = segment_layout(segments, m)
  if kernel is None:
    from jax._src.cudnn import fused_attention_stablehlo as cudnn_fa
    def kernel(q, k, v, lengths, offsets):
      return cudnn_fa.dot_product_attention(
          q, k, v, q_seqlen=lengths, kv_seqlen=lengths, q_offsets=offsets, kv_offsets=offsets,
          scale=1.0 / math.sqrt(dh), mask_type=cudnn_fa.MaskType.PADDING_CAUSAL,
          qkv_layout="BTNH")
  k, v = keys.swapaxes(1, 2), values.swapaxes(1, 2)
  return jax.lax.cond(fits, lambda: kernel(q, k, v, lengths, offsets), fallback)


def _per_shard(kernel, args, axes, shard):
  """kernel(*args), for args laid out along `axes` (logical names, "act_batch" first; the
  output is laid out as the first argument). Under a mesh it runs per shard (shard_map over the
  batch and head axes): a Pallas call is not partitioned by XLA."""
  if shard is None:
    return kernel(*args)
  from magistral_jax.parallel.sharding import logical_to_spec
  specs = tuple(logical_to_spec(a, shard.rules, x.shape, shard.mesh) for x, a in zip(args, axes))
  return jax.shard_map(kernel, mesh=shard.mesh, in_specs=specs, out_specs=specs[0],
                       check_vma=False)(*args)


def tpu_flash_attention(q: Array, keys: Array, values: Array, segments: Array | None,
                        shard=None) -> Array:
  """Causal self-attention through the Pallas TPU flash kernel: q [B, T, H, Dh], keys/values
  [B, K, T, Dh], segments [B, T] or None. The kernel wants as many KV heads as query heads, so
  each KV head is repeated over its G query heads (O(T) memory)."""
  from jax.experimental.pallas.ops.tpu import flash_attention as fa

  g = q.shape[2] // keys.shape[1]
  scale = 1.0 / math.sqrt(q.shape[-1])

  def kernel(qh, kh, vh, *seg):
    ids = fa.SegmentIds(seg[0], seg[0]) if seg else None
    return fa.flash_attention(qh, kh, vh, segment_ids=ids, causal=True, sm_scale=scale)

  heads = ("act_batch", "act_heads", None, None)
  args = (q.transpose(0, 2, 1, 3), jnp.repeat(keys, g, axis=1), jnp.repeat(values, g, axis=1))
  args += () if segments is None else (segments,)
  out = _per_shard(kernel, args, (heads,) * 3 + (("act_batch", None),), shard)
  return out.transpose(0, 2, 1, 3)


def gpu_flash_attention(q: Array, keys: Array, values: Array, segments: Array | None,
                        shard=None, *, skip: bool = True, interpret: bool = False) -> Array:
  """Causal attention within each packed segment through our Pallas GPU kernel
  (flash_sparse.flash_attention): q [B, T, H, Dh], keys/values [B, K, T, Dh] (grouped-query
  heads as they are), segments [B, T] or None. `skip` False visits every tile under the
  diagonal (the benchmark's baseline); `interpret` runs the kernels in Pallas's interpreter
  (tests on CPU). Under a mesh whose head axis divides the query heads but not the KV heads,
  each KV head is repeated over its group first, so that every shard holds whole groups."""
  q_axes, kv_axes, row_axes = ("act_batch", None, "act_heads", None), (
      "act_batch", "act_heads", None, None), ("act_batch", None)
  if segments is None:
    segments = jnp.zeros(q.shape[:2], jnp.int32)
  if shard is not None:
    from magistral_jax.parallel.sharding import logical_to_spec
    spec = lambda x, a: logical_to_spec(a, shard.rules, x.shape, shard.mesh)
    if spec(q, q_axes)[2] != spec(keys, kv_axes)[1]:
      g = q.shape[2] // keys.shape[1]
      keys, values = jnp.repeat(keys, g, axis=1), jnp.repeat(values, g, axis=1)
  kernel = functools.partial(flash_sparse.flash_attention, skip=skip, interpret=interpret)
  return _per_shard(kernel, (q, keys, values, segments), (q_axes, kv_axes, kv_axes, row_axes),
                    shard)


def attend(q: Array, keys: Array, values: Array, spec: MaskSpec, cfg, *, keys_t: bool = False,
           self_only: bool = True, shard=None) -> Array:
  """Attention of q [B, T, H, Dh] over keys/values (the layouts of dense_attention) under
  `spec`, computed by the implementation choose_impl picks for cfg and this platform.
  `self_only`: the keys are the queries' own row (training, scoring, prefill from an empty
  cache), not a cache."""
  t, s = q.shape[1], values.shape[2]
  window = cfg.sliding_window
  where = platform()
  choose = functools.partial(
      choose_impl, cfg.attention_impl, platform=where, dtype=q.dtype, head_dim=q.shape[-1],
      q_len=t, kv_len=s, segments=spec.q_seg is not None, self_only=self_only, window=window,
      block_q=cfg.attention_block_q, capability=cuda_capability() if where == "cuda" else 0.0)
  impl = choose()
  if (impl == "gpu_flash" and cfg.attention_impl == "auto"
      and not gpu_flash_compiles(q.shape[-1], jnp.dtype(q.dtype).name)):
    impl = choose(flash_compiles=False)   # checked only where auto would take the kernel
  if impl == "dense":
    return dense_attention(q, keys, values, dense_mask(spec, window), keys_t)
  if impl == "cudnn" and spec.q_seg is not None:
    return cudnn_packed_attention(
        q, keys, values, spec.q_seg,
        lambda: blockwise_attention(q, keys, values, spec, window=window,
                                    block_q=cfg.attention_block_q,
                                    block_k=cfg.attention_block_k, keys_t=keys_t))
  if impl == "cudnn":
    return cudnn_attention(q, keys, values)
  if impl == "tpu_flash":
    return tpu_flash_attention(q, keys, values, spec.q_seg, shard)
  if impl == "gpu_flash":
    return gpu_flash_attention(q, keys, values, spec.q_seg, shard)
  return blockwise_attention(q, keys, values, spec, window=window, block_q=cfg.attention_block_q,
                             block_k=cfg.attention_block_k, keys_t=keys_t)
