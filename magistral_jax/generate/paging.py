"""The generator loop's pages (an engine with a paged KV cache): which slot holds which pages of the
pool, kept on the host beside the slot table, and the page table the device reads.

  - A sample enters a slot only when its prompt and first token fit in free pages (`admit`). The
    samples of one group inserted from the same prefill share their prompt's full pages.
  - Before each decode step every active slot reserves the page its next token goes to (`grow`),
    counting the step the device may run ahead of the host (overlap_host).
  - When the pool runs dry, the active slot with the least progress is parked: it gives its pages
    back, keeps its slot, tokens, stream and temperature, and is resumed first once pages free
    up, by prefilling its tokens again (Engine.refresh_slot, under the weights of that moment:
    what the recompute ablation does to every slot; the policy version of each sampled token is
    unchanged). Each one counts in `preemptions`.
  - A finished sample's pages go back at once (`release`).
With a data axis in the generator mesh there is one pool per data replica (engine.page_replicas,
model/kv_cache.py): a slot takes pages of its replica's pool only (the slots are split over the
replicas in blocks, as the device splits them), group mates share pages within a replica, and a
dry pool preempts one of its own slots. The table numbers pages across the pools (replica r's
are r * kv_pages ...). It is sent to the device only when it changed (`sync`), before the
program that reads it.
"""
from __future__ import annotations

import numpy as np

from magistral_jax.generate.pages import OutOfPages, PagePool


