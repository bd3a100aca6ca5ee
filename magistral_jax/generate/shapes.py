"""The bounded set of shapes the engine compiles programs for, and fitting inputs to them.

prefill and insert compile once per prompt length bucket; prefill_many and insert_many once per
(bucket, batch size), the batch sizes powers of two up to max_prefill_batch; generate once per
attention window (a step attends over the first W cache positions only, W the smallest window
holding every active slot). So the number of programs stays small and fixed, and `precompile`
compiles them all ahead.
"""
from __future__ import annotations

import bisect
import logging
from typing import Sequence

import jax
import numpy as np

from magistral_jax.generate.xla_cpu import tune_engine
from magistral_jax.generate.state import check_slots

log = logging.getLogger(__name__)


def default_buckets(max_prefill_length: int, smallest: int = 16) -> tuple[int, ...]:
  """Powers of two from `smallest` up to max_prefill_length (always included)."""
  out, b = [], smallest
  while b < max_prefill_length:
    out.append(b)
    b *= 2
  out.append(max_prefill_length)
  return tuple(out)


def default_windows(cache_length: int, n: int, multiple: int = 16) -> tuple[int, ...]:
  """n attention windows that halve from the whole cache down: S, S/2, ..., S/2^(n-1) (rounded
  up to `multiple` positions). n = 1: dense attention over the whole cache every step. Halving,
  not even spacing: on XLA:CPU a window's slice of the cache is copied before the products, so a
  window near the cache length can cost more than the dense step, while halving windows pay
  more and more (docs/design_notes.md)."""
  if n < 1:
    raise ValueError(f"the number of attention windows must be >= 1, got {n}")
  ws = {min(cache_length, -(-cache_length // 2 ** i // multiple) * multiple) for i in range(n)}
  return tuple(sorted(ws))


def prefill_buckets(requested: Sequence[int] | None, max_prefill_length: int) -> tuple[int, ...]:
  """The engine's prefill length buckets: `requested` (default: default_buckets), sorted, with
  max_prefill_length added when missing."""
  buckets = sorted(set(requested or default_buckets(max_prefill_length)))
  if buckets[-1] < max_prefill_length:
    buckets.append(max_prefill_length)
  if buckets[0] < 1 or buckets[-1] > max_prefill_length:
    raise ValueError(f"prefill_buckets {buckets} must lie in [1, max_prefill_length="
                     f"{max_prefill_length}]")
  return tuple(buckets)


def recompute_buckets(prefill_buckets: Sequence[int], max_prefill_length: int,
                      cache_length: int) -> tuple[int, ...]:
  """The buckets KV recompute (the ablation) re-prefills whole sequences in: the prefill
  buckets, then default buckets up to the cache length."""
  return tuple(prefill_buckets) + tuple(
      b for b in default_buckets(cache_length, 2 * max_prefill_length) if b > max_prefill_length)


def attention_windows(requested: Sequence[int] | int | None, cache_length: int
                      ) -> tuple[int, ...]:
  """The engine's attention windows: a number of halving windows (default_windows; None = 1,
  dense), or the given windows with the whole cache added."""
  if requested is None or isinstance(requested, (int, np.integer)):
    return default_windows(cache_length, int(requested or 1))
  windows = sorted({int(w) for w in requested} | {cache_length})
  if windows[0] < 1 or windows[-1] > cache_length:
    raise ValueError(f"attention_windows {list(requested)} must lie in [1, "
                     f"cache length {cache_length}]")
  return tuple(windows)


def prefill_batch_sizes(max_prefill_batch: int) -> tuple[int, ...]:
  """Powers of two below max_prefill_batch, and max_prefill_batch itself."""
  if max_prefill_batch < 1:
    raise ValueError(f"max_prefill_batch must be >= 1, got {max_prefill_batch}")
  sizes, n = [], 1
  while n < max_prefill_batch:
    sizes.append(n)
    n *= 2
  return tuple(sizes + [max_prefill_batch])


def split_batch(n: int, sizes: Sequence[int]) -> list[int]:
  """Splits n prompts into calls of sizes from `sizes` (largest first, no padding rows)."""
  out = []
  for size in sorted(sizes, reverse=True):
    while n >= size:
      out.append(size)
      n -= size
  return out


def smallest_fitting(sizes: Sequence[int], n: int, exceed: str) -> int:
  """The smallest of the sorted `sizes` that is >= n; ValueError "{n} {exceed} {largest}" when
  n exceeds them all (`exceed` says what n counts and what the largest size is)."""
  i = bisect.bisect_left(sizes, n)
  if i == len(sizes):
    raise ValueError(f"{n} {exceed} {sizes[-1]}")
  return sizes[i]


def pad_prompt(tokens: Sequence[int], buckets: Sequence[int], vocab_size: int, truncate: bool):
  """Validates a prompt and right-pads it to its bucket: (padded int32 [bucket], true_length,
  truncated). Longer than the largest bucket -> ValueError, or with `truncate` the *last*
  tokens that fit are kept (the end of a chat prompt is what conditions the answer) and
  truncated=True is reported."""
  tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
  if tokens.size == 0:
    raise ValueError("empty prompt: at least one token is needed to condition generation")
  if tokens.min() < 0 or tokens.max() >= vocab_size:
    raise ValueError(f"prompt token ids must lie in [0, {vocab_size}); got "
                     f"min {tokens.min()}, max {tokens.max()}")
  truncated = False
  limit = buckets[-1]
  if tokens.size > limit:
    if not truncate:
      raise ValueError(f"prompt has {tokens.size} tokens, more than max_prefill_length="
                       f"{limit}; shorten it or build the engine with truncate_prompts=True")
    log.warning("truncating a %d-token prompt to its last %d tokens", tokens.size, limit)
    tokens, truncated = tokens[-limit:], True
  padded = np.zeros((smallest_fitting(buckets, tokens.size, "tokens exceed bucket"),),
                    np.int32)
  padded[:tokens.size] = tokens
  return padded, int(tokens.size), truncated


def check_prefill_batch(padded_tokens, true_lengths, batch_sizes: Sequence[int],
                        buckets: Sequence[int]):
  """Engine.prefill_many's prompts checked: padded [N, bucket] with N one of `batch_sizes` and
  bucket one of `buckets`, true_lengths [N] in [1, bucket]. Returns them as int32 arrays."""
  padded_tokens = np.asarray(padded_tokens, np.int32)
  true_lengths = np.asarray(true_lengths, np.int32).reshape(-1)
  if padded_tokens.ndim != 2 or padded_tokens.shape[0] != true_lengths.shape[0]:
    raise ValueError(f"prefill_many wants padded_tokens [N, bucket] and true_lengths [N], got "
                     f"{padded_tokens.shape} and {true_lengths.shape}")
  n, b = padded_tokens.shape
  if n not in batch_sizes:
    raise ValueError(f"prefill_many batch of {n} prompts is not one of {tuple(batch_sizes)}; "
                     f"split it with split_batch")
  if b not in buckets:
    raise ValueError(f"prefill_many padded length {b} is not a bucket of {tuple(buckets)}")
  if true_lengths.min() < 1 or true_lengths.max() > b:
    raise ValueError(f"true_lengths {true_lengths.tolist()} outside [1, {b}]")
  return padded_tokens, true_lengths


def pad_inserts(slots, rows, keys, sample_index, n_slots: int, n_rows: int):
  """Engine.insert_many's entries checked (distinct slots in [0, n_slots), rows in [0, n_rows))
  and padded to n_slots entries, so one program serves any number of inserts: a padding entry's
  slot is n_slots (out of range: its writes drop). Returns (slots, rows, keys, sample_index)."""
  m = len(slots)
  if not 1 <= m <= n_slots:
    raise ValueError(f"insert_many got {m} entries, want 1..{n_slots}")
  slots = np.asarray(slots, np.int32)
  rows = np.asarray(rows, np.int32)
  check_slots("insert_many", slots, n_slots)
  if rows.shape != (m,) or rows.min() < 0 or rows.max() >= n_rows:
    raise ValueError(f"insert_many rows {rows.tolist()} must be {m} indices in [0, {n_rows})")
  pad = n_slots - m
  return (np.concatenate([slots, np.full((pad,), n_slots, np.int32)]),
          np.concatenate([rows, np.zeros((pad,), np.int32)]),
          np.concatenate([np.asarray(keys, np.uint32).reshape(m, 2),
                          np.zeros((pad, 2), np.uint32)]),
          np.concatenate([np.asarray(sample_index, np.int32).reshape(m),
                          np.zeros((pad,), np.int32)]))


def precompile(engine, params, buckets: Sequence[int], tune: bool, existing_prefix=None) -> None:
  """Engine.precompile: every (bucket, batch size) of prefill_many / insert_many (also continuing
  `existing_prefix`, for every bucket the rest of a prompt fits), each attention window's
  generate step, set_active, and the drain's programs (gather, the smaller engines' steps,
  scatter back), run once on a scratch decode state."""
  if tune:
    tune_engine(engine, params)
  slots = engine.max_concurrent_decodes
  state = engine.init_decode_state()
  runs = [(b, None) for b in buckets]
  if existing_prefix is not None:   # the buckets a rest of at most max_prefill - P tokens takes
    room = engine.max_prefill_length - int(np.asarray(existing_prefix.true_length))
    runs += [(b, existing_prefix) for b in buckets if 0 < room and b <= engine.bucket_for(room)]
  for b, prefix in runs:
    for n in engine.prefill_batch_sizes:
      pre = engine.prefill_many(params, np.ones((n, b), np.int32), np.ones((n,), np.int32),
                                prefix)
      # The temperature is an input of the program: any value compiles the one every loop runs.
      state, _, _ = engine.insert_many(pre, state, [0], [0], np.zeros((1, 2), np.uint32), [0],
                                       np.zeros((slots,), bool), temperature=1.0)
  for w in engine.attention_windows:
    state, _ = engine.generate(params, state, w)
  state = engine.set_active(state, np.zeros((slots,), bool))
  for n in engine.compact_sizes:
    child = engine.compact_engine(n)
    small = engine.compact(state, [0], n)
    for w in child.attention_windows:
      small, _ = child.generate(params, small, w)
    small = child.set_active(small, np.zeros((n,), bool))
    state = engine.expand(state, small, [0])
  jax.block_until_ready(state)
