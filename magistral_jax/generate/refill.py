"""Refilling the generator loop's free slots (GeneratorLoop.step, its second part).

The requests that the free slots need are prefilled together (one `prefill_many` call per length
bucket and batch size, one prefill per request however many group samples it has), topped up
with the next queued requests up to `prefill_ahead` prompts per refill; then all new samples go
into their slots in one `insert_many` call per prefill batch; samples that do not fit wait for
the next free slots, reusing the same prefix. With background_prefill a worker thread prefills
ahead while the loop decodes (prefill_worker.py) and the refill inserts what is ready. A
compacted drain goes back onto the full engine first (compaction.Drain), and with overlap_host
the inserts' first tokens are recorded with the next step's results (inflight.py).
"""
from __future__ import annotations

import queue
from functools import partial
from typing import Callable

import numpy as np

from magistral_jax.generate.loop_parts import LoopParts
from magistral_jax.generate.requests import RequestSamples


class Refill:
  """The loop's refill over the parts it shares with the loop (loop_parts.LoopParts):
  `prefill(groups)` prefills under the loop's current weights and `stale(group)` says whether a
  group needs a (new) prefill (loop_weights.LoopWeights.stale)."""

  def __init__(self, parts: LoopParts, prefill: Callable[[list[RequestSamples]], None],
               stale: Callable[[RequestSamples], bool], prefill_ahead: int):
    self.parts, self.engine = parts, parts.engine
    self._prefill, self._stale, self.prefill_ahead = prefill, stale, prefill_ahead

  def next_sample(self, take_request: bool = True, fits=None):
    """(group, sample index) for the next free slot, taking a new request when needed (and
    `take_request`); None when there is none, or when `fits(group)` (paging.budget) says its
    next sample does not fit in the free KV pages."""
    while self.parts.groups and self.parts.groups[0].waiting <= 0:
      self.parts.groups.popleft()
    if not self.parts.groups:
      if not take_request:
        return None
      try:
        self.parts.groups.append(self.parts.requests.get_nowait())
      except queue.Empty:
        return None
    g = self.parts.groups[0]
    if fits is not None and not fits(g):
      return None
    i = g.next_index
    g.next_index += 1
    return g, i

  def fill(self, state):
    """Fills the free slots (module docstring); `state` is the loop's decode state, donated:
    returns the new one."""
    bg, slots = self.parts.options.background_prefill, self.parts.slots
    if bg:
      self.parts.prefiller.collect(self.parts.groups, decoding=bool(slots.active.any()))
    while True:
      if bg:  # (again after a sample that finished on its first token)
        self.parts.prefiller.top_up(self.parts.groups, int(slots.active.sum()),
                               self.engine.max_concurrent_decodes,
                               self.parts.options.loop_prefill_below)
      plan = []  # (slot, group, sample index)
      budget = None if self.parts.pages is None else self.parts.pages.budget()
      for slot in slots.free():
        fits = None if budget is None else partial(budget, int(slot))
        nxt = self.next_sample(take_request=not bg, fits=fits)
        if nxt is None:
          if budget is None or len(self.parts.pages.pools) == 1:
            break
          continue   # another replica's free slot may have the pages
        plan.append((int(slot), *nxt))
      if not plan:
        break
      if self.parts.drain.compacted is not None:  # new work: the compacted slots go back first
        state = self.parts.drain.expand(state, slots.held())
      need, seen = [], set()
      for _, g, _ in plan:
        if self._stale(g) and id(g) not in seen:
          seen.add(id(g))
          need.append(g)
      if need:  # prefill ahead: queued requests join this call (FIFO order is kept)
        for g in self.parts.groups:
          if len(need) >= self.prefill_ahead:
            break
          if self._stale(g) and id(g) not in seen:
            seen.add(id(g))
            need.append(g)
        while not bg and len(need) < self.prefill_ahead:
          try:
            g = self.parts.requests.get_nowait()
          except queue.Empty:
            break
          self.parts.groups.append(g)
          need.append(g)
      self._prefill(need)
      if self.parts.pages is not None:
        state = self.parts.pages.admit_planned(plan, state)
      # One insert per prefill batch the plan draws from (usually one).
      calls: dict[int, list] = {}
      for entry in plan:
        calls.setdefault(id(entry[1].prefix[0]), []).append(entry)
      firsts = []
      for entries in calls.values():
        for slot, g, i in entries:
          slots.assign(slot, g, i)
        state, tok, lp = self.engine.insert_many(
            entries[0][1].prefix[0], state, [e[0] for e in entries],
            [e[1].prefix[1] for e in entries], np.stack([e[1].key for e in entries]),
            [e[2] for e in entries], slots.active, temperature=self.parts.sampling.temperature)
        slots.device_active = slots.active.copy()
        firsts.append((np.array([e[0] for e in entries]), [e[1].request.id for e in entries],
                       np.array([e[1].prefix_version for e in entries]), tok, lp))
      if self.parts.options.overlap_host and self.parts.ahead.step is not None:
        # The inserts queue after the step in flight: their first tokens are fetched and
        # recorded with the next step's results instead of waited for here, so refills overlap
        # with the device too. A sample that finishes on its first token is then known a step
        # later (that step's token for it is dropped), like a finish at any other step.
        self.parts.ahead.firsts.extend(firsts)
        break
      finished = self.parts.ahead.record_firsts(firsts)   # one transfer for all first tokens
      if not finished:  # a sample can finish on its first token: refill its slot right away
        break
    if bg:
      self.parts.prefiller.after_refill(self.parts.groups)
    return self.parts.drain.sync_active(state, slots)
