"""Drain compaction: running the last active sequences of a batch on fewer slots.

A step costs about the same however many slots are active (every slot computes), so when only a
few sequences are left (the drain at the end of a batch), running them on fewer slots is
cheaper (on CPU a step at half or a quarter of the slots takes clearly less time:
docs/design_notes.md). `Compaction.compact` gathers the active slots into the decode state of a
smaller engine (`child(n)`: same config and mesh, n slots, its own compiled step); `expand`
writes them back. Each sequence keeps its cache, tokens, PRNG stream and length, so the tokens
are the ones the full-size step would have produced (to fp32 rounding of a different batch
shape). `Drain` is the loop's side: when to compact, stepping the compacted state, and writing
it back when new work arrives.
"""
from __future__ import annotations

from functools import partial
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from magistral_jax.generate.state import DecodeState, check_slots, put_rows
from magistral_jax.model import transformer as T


def compaction_sizes(requested: Sequence[int] | None, slots: int, slot_shards: int
                  ) -> tuple[int, ...]:
  """The compaction sizes of an engine with `slots` slots split into `slot_shards` shards over
  its mesh: `requested` (default: half and a quarter of the slots), largest first, keeping those
  that divide evenly over the shards."""
  if requested is None:
    requested = [n for n in (slots // 2, slots // 4) if n >= 1]
  sizes = sorted({int(n) for n in requested}, reverse=True)
  for n in sizes:
    if not 1 <= n < slots:
      raise ValueError(f"compact_sizes {list(requested)} must lie in [1, {slots - 1}]")
  return tuple(n for n in sizes if n % slot_shards == 0)


def _gather(state: DecodeState, idx, valid) -> DecodeState:
  take = lambda a: jnp.take(a, idx, axis=0)
  if isinstance(state.cache, T.PagedKVCache):   # the pools move as they are: a table gather
    cache = state.cache._replace(page_table=take(state.cache.page_table),
                                 lengths=take(state.cache.lengths))
  else:
    cache = T.KVCache(tuple(map(take, state.cache.k)), tuple(map(take, state.cache.v)),
                      take(state.cache.lengths))
  return DecodeState(cache, take(state.tokens), take(state.keys), take(state.active) & valid,
                     take(state.temperature))


def _without_pools(state: DecodeState) -> DecodeState:
  return state._replace(cache=state.cache._replace(k=(), v=()))


def _gather_paged(pools, state: DecodeState, idx, valid) -> DecodeState:
  """_gather of a paged state whose pools (k, v) come apart, to be donated: they move."""
  small = _gather(state, idx, valid)
  return small._replace(cache=small.cache._replace(k=pools[0], v=pools[1]))


def _scatter_paged(pools, small: DecodeState, idx, slots: int) -> DecodeState:
  """The full-size state of a paged engine from its compacted one: the pools (donated) come back
  as they are, the compacted rows to their slots, every other slot free (none holds a sample)."""
  def put(a, fill=0):
    return put_rows(jnp.full((slots,) + a.shape[1:], fill, a.dtype), idx, a)
  cache = small.cache._replace(k=pools[0], v=pools[1], page_table=put(small.cache.page_table),
                               lengths=put(small.cache.lengths))
  return DecodeState(cache, put(small.tokens), put(small.keys), put(small.active),
                     put(small.temperature, 1))


def _scatter(state: DecodeState, small: DecodeState, idx) -> DecodeState:
  put = lambda a, x: put_rows(a, idx, x)
  cache = T.KVCache(tuple(map(put, state.cache.k, small.cache.k)),
                    tuple(map(put, state.cache.v, small.cache.v)),
                    put(state.cache.lengths, small.cache.lengths))
  return DecodeState(cache, put(state.tokens, small.tokens), put(state.keys, small.keys),
                     put(state.active, small.active), put(state.temperature, small.temperature))


class Compaction:
  """An engine's compaction: its smaller child engines and the gather / scatter programs."""

  def __init__(self, slots: int, sizes: tuple[int, ...], state_shardings: DecodeState,
               make_child: Callable[[int], Any]):
    self.slots, self.sizes = slots, sizes
    self._make_child = make_child   # n -> the n-slot engine
    self._children: dict[int, Any] = {}
    self._gathers: dict[int, Any] = {}
    # A paged cache's pools are shared by all slots: compact and expand donate the state they
    # take, so the pools move (no copy) and only the small per-slot arrays are gathered.
    self.paged = isinstance(state_shardings.cache, T.PagedKVCache)
    self._scatter = (jax.jit(partial(_scatter_paged, slots=slots), out_shardings=state_shardings,
                             donate_argnums=(0,)) if self.paged else
                     jax.jit(_scatter, out_shardings=state_shardings, donate_argnums=(0,)))

  def size_for(self, n_active: int) -> int | None:
    """The smallest compaction size that holds n_active slots (None: none is smaller than the
    engine's own slot count)."""
    fits = [n for n in self.sizes if n >= n_active]
    return min(fits) if fits else None

  def child(self, n: int):
    """The n-slot engine that compacted states run on (built once, shares the mesh)."""
    if n not in self.sizes:
      raise ValueError(f"{n} is not one of compact_sizes {self.sizes}")
    if n not in self._children:
      self._children[n] = self._make_child(n)
    return self._children[n]

  def cache_size(self) -> int:
    """Compiled programs: the children's generate / set_active, the gathers and the scatter."""
    counts = [c.compile_counts() for c in self._children.values()]
    return (self._scatter._cache_size() + sum(f._cache_size() for f in self._gathers.values())
            + sum(c["generate"] + c["set_active"] for c in counts))

  def compact(self, state: DecodeState, slots, size: int | None = None) -> DecodeState:
    """Gathers slots `slots` of `state` into a new decode state of child(size) (default size:
    size_for(len(slots))), in that order; the rows past len(slots) are inactive. A dense
    `state` is left as it is (expand writes the slots back); a paged one is donated (its pools
    move into the compacted state, and expand makes the full-size state again)."""
    slots = np.asarray(slots, np.int32).reshape(-1)
    n = self.size_for(len(slots)) if size is None else size
    if n is None or n not in self.sizes or not 1 <= len(slots) <= n:
      raise ValueError(f"cannot compact {len(slots)} slots into one of {self.sizes}"
                       + (f" (size {size} asked)" if size is not None else ""))
    check_slots("compact", slots, self.slots)
    if n not in self._gathers:
      self._gathers[n] = jax.jit(_gather_paged if self.paged else _gather,
                                 out_shardings=self.child(n).state_shardings,
                                 donate_argnums=(0,) if self.paged else ())
    idx = np.zeros((n,), np.int32)
    idx[:len(slots)] = slots
    args = (((state.cache.k, state.cache.v), _without_pools(state)) if self.paged else (state,))
    return self._gathers[n](*args, idx, np.arange(n) < len(slots))

  def expand(self, state: DecodeState, small: DecodeState, slots) -> DecodeState:
    """Writes row i of a compacted state back into slot slots[i] of `state` (donated), as
    `compact` took them; rows with slots[i] = -1 (sequences that finished meanwhile) and rows
    past len(slots) are not written. Returns the full-size state."""
    slots = np.asarray(slots, np.int32).reshape(-1)
    n = small.tokens.shape[0]
    if len(slots) > n:
      raise ValueError(f"expand slots {slots.tolist()}: more than the {n} rows of the compacted "
                       "state")
    check_slots("expand", slots[slots != -1], self.slots)
    idx = np.full((n,), self.slots, np.int32)   # out of range: the scatter drops these rows
    idx[:len(slots)] = np.where(slots >= 0, slots, self.slots)
    if self.paged:   # `state`'s pools went to `compact`: the full-size state is made anew
      return self._scatter((small.cache.k, small.cache.v), _without_pools(small), idx)
    return self._scatter(state, small, idx)


def _rows(full: np.ndarray, slots: np.ndarray, n: int, fill) -> np.ndarray:
  """Rows `slots` of a per-slot host array, as the n rows of a compacted state (padded)."""
  out = np.full((n,) + full.shape[1:], fill, full.dtype)
  out[:len(slots)] = full[slots]
  return out


class Drain:
  """The loop's compacted state: (slots, small state, child engine) while the drain runs on a
  smaller engine, else None. `engine` is the loop's full-size engine."""

  def __init__(self, engine):
    self.engine = engine
    self.compacted: tuple[np.ndarray, DecodeState, Any] | None = None

  def set_active(self, state: DecodeState, active: np.ndarray) -> DecodeState:
    """Engine.set_active on the state the slots run on: the full-size one, or while compacted
    the compacted rows (the full-size state is then left as it is)."""
    if self.compacted is None:
      return self.engine.set_active(state, active)
    slots, small, child = self.compacted
    small = child.set_active(small, _rows(active, slots, child.max_concurrent_decodes, False))
    self.compacted = (slots, small, child)
    return state

  def sync_active(self, state: DecodeState, slots) -> DecodeState:
    """set_active with the slot table's host mask, if the device's differs (SlotTable
    .device_active says what the device's is)."""
    if not np.array_equal(slots.device_active, slots.active):
      state = self.set_active(state, slots.active)
      slots.device_active = slots.active.copy()
    return state

  def set_pages(self, state: DecodeState, table: np.ndarray) -> DecodeState:
    """Engine.set_pages likewise (paging.py's table, a row per slot)."""
    if self.compacted is None:
      return self.engine.set_pages(state, table)
    slots, small, child = self.compacted
    small = child.set_pages(small, _rows(table, slots, child.max_concurrent_decodes, 0))
    self.compacted = (slots, small, child)
    return state

  def maybe_compact(self, state: DecodeState, active: np.ndarray) -> DecodeState:
    """Moves the active slots onto the smallest child engine that holds them, when that is
    smaller than the one they run on now. Returns the full-size state."""
    slots = np.flatnonzero(active)
    size = self.engine.compact_size(slots.size)
    current = (self.engine.max_concurrent_decodes if self.compacted is None
               else self.compacted[2].max_concurrent_decodes)
    if size is None or size >= current:
      return state
    if self.compacted is not None:
      state = self.expand(state, active)
    self.compacted = (slots, self.engine.compact(state, slots), self.engine.compact_engine(size))
    return state

  def expand(self, state: DecodeState, held: np.ndarray) -> DecodeState:
    """Writes the compacted slots still `held` (a sample runs or is parked in them:
    SlotTable.held) back into the full-size `state`."""
    slots, small, _ = self.compacted
    self.compacted = None
    return self.engine.expand(state, small, np.where(held[slots], slots, -1))

  def generate(self, params, window: int):
    """One step of the compacted state; returns (the child engine, its results scattered back
    to full-size per-slot numpy arrays)."""
    child, r, slots = self.dispatch(params, window)
    return child, self.scatter(jax.device_get(r), slots)

  def dispatch(self, params, window: int):
    """Dispatches one step of the compacted state (asynchronously); returns (the child engine,
    its results on the device, the slot of each compacted row) for `scatter`."""
    slots, small, child = self.compacted
    small, r = child.generate(params, small, window)
    self.compacted = (slots, small, child)
    return child, r, slots

  def scatter(self, r, slots: np.ndarray):
    """A compacted step's results (fetched to numpy) as full-size per-slot arrays; row i is slot
    slots[i] (the compaction's slots when the step was dispatched)."""
    n = self.engine.max_concurrent_decodes
    res = type(r)(*(np.zeros((n,) + np.shape(a)[1:], np.asarray(a).dtype) for a in r))
    for full, part in zip(res, r):   # row i of the compacted step is slot slots[i]
      full[slots] = np.asarray(part)[:len(slots)]
    return res
