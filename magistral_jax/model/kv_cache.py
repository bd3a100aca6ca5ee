"""The KV caches a decode reads and writes: per slot (KVCache: each slot's own rows, stacked or per
layer) or paged (PagedKVCache: page pools shared by all slots, and a page table per slot;
model/paged_attention.py). model/transformer.decode runs on either.
"""
from __future__ import annotations

import math
from typing import Any, Mapping, NamedTuple

import jax
import jax.numpy as jnp

from magistral_jax.model.config import ModelConfig
from magistral_jax.parallel.sharding import splits

Array = jax.Array


class KVCache(NamedTuple):
  """Per-slot KV cache. k, v: stacked [L, B, K, S, Dh], or per layer (`init_cache(...,
  per_layer=True)`): tuples of L arrays, keys transposed [B, K, Dh, S] and values [B, K, S, Dh];
  lengths: [B] tokens already in each slot. `decode` accepts either with either param layout and
  returns the cache in the form it got. The per-layer form is what the decode layout reads
  fastest (see layers.Attention: a layer of a stacked cache is copied out every step on XLA:CPU,
  and transposed keys make the T = 1 score product a plain matmul)."""
  k: Any
  v: Any
  lengths: Array


class PagedKVCache(NamedTuple):
  """A paged KV cache (model/paged_attention.py): k, v: tuples of L page pools [K, pages,
  page_size, Dh], the pages of every data replica's pool end to end; page_table [B, max_pages]:
  the pages of each slot's positions in order (its pool's null page past them), numbered across
  the pools; lengths [B] as in KVCache. Only a decode step
  (one token per slot) runs on it: prompts are prefilled into a KVCache and written into pages."""
  k: Any
  v: Any
  page_table: Array
  lengths: Array


def page_replicas(rules, sizes: Mapping[str, int]) -> int:
  """The pools a paged cache has on a mesh of `sizes` (axis name -> size): one per data replica,
  the mesh axes `cache_pages` names under `rules`."""
  return splits((math.prod(sizes.values()),), ("cache_pages",), rules, sizes)[0]


def paged_cache_logical_axes(num_layers: int) -> PagedKVCache:
  """Logical axes of a PagedKVCache's leaves: KV heads split as a per-slot cache's are, and the
  pages one pool per data replica (`cache_pages`, split as the slots are: a replica's slots hold
  pages of its own pool only; generate/paging.py hands them out so)."""
  pool = ("act_kv_heads", "cache_pages", None, None)
  return PagedKVCache(tuple(pool for _ in range(num_layers)),
                      tuple(pool for _ in range(num_layers)), ("cache_batch", None),
                      ("cache_batch",))


def init_paged_cache(cfg: ModelConfig, batch: int, num_pages: int, page_size: int,
                     max_pages: int, dtype=None) -> PagedKVCache:
  """Empty pools of num_pages pages (page 0 the null page) and an all-null page table."""
  dtype = jnp.dtype(dtype or cfg.dtype)
  shape = (cfg.num_kv_heads, num_pages, page_size, cfg.head_dim)
  pools = lambda: tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers))
  return PagedKVCache(pools(), pools(), jnp.zeros((batch, max_pages), jnp.int32),
                      jnp.zeros((batch,), jnp.int32))


def cache_logical_axes(per_layer: int | None = None):
  """Logical axes of a KVCache's leaves; per_layer=L for the per-layer form with L layers."""
  kv = ("layers", "cache_batch", "act_kv_heads", "cache_length", "head_dim")
  if per_layer:
    k_t = ("cache_batch", "act_kv_heads", "head_dim", "cache_length")
    return KVCache(tuple(k_t for _ in range(per_layer)), tuple(kv[1:] for _ in range(per_layer)),
                   ("cache_batch",))
  return KVCache(kv, kv, ("cache_batch",))


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=None,
               per_layer: bool = False) -> KVCache:
  dtype = jnp.dtype(dtype or cfg.dtype)
  shape = (batch, cfg.num_kv_heads, max_len, cfg.head_dim)
  if per_layer:   # keys transposed: [B, K, Dh, S]
    k_shape = (batch, cfg.num_kv_heads, cfg.head_dim, max_len)
    k = tuple(jnp.zeros(k_shape, dtype) for _ in range(cfg.num_layers))
    v = tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers))
  else:
    k = jnp.zeros((cfg.num_layers,) + shape, dtype)
    v = jnp.zeros((cfg.num_layers,) + shape, dtype)
  return KVCache(k, v, jnp.zeros((batch,), jnp.int32))


def is_per_layer_cache(cache: KVCache) -> bool:
  return isinstance(cache.k, (tuple, list))


def stack_cache(cache: KVCache) -> KVCache:
  """A per-layer cache in the stacked form ([L, B, K, S, Dh] keys and values); the inverse of
  `unstack_cache`."""
  if not is_per_layer_cache(cache):
    return cache
  return KVCache(jnp.stack([k.swapaxes(-1, -2) for k in cache.k]), jnp.stack(cache.v),
                 cache.lengths)


def unstack_cache(cache: KVCache) -> KVCache:
  """A stacked cache in the per-layer form (keys transposed to [B, K, Dh, S])."""
  if is_per_layer_cache(cache):
    return cache
  n = cache.k.shape[0]
  return KVCache(tuple(cache.k[l].swapaxes(-1, -2) for l in range(n)),
                 tuple(cache.v[l] for l in range(n)), cache.lengths)
