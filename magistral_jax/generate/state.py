"""The arrays the engine's programs take and return: prompt caches (Prefix, Prefixes), the decode
state of all slots, one step's results; the row writes and slot checks they share; and the
cache a prefill starts from (empty, or continuing an existing prefix: JetStream's prefix
caching).

Every KV cache here is per layer (T.init_cache(per_layer=True)): keys [B, K, Dh, S] and values
[B, K, S, Dh] for each layer, so a decode step reads each layer's cache without copying it out
of a layer stack first.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from magistral_jax.model import transformer as T
from magistral_jax.model.config import ModelConfig
from magistral_jax.parallel.sharding import ShardingCtx, is_logical_axes

Array = jax.Array


class Prefix(NamedTuple):
  """One prefilled prompt. cache: per-layer KVCache with batch 1 and the bucket's length;
  logits: [V] fp32 at the last prompt position (kept so group members can draw their own first
  token); token/logprob: the first sampled token; key: the slot's PRNG stream; true_length: prompt
  tokens in the cache; temperature: fp32 scalar, the one its request asked for (the first token
  was drawn at it, and `insert` gives it to the slot, which samples every later token at it)."""
  cache: T.KVCache
  logits: Array
  token: Array
  logprob: Array
  key: Array
  true_length: Array
  temperature: Array


class Prefixes(NamedTuple):
  """N prefilled prompts of one bucket (from prefill_many). cache: per-layer KVCache,
  L x [N, K, Dh, bucket] keys and [N, K, bucket, Dh] values (lengths = true lengths); logits:
  [N, V] fp32 at each prompt's last position; true_length [N].
  No token is drawn yet: insert_many draws one per slot, with that slot's stream."""
  cache: T.KVCache
  logits: Array
  true_length: Array


class DecodeState(NamedTuple):
  """All slots. cache: per-layer KVCache, L x [B, K, Dh, S] keys and [B, K, S, Dh] values;
  tokens [B]: the next input token of each slot (sampled, not yet in the cache); keys [B, 2]:
  per-slot PRNG keys; active [B] bool; temperature [B] fp32: each slot's sampling temperature
  (set when its sample is inserted, so one engine's programs serve any temperature)."""
  cache: T.KVCache
  tokens: Array
  keys: Array
  active: Array
  temperature: Array


class ResultTokens(NamedTuple):
  """One decode step, per slot: the sampled token, its log-prob, whether the slot was active
  (valid), the slot's sequence length in the cache, and whether its logits were all finite."""
  tokens: Array
  logprobs: Array
  valid: Array
  lengths: Array
  finite: Array


