"""What the device has computed that the host has not yet recorded (GeneratorLoop with
EngineConfig.overlap_host, the default).

The loop dispatches decode step n+1 before it fetches and records step n's results, so the device
computes step n+1 while the host transfers step n's tokens, does the bookkeeping, refills slots
and dispatches the next step (one step in flight at most). Dispatching a jitted step over
hundreds of weight and cache arrays and fetching its results cost real host time; done in turn
with the step they leave the device idle for a large share of the loop's time (BENCHMARKS.md,
"Generation"). The decode state is threaded functionally on the device, so what the host
dispatches between steps (inserts, activity masks, compaction) queues after the step in flight.

What it changes: a sample that finishes at step n (EOS, stop string, length) is known only after
step n+1 was dispatched with its slot still active; that step's token for it is dropped (never
recorded or counted) and the slot is refilled one step later than without overlap (its write
lands at most at position prompt + max_new - 1 < cache length, and an insert rewrites the slot's
length, token, key and activity). Each in-flight step keeps the slots it advances and their
samples (a slot refilled since is not the same sample: its result is dropped) and the policy
version of the weights it was dispatched with, which its tokens carry. The samples (tokens,
log-probs, versions) are those without overlap: tokens depend only on a sample's own prompt,
PRNG stream and position (tests/generate/test_engine_and_loop.py); only the schedule of refills,
hence the step count and when a weights update reaches a sample, differs. The step in flight is
recorded before the loop reports nothing to do, at the end of run_until_idle, when the loop
thread stops, and before a KV recompute on update. Refills overlap too: the first tokens of
samples inserted while a step is in flight are fetched and recorded with the next step's results
(a sample finishing on its first token is known a step later, like any other finish).

This module keeps that lead: it dispatches each decode step (on the full or the compacted
state, over the attention window its positions need) and holds at most one dispatched step
(`InFlight`) and the pending first tokens, the positions they advance each slot by, and their
recording into the slot table.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import numpy as np

from magistral_jax.generate.compaction import Drain
from magistral_jax.generate.counters import LoopCounters
from magistral_jax.generate.slots import SlotTable
from magistral_jax.generate.weights import NonFiniteError


@dataclasses.dataclass
class InFlight:
  """A dispatched decode step whose results are not yet recorded.
  res: its ResultTokens on the device; rows: for a compacted step, the slot of each result row
  (None: row i is slot i); slots: the slots active on the host when it was dispatched and
  owners: their SlotSamples then (a slot whose sample has since finished, or that holds another
  one, is not recorded); version: the policy version of the weights it ran with; firsts: the
  first tokens of the samples inserted just before it (refill.Refill.fill), recorded
  before its own tokens."""
  res: Any
  rows: np.ndarray | None
  slots: np.ndarray
  owners: list
  version: int
  firsts: list


class DeviceLead:
  """Dispatches decode steps; holds the step in flight (`step`) and the first tokens of inserts
  not yet fetched (`firsts`: (slots, request ids, prefix versions, tokens on the device,
  log-probs on the device) each), recorded into `slots` as they are fetched."""

  def __init__(self, slots: SlotTable, drain: Drain, counters: LoopCounters):
    self.slots, self.drain, self.counters = slots, drain, counters
    self.step: InFlight | None = None
    self.firsts: list[tuple] = []

  def dispatch(self, params, state, version: int):
    """Dispatches one decode step of the active slots (on the compacted state while the drain
    runs on a smaller engine) with weights `params` of policy `version`, over the smallest
    attention window holding every position it writes, and makes it the step in flight
    (`dispatched`). Returns the full-size decode state (`state`, donated)."""
    c, engine = self.counters, self.drain.engine
    # The device is ahead of what the host has recorded (the step in flight, first tokens not
    # yet fetched): the window must hold the positions this step writes on the device.
    ahead = self.positions()
    window = engine.window_for(self.slots.positions(ahead))
    c.attended_positions += (self.slots.mean_positions(ahead)
                             if engine.decode_attention in ("live", "paged") else window)
    t0 = time.perf_counter()
    slots = np.flatnonzero(self.slots.active)
    owners = [self.slots.samples[i] for i in slots]
    if self.drain.compacted is None:
      eng, rows = engine, None
      state, res = engine.generate(params, state, window)
    else:
      eng, res, rows = self.drain.dispatch(params, window)
      c.compact_steps += 1
    c.computed_slot_steps += eng.max_concurrent_decodes
    c.steps += 1
    c.decode_time_s += time.perf_counter() - t0
    # overlap_host: the previous step is recorded while this one runs.
    self.dispatched(res, rows, slots, owners, version)
    return state

  def dispatched(self, res, rows, slots, owners, version: int) -> None:
    """A decode step was dispatched: it becomes the step in flight, taking the pending first
    tokens with it; the previous step in flight, if any, is recorded (while the new one runs)."""
    firsts, self.firsts = self.firsts, []
    prev, self.step = self.step, InFlight(res, rows, slots, owners, version, firsts)
    if prev is not None:
      self.record(prev)

  def positions(self) -> np.ndarray | None:
    """[slots] int: positions the device has advanced each slot past what the host recorded:
    one for the step in flight (for the samples it advanced that still run), one for each first
    token not yet fetched (an insert made while a step was in flight)."""
    d = self.step
    if d is None and not self.firsts:
      return None
    extra = np.zeros(self.slots.active.shape, np.int64)
    if d is not None:
      samples = self.slots.samples
      extra[[i for i, o in zip(d.slots, d.owners) if samples[i] is o]] += 1
      for f in d.firsts:
        extra[f[0]] += 1
    for f in self.firsts:
      extra[f[0]] += 1
    return extra

  def flush(self) -> None:
    """Records the step in flight, if any."""
    d, self.step = self.step, None
    if d is not None:
      self.record(d)
    if self.firsts:   # (only left by an insert that no step followed, e.g. after an error)
      firsts, self.firsts = self.firsts, []
      self.record_firsts(firsts)

  def record(self, d: InFlight) -> None:
    """Fetches a dispatched step's results and records the tokens of the samples it advanced
    that are still running (a sample that finished at the step before gets no more tokens)."""
    c = self.counters
    t0 = time.perf_counter()
    res, firsts = jax.device_get((d.res, [f[3:] for f in d.firsts]))   # one transfer
    firsts = [f[:3] + tuple(x) for f, x in zip(d.firsts, firsts)]
    if d.rows is not None:
      res = self.drain.scatter(res, d.rows)
    c.decode_time_s += time.perf_counter() - t0
    if d.firsts:   # the inserts came before this step: their first tokens go first
      self.record_firsts(firsts)
    samples, active = self.slots.samples, self.slots.active
    # A slot parked since (for a tool call) holds the same sample but gets no token.
    idx = d.slots[np.array([samples[i] is o and active[i] for i, o in zip(d.slots, d.owners)],
                           bool)]
    c.active_slot_steps += idx.size
    bad = ~res.finite[idx]
    if bad.any():
      raise NonFiniteError(f"non-finite logits in slots {idx[bad].tolist()} at policy "
                           f"version {d.version}; stopping instead of sampling garbage")
    c.generated_tokens += idx.size
    self.slots.record(idx, res.tokens[idx], res.logprobs[idx], np.full(idx.shape, d.version))

  def record_firsts(self, firsts) -> bool:
    """Records the first tokens of inserted samples, `firsts` as in self.firsts; returns
    whether a sample finished on its first token."""
    finished = False
    fetched = jax.device_get([f[3:] for f in firsts])   # one transfer (numpy: as it is)
    for (slots, ids, versions, _, _), (tok, lp) in zip(firsts, fetched):
      m = len(slots)
      # The first token's log-prob is NaN when its prompt's last logits hold a NaN or a +Inf
      # (the decode step checks every logit of the later tokens, -Inf included): stop rather
      # than stream garbage.
      bad = ~np.isfinite(lp[:m])
      if bad.any():
        raise NonFiniteError(f"non-finite prompt logits for requests "
                             f"{[ids[j] for j in np.flatnonzero(bad)]} at policy version "
                             f"{versions[0]}; stopping instead of sampling garbage")
      finished |= self.slots.record(slots, tok[:m], lp[:m], versions)
    return finished
