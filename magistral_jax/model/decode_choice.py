"""Which decode attention a decode step over a per-layer KV cache takes: XLA's (model/attention.py:
the whole cache, or the engine's window) or the live kernel (model/decode_live.py: the positions
each slot has reached), and the call of the kernel per shard under a mesh."""
from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp

from magistral_jax.model import decode_live
from magistral_jax.model.attention import _per_shard, _window_inert, platform
from magistral_jax.model.config import DECODE_ATTENTION

Array = jax.Array
log = logging.getLogger(__name__)


@functools.cache
def live_decode_works(head_dim: int, dtype: str) -> bool:
  """Whether the live decode kernel compiles and agrees with the dense reference on this
  machine, for this head_dim and dtype: a small call (3 slots at 0, 100 and 256 of 256
  positions, 4 query heads over 2 KV heads), once per process. Triton's limits and lowering are
  only known where it runs; where it fails or disagrees, auto keeps XLA's decode attention and
  says why, once."""
  ks = jax.random.split(jax.random.PRNGKey(0), 3)
  dt = jnp.dtype(dtype)
  q = jax.random.normal(ks[0], (3, 1, 4, head_dim), dt)
  keys_t = jax.random.normal(ks[1], (3, 2, head_dim, 256), dt)
  values = jax.random.normal(ks[2], (3, 2, 256, head_dim), dt)
  n = jnp.array([0, 100, 256], jnp.int32)
  try:
    run = jax.jit(functools.partial(decode_live.decode_attention,
                                    interpret=platform() != "cuda"))
    got = run(q, keys_t, values, n).astype(jnp.float32)
    want = decode_live.reference(q.astype(jnp.float32), keys_t, values, n)
    err = float(jnp.max(jnp.abs(got - want)))
    tol = 1e-4 if dt == jnp.float32 else 3e-2
    if not err <= tol:
      raise ValueError(f"max |error| {err:.2e} against the dense reference (tolerance {tol})")
    return True
  except Exception as e:   # noqa: BLE001: any failure means "not here"
    log.warning("attention: the live decode kernel does not work here (head_dim %d, %s): "
                "%s: %s; auto keeps XLA's decode attention", head_dim, dtype,
                type(e).__name__, str(e)[:300])
    return False


def choose_decode(requested: str, *, platform: str, head_dim: int, new_tokens: int,
                  cache_length: int, window: int | None, compiles: bool = True) -> str:
  """'live' or 'xla' for a decode call over a per-layer cache: live takes one new token per
  slot, the kernel's shapes (decode_live.supports) and no effective sliding window; auto takes
  it on NVIDIA GPUs where it works (`compiles`: live_decode_works's answer). An explicit 'live'
  that does not apply is an error (it would silently read the whole cache)."""
  if requested not in DECODE_ATTENTION:
    raise ValueError(f"decode_attention must be one of {DECODE_ATTENTION}, got {requested!r}")
  fits = (new_tokens == 1 and decode_live.supports(head_dim, cache_length)
          and _window_inert(window, cache_length))
  if requested == "live" and not fits:
    raise ValueError(f"decode_attention='live' takes one new token per slot, head_dim in 16..128 "
                     f"(a power of 2), a cache length that a block of 16..128 tiles and no "
                     f"sliding window shorter than the cache; got {new_tokens} token(s), "
                     f"head_dim {head_dim}, cache length {cache_length}, window {window}")
  if requested == "live" or (requested == "auto" and fits and platform == "cuda" and compiles):
    return "live"
  return "xla"


def decode_impl(cfg, q: Array, cache_length: int) -> str:
  """choose_decode for cfg and this platform, for queries q [B, T, H, Dh] over a cache of
  cache_length positions (the compile check runs only where auto would take the kernel)."""
  return decode_choice(cfg, q.shape[-1], q.shape[1], cache_length, q.dtype)


def decode_choice(cfg, head_dim: int, new_tokens: int, cache_length: int, dtype) -> str:
  """decode_impl from shapes: what an engine's decode steps (new_tokens 1) will use."""
  choose = functools.partial(choose_decode, cfg.decode_attention, platform=platform(),
                             head_dim=head_dim, new_tokens=new_tokens,
                             cache_length=cache_length, window=cfg.sliding_window)
  impl = choose()
  if impl == "live" and cfg.decode_attention == "auto" and not live_decode_works(
      head_dim, jnp.dtype(dtype).name):
    impl = choose(compiles=False)
  return impl


def live_decode(q: Array, keys_t: Array, values: Array, n: Array, shard=None) -> Array | None:
  """decode_live.decode_attention of q [B, 1, H, Dh] over a per-layer cache (keys_t
  [B, K, Dh, S], values [B, K, S, Dh]), slot b attending to its first n[b] positions; per shard
  under a mesh (slots and heads split alike). None where the mesh splits the query heads and
  the KV heads differently or splits a cache's length or head_dim: the caller keeps XLA's."""
  interpret = platform() != "cuda"   # Pallas's interpreter: the tests on CPU
  q_axes = ("cache_batch", None, "act_heads", None)
  kt_axes = ("cache_batch", "act_kv_heads", "head_dim", "cache_length")
  v_axes = ("cache_batch", "act_kv_heads", "cache_length", "head_dim")
  if shard is not None:
    from magistral_jax.parallel.sharding import logical_to_spec
    spec = lambda x, a: tuple(logical_to_spec(a, shard.rules, x.shape, shard.mesh))
    sq, st, sv = spec(q, q_axes), spec(keys_t, kt_axes), spec(values, v_axes)
    pad = lambda t: t + (None,) * (4 - len(t))
    sq, st, sv = pad(sq), pad(st), pad(sv)
    if sq[2] != st[1] or st[2:] != (None, None) or sv[2:] != (None, None):
      return None
  kernel = functools.partial(decode_live.decode_attention, interpret=interpret)
  return _per_shard(kernel, (q, keys_t, values, n), (q_axes, kt_axes, v_axes, ("cache_batch",)),
                    shard)
