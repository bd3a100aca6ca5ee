"""How busy the generators were between two reads of the batch metrics (Rollouts.metrics)."""
from __future__ import annotations

import time
from typing import Sequence

import numpy as np


def _counters(g) -> tuple:
  c = g.counters
  return c.decode_time_s, c.steps, c.active_slot_steps, c.idle_time_s


class GeneratorMeter:
  """The generators' counters at the last read, and the wall time since: each read gives the
  shares of that interval."""

  def __init__(self, generators: Sequence):
    self.generators = generators
    self._t = time.time()
    self._last = [_counters(g) for g in generators]

  def read(self) -> dict:
    now = time.time()
    wall = max(1e-9, now - self._t)
    self._t = now
    util, occ, decode_frac = [], [], []
    for i, g in enumerate(self.generators):
      d0, s0, a0, i0 = self._last[i]
      d, steps, a, idle = _counters(g)
      occ.append((a - a0) / max(1, (steps - s0) * g.engine.max_concurrent_decodes))
      working = max(0.0, 1.0 - (idle - i0) / wall)
      util.append(occ[-1] * working)
      decode_frac.append(min(1.0, (d - d0) / wall))
      self._last[i] = (d, steps, a, idle)
    pages = [g.parts.pages for g in self.generators
             if getattr(getattr(g, "parts", None), "pages", None) is not None]
    paged = {} if not pages else {
        # Paged KV caches (generate/paging.py): slots parked for want of pages, over the run so
        # far, and the most pages held at once by one generator.
        "generator_kv_preemptions": float(sum(p.preemptions for p in pages)),
        "generator_kv_pages_peak": float(max(p.peak_pages for p in pages))}
    tools = [g.tools for g in self.generators if getattr(g, "tools", None) is not None]
    # Tool calls (generate/tool_turns.py), over the run so far, all generators: calls, those
    # that failed (their error text was the result), results past a sample's budget, and the
    # result tokens the policy read.
    tool = {f"generator_{k}": float(sum(t.counts[k] for t in tools))
            for k in ("tool_calls", "tool_errors", "tool_truncated", "tool_result_tokens")
            } if tools else {}
    return {
        **paged, **tool,
        # Share of generator capacity holding live sequences: slot occupancy over decode steps x
        # share of wall time the loop was not waiting for work (it was decoding, prefilling,
        # inserting or doing its bookkeeping). Sync mode loses both while it waits for the
        # longest completion and for the trainer.
        "generator_utilization": float(np.mean(util)),
        "generator_slot_occupancy": float(np.mean(occ)),
        # Share of wall time inside decode steps (the rest is prefill/insert, host work, idle)
        # and the stricter occupancy x decode share.
        "generator_decode_frac": float(np.mean(decode_frac)),
        "generator_decode_utilization": float(np.mean([o * d for o, d in zip(occ, decode_frac)])),
        # Requests whose prompt continued the cached system-prompt prefix (GeneratorLoop
        # shared_prefix), over the run so far, all generators.
        "generator_shared_prefix_hits": float(sum(g.counters.shared_prefix_hits
                                                  for g in self.generators)),
    }
