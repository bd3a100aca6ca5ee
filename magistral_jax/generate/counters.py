"""The generator loop's running counters and the metrics derived from them."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class LoopCounters:
  """Written by the loop thread, except the prefill counters (background_prefilled and the
  shared_prefix_* ones), which the prefill worker writes too, under the loop's lock."""
  steps: int = 0
  active_slot_steps: int = 0
  # Slots the decode steps computed: B per full step, the compact engine's size per compacted
  # step. Active over computed is the share of decode work that advanced a sequence.
  computed_slot_steps: int = 0
  generated_tokens: int = 0
  compact_steps: int = 0          # decode steps run on a compacted (smaller) state
  # Sum over steps of the cache positions a slot's attention read: the window (XLA's decode), or
  # the mean over slots of each one's reached positions (live decode).
  attended_positions: float = 0.0
  decode_time_s: float = 0.0
  idle_time_s: float = 0.0        # blocked waiting for a request with no active slot
  prefill_wait_s: float = 0.0     # the loop blocked waiting for the background prefill worker
  background_prefilled: int = 0   # requests the worker prefilled
  shared_prefix_hits: int = 0     # requests prefilled as a continuation of the shared prefix
  shared_prefix_tokens_skipped: int = 0  # prompt tokens those prefills did not recompute
  shared_prefix_prefills: int = 0  # times the shared prefix itself was prefilled
  update_pauses_s: list[float] = dataclasses.field(default_factory=list)
  update_pause_steps: list[int] = dataclasses.field(default_factory=list)  # steps until the swap

  def metrics(self, slots: int, cache_length: int, version: int) -> dict[str, float]:
    """GeneratorLoop.metrics for an engine of `slots` slots and `cache_length` positions."""
    total = self.steps * slots
    computed = self.computed_slot_steps
    return {
        "steps": self.steps, "generated_tokens": self.generated_tokens,
        # Active slots over the engine's B slots in every step (compacted steps count all B).
        "slot_utilization": self.active_slot_steps / total if total else 0.0,
        # Active slots over the slots each step actually computed (a compacted step computes
        # only its smaller engine's slots).
        "computed_slot_utilization": self.active_slot_steps / computed if computed else 0.0,
        "compact_steps": self.compact_steps,
        # Cache positions read per slot and step, over the engine's cache length (1.0 = dense).
        "attention_window_fraction": (self.attended_positions / self.steps / cache_length
                                      if self.steps else 0.0),
        "tokens_per_s": self.generated_tokens / self.decode_time_s if self.decode_time_s else 0.0,
        "version": version,
        "max_update_pause_s": max(self.update_pauses_s, default=0.0),
        "prefill_wait_s": self.prefill_wait_s,
        "background_prefilled": self.background_prefilled,
        "shared_prefix_hits": self.shared_prefix_hits,
        "shared_prefix_prefills": self.shared_prefix_prefills,
        "shared_prefix_tokens_skipped": self.shared_prefix_tokens_skipped,
    }
