"""Putting prompts into slots: the programs behind the engine's prefill and insert.

A prompt reaches a slot in two steps. Prefill runs it through the model into a prompt cache of
its bucket's length; insert copies that cache into a slot of the decode state and activates the
slot. One prompt at a time (JetStream's contract):
  prefill_one -> Prefix (its cache and first token)      insert_one -> decode state
and batched (what GeneratorLoop uses):
  prefill_rows(padded [N, bucket], true_lengths [N]) -> Prefixes (N prompt caches)
  insert_rows(prefixes, state, slots, rows, keys, ...) -> decode state, first tokens
prefills N prompts of one length bucket in one call and copies them into any number of slots in
one call (several slots may share a row: the G samples of a GRPO group share one prefill), each
slot drawing its first token from the row's last-position logits with its own PRNG stream.

Each function is pure and traced inside one of the engine's jitted programs (engine.py), which
binds what it needs of the engine (model config, sharding, sampling, cache dtype and length).
The temperature is always an input, never the engine's: a slot samples at its request's.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from magistral_jax.generate import sampling as S
from magistral_jax.generate.state import (DecodeState, Prefix, Prefixes, put_rows, put_slot,
                                          start_cache)
from magistral_jax.model import paged_attention
from magistral_jax.model import transformer as T
from magistral_jax.model.config import ModelConfig
from magistral_jax.parallel.sharding import ShardingCtx


def checked_temperature(temperature, where: str) -> np.float32:
  """The caller's sampling temperature as the fp32 input of a program; > 0 or ValueError."""
  t = np.float32(temperature)
  if not t > 0:
    raise ValueError(f"{where} temperature must be > 0, got {temperature}")
  return t


def prefill_one(params, padded_tokens, true_length, key, temperature, prefix_cache=None,
                prefix_length=None, *, cfg: ModelConfig, shard: ShardingCtx,
                sampling: S.SamplingConfig, cache_dtype, cache_length: int) -> Prefix:
  """One prompt (padded [bucket], or the rest of one continuing `prefix_cache`) through the
  model: its cache, last-position logits and first token, drawn at `temperature` with `key`."""
  b = padded_tokens.shape[0]
  cache = start_cache(cfg, cache_dtype, cache_length, 1, b, prefix_cache, prefix_length)
  hidden, cache = T.decode(params, cfg, padded_tokens[None], cache, shard,
                           num_new=true_length[None], from_empty=prefix_cache is None)
  last = jax.lax.dynamic_index_in_dim(hidden[0], true_length - 1, keepdims=False)
  lg = T.logits(params, cfg, last)
  # The whole prompt's length (prefix included) is the position folded into the slot stream,
  # so a prompt continued from a cached prefix draws what its full prefill would.
  full = cache.lengths[0]
  tok, lp = S.sample(lg[None], key[None], full[None], sampling, temperature[None])
  return Prefix(cache, lg, tok[0], lp[0], key, full, temperature)


