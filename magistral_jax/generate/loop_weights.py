"""The generator loop's weights: the ones in use and their policy version, the update waiting for
the next step boundary, and the recompute-on-update ablation (GeneratorLoop).

`update_params` may come from any thread (a trainer's push): the new weights are validated and
moved onto the engine's mesh in the caller's thread, and the loop swaps them in at its next step
boundary, a pointer swap. The KV cache of in-flight sequences is kept, as in the paper, unless
recompute_kv_on_update is set: then the loop recomputes every in-flight slot's cache under the new
weights (`recompute_caches`), and a request waiting for a slot is prefilled again (`stale`). The
prefill worker and the shared prefix read (params, version) as a pair under the loop's lock,
which every write here takes too.
"""
from __future__ import annotations

import time
from typing import Any, Callable

import jax

from magistral_jax.generate.counters import LoopCounters
from magistral_jax.generate.requests import RequestSamples
from magistral_jax.generate.slots import SlotTable


class LoopWeights:
  """`params` (as engine.load_params returns them; None while released) of policy `version`,
  and the pending update. `lock`: the loop's."""

  def __init__(self, engine, params, version: int, lock, counters: LoopCounters,
               recompute_kv_on_update: bool):
    self.engine, self._lock, self._counters = engine, lock, counters
    self.recompute_kv_on_update = bool(recompute_kv_on_update)
    self.params = engine.load_params(params)
    self.version = int(version)
    self._pending: tuple[Any, int] | None = None
    self._pending_since_step = 0

  @property
  def pending(self) -> tuple[Any, int] | None:
    """The update waiting for the next step boundary, (params, version), or None."""
    return self._pending

  def current(self) -> tuple[Any, int]:
    """(params, version), read together (the prefill worker calls it under the loop's lock)."""
    return self.params, self.version

  def update(self, params, version: int) -> None:
    """GeneratorLoop.update_params: thread-safe; bad params raise here and nothing changes."""
    version = int(version)
    params = self.engine.load_params(params)
    with self._lock:
      latest = self.version if self._pending is None else max(self.version, self._pending[1])
      if version <= latest:
        # Tokens carry the version they were sampled under, and the shared prefix's cache (and
        # the recompute ablation's staleness test) is keyed by it: two weights under one number
        # would be indistinguishable downstream.
        raise ValueError(f"update_params: version {version} must be greater than the loop's "
                         f"latest version {latest}")
      self._pending = (params, version)
      self._pending_since_step = self._counters.steps

  def apply_pending(self, recompute_kv: Callable[[], None]) -> None:
    """At a step boundary (the loop thread): swaps in the pending weights, if any, and with
    recompute_kv_on_update calls `recompute_kv` (the loop's: it owns the caches); counts the
    pause and the steps the update waited."""
    with self._lock:
      pending, self._pending = self._pending, None
      since = self._pending_since_step
      if pending is None:
        return
      t0 = time.perf_counter()
      self.params, self.version = pending
    if self.recompute_kv_on_update:
      recompute_kv()
    self._counters.update_pauses_s.append(time.perf_counter() - t0)
    self._counters.update_pause_steps.append(self._counters.steps - since)

  def stale(self, g: RequestSamples) -> bool:
    """Whether a group needs a (new) prefill before its next sample goes into a slot."""
    return g.prefix is None or (self.recompute_kv_on_update and g.prefix_version != self.version)

  def drop(self) -> None:
    """GeneratorLoop.release, under the loop's lock: the weights and any pending update go."""
    self.params, self._pending = None, None

  def reload(self, params, version: int) -> None:
    """GeneratorLoop.reload: the weights of policy `version` after a release."""
    if int(version) < self.version:
      raise ValueError(f"reload: version {version} is older than the loop's {self.version}")
    params = self.engine.load_params(params)
    with self._lock:
      self.params, self.version = params, int(version)


def recompute_caches(engine, params, state, slots: SlotTable, groups) -> Any:
  """The recompute ablation, on a weights update: every in-flight slot's KV cache recomputed from
  its tokens under `params` (the host must hold every token the device state does), and the
  prefixes of the requests waiting for slots dropped, to be prefilled again under the new weights
  when their turn comes. Returns the new decode state, computed."""
  for i, s in enumerate(slots.samples):
    if s is not None and slots.active[i]:   # a parked slot is prefilled again when it resumes
      state = engine.refresh_slot(params, state, i, slots.in_cache(i))
  for g in groups:
    g.prefix = None
  jax.block_until_ready(state)
  return state