class LoopPages:
  """The page pools of one engine's slots (engine.page_replicas pools of engine.kv_pages pages
  of engine.page_size positions); `set_pages(state, table)` puts the table into the decode state
  the slots run on."""

  def __init__(self, engine, set_pages):
    if engine.kv_pages - 1 < engine.max_pages_per_slot:
      raise ValueError(f"kv_pages={engine.kv_pages}: one sample of the engine's cache_length "
                       f"({engine.cache_length} positions) needs {engine.max_pages_per_slot} "
                       f"pages of {engine.page_size} besides the null page")
    self.engine = engine
    self._set_pages = set_pages   # Engine.set_pages, or compaction.Drain's while compacted
    self._per_replica = engine.max_concurrent_decodes // engine.page_replicas
    self.reset()

  def reset(self) -> None:
    """Every page free (the loop released its cache, or starts)."""
    engine = self.engine
    self.pools = [PagePool(engine.kv_pages, engine.page_size, engine.max_pages_per_slot)
                  for _ in range(engine.page_replicas)]
    self._dirty = False   # the pools' page table changed since the device last got it
    # Slots holding a prefilled row's prompt, per (prefill batch, row): a group mate inserted
    # from the same row shares their full pages. A mate prefilled again (new weights) has
    # another row, so it never shares pages holding another policy's keys and values.
    self._holders: dict[tuple[int, int], list[int]] = {}
    self._row_of: dict[int, tuple[int, int]] = {}
    self.parked: list[int] = []   # preempted slots, in the order they are resumed
    self.peak_pages = 0

  def replica(self, slot: int) -> int:
    """The data replica whose pool `slot`'s pages come from."""
    return slot // self._per_replica

  def pool(self, slot: int) -> PagePool:
    return self.pools[self.replica(slot)]

  @property
  def preemptions(self) -> int:
    return sum(p.preemptions for p in self.pools)

  @property
  def used_pages(self) -> int:
    return sum(p.used_pages for p in self.pools)

  def _changed(self) -> None:
    self._dirty = True
    self.peak_pages = max(self.peak_pages, self.used_pages)

  def admit(self, slot: int, row: tuple[int, int], prompt_len: int) -> bool:
    """Pages for a new sample's prompt and first token in `slot`, sharing the full prompt pages
    of a slot of its replica holding the same prefilled `row`; False (nothing taken) when they
    do not fit."""
    mates = [m for m in self._holders.get(row, ()) if self.replica(m) == self.replica(slot)]
    try:
      if mates:
        self.pool(slot).share(mates[0], slot, prompt_len)
      else:
        self.pool(slot).admit(slot, prompt_len + 1)
    except OutOfPages:
      return False
    self._holders.setdefault(row, []).append(slot)
    self._row_of[slot] = row
    self._changed()
    return True

  def hold(self, slot: int, length: int) -> bool:
    """Pages of its own for `slot`'s `length` positions (a sample's tokens and the pending one),
    if its pool has them."""
    try:
      self.pool(slot).admit(slot, length)
    except OutOfPages:
      return False
    self._changed()
    return True

  def reserve(self, slot: int, length: int) -> bool:
    """Pages for `slot`'s first `length` positions (its next step's write, or a tool's result
    going into it), if the pool has them."""
    try:
      if self.pool(slot).reserve(slot, length):
        self._changed()
    except OutOfPages:
      return False
    return True

  def grow(self, reached: dict[int, int]) -> int | None:
    """Reserves, for each active slot, the pages of its first `reached[slot]` positions (what the
    next step writes below). Returns None, or the slot that could not grow when the pool is dry."""
    for slot, n in reached.items():
      if not self.reserve(slot, n):
        return slot
    return None

  def _leave_row(self, slot: int) -> None:
    row = self._row_of.pop(slot, None)
    if row is not None:
      self._holders[row].remove(slot)
      if not self._holders[row]:
        del self._holders[row]

  def release(self, slot: int) -> None:
    """Gives back a finished (or carried) slot's pages."""
    self._leave_row(slot)
    self.pool(slot).release(slot)
    self._changed()

  def park(self, slot: int) -> None:
    """Preempts `slot` (PagePool.preempt: its pages go back, counted); it waits in `parked` to
    be resumed."""
    self._leave_row(slot)
    self.pool(slot).preempt(slot)
    self._changed()
    self.parked.append(slot)

  def victim(self, progress: dict[int, int], dry: int) -> int:
    """The active slot to park when `dry`'s pool has no page for it: the least progress among
    the slots of that pool (PagePool.preempt_victim)."""
    pool = self.pool(dry)
    v = pool.preempt_victim({s: n for s, n in progress.items()
                             if self.replica(s) == self.replica(dry)})
    if v is None:
      raise OutOfPages(f"no slot to preempt: the pool's {pool.num_pages - 1} pages cannot "
                       "hold one sample; give the engine more kv_pages")
    return v

  def budget(self):
    """`fits(slot, group)` for planning a refill: whether one more sample of `group` surely fits
    in `slot`'s pool, its pages counted as if it shared none (nothing fits in a pool while one
    of its slots is parked: that one goes first)."""
    parked = {self.replica(s) for s in self.parked}
    left = [0 if r in parked else p.free_pages for r, p in enumerate(self.pools)]

    def fits(slot: int, group) -> bool:
      r = self.replica(slot)
      need = self.pools[r].pages_for(group.true_length + 1)
      if need > left[r]:
        return False
      left[r] -= need
      return True
    return fits

  def admit_planned(self, plan, state):
    """Pages for each planned (slot, group, sample index) of a refill (budget() planned them, so
    they fit), then the table onto the device for the inserts that write into them."""
    for slot, g, _ in plan:
      # A group's samples share their prompt's pages while prefilled by the same weights:
      # `g` lives while a slot runs one of its samples, so its id names one request here.
      if not self.admit(slot, (id(g), g.prefix_version), g.true_length):
        raise RuntimeError(f"slot {slot}: a planned sample did not fit in the free pages")
    return self.sync(state)

  def resume_parked(self, state, slots, params, drain):
    """Parked slots back to decoding, first parked first, while the pages allow: each one's
    tokens are prefilled again into its new pages (Engine.refresh_slot) under `params`, on the
    full-size state (`drain`'s compacted slots go back first)."""
    if drain.compacted is not None:
      state = drain.expand(state, slots.held())
    for slot in list(self.parked):
      seq = slots.in_cache(slot)
      if not self.hold(slot, len(seq) + 1):
        break
      self.parked.remove(slot)
      state = self.engine.refresh_slot(params, self.sync(state), slot, seq)
      slots.resume(slot)
    return state

  def make_room(self, state, slots, ahead, drain):
    """Pages for every active slot's next write, then the activity mask and the table onto the
    device (`drain`'s: the state the slots run on). When the pool runs dry, the step in flight
    is recorded first (`ahead`, the loop's DeviceLead: samples may finish and free pages, and the
    host then holds every token a parked slot is prefilled from again), then slots are parked,
    the least progress first, until the rest fit."""
    while (dry := self.grow(slots.reached(ahead.positions()))) is not None:
      if ahead.positions() is not None:
        ahead.flush()
        continue
      slot = self.victim(slots.progress(), dry)
      self.park(slot)
      slots.park(slot)
    return self.sync(drain.sync_active(state, slots))

  def sync(self, state):
    """The decode state with the pool's page table, if it changed since the last sync."""
    if self._dirty and state is not None:
      state = self._set_pages(state, self.table())
      self._dirty = False
    return state

  def table(self):
    """The page table of every slot, pages numbered across the pools."""
    n, per = self.engine.max_concurrent_decodes, self._per_replica
    return np.concatenate([p.table(n)[r * per:(r + 1) * per] + r * self.engine.kv_pages
                           for r, p in enumerate(self.pools)])

  def metrics(self) -> dict[str, float]:
    return {"kv_pages_used": float(self.used_pages),
            "kv_pages_peak": float(self.peak_pages),
            "kv_preemptions": float(self.preemptions)}