def put_prompt(cache, prompt: T.KVCache, row, slot):
  """Row `row` of prompt caches `prompt` (per layer, keys [N, K, Dh, S'] and values
  [N, K, S', Dh]) written into `slot` of the decode cache, lengths aside. A paged cache takes it
  into the pages its table gives the slot (table entries past the slot's pages are the null
  page, which takes what lies past them: padding); a per-slot cache into the slot's row."""
  if isinstance(cache, T.PagedKVCache):
    ps = cache.k[0].shape[2]
    n = -(-prompt.v[0].shape[2] // ps)
    pages = jax.lax.dynamic_index_in_dim(cache.page_table, slot, keepdims=False)[:n]
    pools = [paged_attention.write_prompt(
        kp, vp, pages, jax.lax.dynamic_index_in_dim(k, row, keepdims=False).transpose(2, 0, 1),
        jax.lax.dynamic_index_in_dim(v, row, keepdims=False).transpose(1, 0, 2))
        for kp, vp, k, v in zip(cache.k, cache.v, prompt.k, prompt.v)]
    return cache._replace(k=tuple(p[0] for p in pools), v=tuple(p[1] for p in pools))
  put = lambda big, small: put_slot(big, jax.lax.dynamic_slice_in_dim(small, row, 1, axis=0),
                                    slot)
  return cache._replace(k=tuple(map(put, cache.k, prompt.k)),
                        v=tuple(map(put, cache.v, prompt.v)))


def insert_one(prefix: Prefix, state: DecodeState, slot, cache_only=False) -> DecodeState:
  """`prefix` copied into `slot` and the slot activated; with `cache_only`, only its cache (the
  slot keeps its token, stream, temperature and activity)."""
  cache = put_prompt(state.cache, prefix.cache, 0, slot)
  cache = cache._replace(lengths=state.cache.lengths.at[slot].set(prefix.true_length))
  if cache_only:
    return state._replace(cache=cache)
  # The prefix's first token was drawn at its request's temperature: the slot goes on at it.
  return DecodeState(cache, state.tokens.at[slot].set(prefix.token),
                     state.keys.at[slot].set(prefix.key), state.active.at[slot].set(True),
                     state.temperature.at[slot].set(prefix.temperature))


def prefill_rows(params, padded_tokens, true_lengths, prefix_cache=None, prefix_length=None, *,
                 cfg: ModelConfig, shard: ShardingCtx, cache_dtype,
                 cache_length: int) -> Prefixes:
  """N prompts padded to one bucket ([N, bucket]) through the model in one call: their caches
  and last-position logits (no token is drawn: insert_rows draws one per slot)."""
  n, b = padded_tokens.shape
  cache = start_cache(cfg, cache_dtype, cache_length, n, b, prefix_cache, prefix_length)
  hidden, cache = T.decode(params, cfg, padded_tokens, cache, shard,
                           num_new=true_lengths, from_empty=prefix_cache is None)
  last = jnp.take_along_axis(hidden, (true_lengths - 1)[:, None, None], axis=1)[:, 0]
  return Prefixes(cache, T.logits(params, cfg, last), cache.lengths)


def insert_rows(prefixes: Prefixes, state: DecodeState, slots, rows, keys, sample_index, count,
                active, temperature, *, sampling: S.SamplingConfig):
  """Prefix rows `rows[j]` copied into slots `slots[j]` for the first `count` entries (the rest
  are padding, slot index = number of slots), each entry's first token drawn at `temperature`
  with stream fold_in(keys[j], sample_index[j]); `active` becomes the activity mask. Returns
  (state, first tokens, their log-probs)."""
  # The key for sample i of a request is fold_in(request_key, i).
  slot_keys = jax.vmap(jax.random.fold_in)(keys, sample_index)
  lg = prefixes.logits[rows]
  true_len = prefixes.true_length[rows]
  temps = jnp.full(slots.shape, temperature, jnp.float32)
  tok, lp = S.sample(lg, slot_keys, true_len, sampling, temps)

  # Entries past `count` are padding and never run; each real one writes one prompt cache into
  # its slot in place (the state is donated).
  cache = jax.lax.fori_loop(
      0, count, lambda i, c: put_prompt(c, prefixes.cache, rows[i], slots[i]), state.cache)
  # Padding entries carry slot index = number of slots: out of range, so these writes drop.
  put = lambda a, x: put_rows(a, slots, x)
  cache = cache._replace(lengths=put(state.cache.lengths, true_len))
  new = DecodeState(cache, put(state.tokens, tok), put(state.keys, slot_keys), active,
                    put(state.temperature, temps))
  return new, tok, lp


def slot_row(cache, slot, cache_length: int) -> T.KVCache:
  """`slot`'s cache as one prompt's (per layer, keys [1, K, Dh, S] and values [1, K, S, Dh], S =
  cache_length), lengths aside: its row of a per-slot cache, or its pages of a paged one
  gathered in order (the null page past them: padding)."""
  if isinstance(cache, T.PagedKVCache):
    pages = jax.lax.dynamic_index_in_dim(cache.page_table, slot, keepdims=False)

    def gather(pool):   # [K, P, ps, Dh] -> [K, S, Dh]
      hkv, _, ps, dh = pool.shape
      return pool[:, pages].reshape(hkv, pages.shape[0] * ps, dh)[:, :cache_length]
    return T.KVCache(tuple(gather(k).transpose(0, 2, 1)[None] for k in cache.k),
                     tuple(gather(v)[None] for v in cache.v), None)
  row = lambda x: jax.lax.dynamic_slice_in_dim(x, slot, 1, axis=0)
  return T.KVCache(tuple(map(row, cache.k)), tuple(map(row, cache.v)), None)


def extend_one(params, state: DecodeState, slot, padded_tokens, num_new, length, *,
               cfg: ModelConfig, shard: ShardingCtx, sampling: S.SamplingConfig, cache_dtype,
               cache_length: int) -> tuple[DecodeState, Array, Array]:
  """A live slot's sequence continued by `num_new` tokens (padded [bucket]) that the policy did
  not sample (a tool's result, issue #67), on top of the cache it holds: its first `length`
  positions are kept as they are (never recomputed, whatever weights made them), the new
  tokens go through the model at positions length ..., and the slot's next token is drawn from
  the last one's logits with the slot's own stream and temperature. Returns (state, that token,
  its log-prob); the slot is active."""
  row = slot_row(state.cache, slot, cache_length)
  prefix = prefill_one(params, padded_tokens, num_new, state.keys[slot], state.temperature[slot],
                       row, length, cfg=cfg, shard=shard, sampling=sampling,
                       cache_dtype=cache_dtype, cache_length=cache_length)
  return insert_one(prefix, state, slot), prefix.token, prefix.logprob