def empty_state(cfg: ModelConfig, slots: int, cache_length: int, dtype,
                pages: tuple[int, int] | None = None) -> DecodeState:
  """The decode state of `slots` free slots: an empty cache of cache_length positions each, or
  with `pages` = (pool pages, page size) an empty paged cache whose table spans cache_length."""
  if pages is None:
    cache = T.init_cache(cfg, slots, cache_length, dtype, per_layer=True)
  else:
    num_pages, page_size = pages
    cache = T.init_paged_cache(cfg, slots, num_pages, page_size,
                               -(-cache_length // page_size), dtype)
  return DecodeState(cache,
                     jnp.zeros((slots,), jnp.int32), jnp.zeros((slots, 2), jnp.uint32),
                     jnp.zeros((slots,), bool),
                     # A free slot's draws are discarded; each insert sets its request's.
                     jnp.ones((slots,), jnp.float32))


def state_shardings(shard: ShardingCtx, shapes: DecodeState) -> DecodeState:
  """The shardings of a decode state of `shapes` (slots along the cache_batch axis)."""
  slots = shapes.tokens.shape[0]
  axes = (T.paged_cache_logical_axes(len(shapes.cache.k))
          if isinstance(shapes.cache, T.PagedKVCache)
          else T.cache_logical_axes(per_layer=len(shapes.cache.k)))
  cache = jax.tree.map(lambda ax, s: shard.sharding(ax, s.shape), axes, shapes.cache,
                       is_leaf=is_logical_axes)
  batch = shard.sharding(("cache_batch",), (slots,))
  return DecodeState(cache, batch, shard.sharding(("cache_batch", None), (slots, 2)), batch,
                     batch)


def put_rows(a: Array, idx: Array, x: Array) -> Array:
  """a[idx[j]] = x[j] along axis 0; out-of-range indices (the padding convention: index = number
  of slots) are dropped."""
  return a.at[idx].set(x.astype(a.dtype), mode="drop")


def put_slot(layer_cache: Array, row: Array, slot) -> Array:
  """One layer's keys [slots, K, Dh, S] or values [slots, K, S, Dh] with a prompt's cache row
  ([1, K, Dh, bucket] or [1, K, bucket, Dh]) written at `slot` (positions 0..bucket-1); in place
  when the cache is donated."""
  return jax.lax.dynamic_update_slice(layer_cache, row.astype(layer_cache.dtype), (slot, 0, 0, 0))


def check_slots(what: str, slots: np.ndarray, n_slots: int) -> None:
  """Raises ValueError unless `slots` are distinct slot indices in [0, n_slots)."""
  if slots.size and (slots.min() < 0 or slots.max() >= n_slots
                     or len(set(slots.tolist())) != slots.size):
    raise ValueError(f"{what} slots {slots.tolist()} must be distinct, in [0, {n_slots})")


def start_cache(cfg: ModelConfig, dtype, cache_length: int, n: int, b: int, prefix_cache=None,
                prefix_length=None) -> T.KVCache:
  """The per-layer cache a prefill of n prompts padded to b tokens writes into: empty, of
  length b; or, continuing an existing prefix (one prompt's cache, positions [0, P) real of
  its Pp), that prefix copied into every row, lengths P, and room for b more positions
  (length min(Pp + b, cache_length): positions past it are padding, whose writes drop)."""
  if prefix_cache is None:
    return T.init_cache(cfg, n, b, dtype, per_layer=True)
  pp = prefix_cache.v[0].shape[2]
  length = min(pp + b, cache_length)

  def grow(x, axis):   # [1, ...] -> [n, ...], padded with zeros to `length` positions on axis
    x = jnp.broadcast_to(x.astype(dtype), (n,) + x.shape[1:])
    return jnp.pad(x, [(0, length - pp) if a == axis else (0, 0) for a in range(x.ndim)])
  return T.KVCache(tuple(grow(k, 3) for k in prefix_cache.k),
                   tuple(grow(v, 2) for v in prefix_cache.v),
                   jnp.broadcast_to(prefix_length.astype(jnp.int32), (n,)))


def existing_prefix_cache(existing_prefix, longest: int, cfg: ModelConfig, max_prefill: int):
  """(cache, true length) of a prefix to continue, validated: one prompt's, of model `cfg`, and
  the prompt it starts plus `longest` new tokens must fit max_prefill tokens."""
  if not isinstance(existing_prefix, (Prefix, Prefixes)):
    raise TypeError(f"existing_prefix must be a Prefix from prefill(), got "
                    f"{type(existing_prefix).__name__}")
  cache = existing_prefix.cache
  n_rows = cache.v[0].shape[0]
  p = np.asarray(existing_prefix.true_length).reshape(-1)
  if n_rows != 1 or p.size != 1:
    raise ValueError(f"existing_prefix must hold one prompt's cache, got {n_rows} rows")
  if len(cache.k) != cfg.num_layers or cache.v[0].shape[1:] != (
      cfg.num_kv_heads, cache.v[0].shape[2], cfg.head_dim):
    raise ValueError("existing_prefix's cache does not match this engine's model")
  if int(p[0]) + longest > max_prefill:
    raise ValueError(f"existing prefix of {int(p[0])} tokens + {longest} new tokens exceeds "
                     f"max_prefill_length={max_prefill}")
  return cache, jnp.asarray(p[0], jnp.int32)
