"""Samples carried across a release (GeneratorLoop.release(carry=True) ... reload): a colocated
phase ends once its batch is ready, not once its longest sample is done.

At the release every sample in a slot leaves it with its tokens, log-probs and per-token policy
versions (SlotTable.take), and the device memory goes (weights, KV cache). After the reload each
one goes back into a slot: its tokens so far are prefilled again under the new weights (the
prompt and every generated token but the pending one, as the recompute ablation does), and the
slot continues from the pending token with the sample's own PRNG stream and temperature, so the
draws go on where they stopped. Tokens already sampled keep their versions; the later ones get
the new version. Samples that do not fit yet (too few free slots or KV pages) wait, first carried
first resumed, before any new request.
"""
from __future__ import annotations

import jax
import numpy as np


class Carry:
  """The carried samples of one loop, in the order they are resumed."""

  def __init__(self):
    self.samples: list[tuple] = []   # SlotTable.take records

  def __len__(self) -> int:
    return len(self.samples)

  def suspend(self, slots, pages) -> None:
    """Every sample in a slot (decoding or parked for KV pages) out of it, onto the carry."""
    if pages is not None:
      pages.parked.clear()   # their pages are given back as they leave their slots
    for slot in np.flatnonzero(slots.held()):
      self.samples.append(slots.take(int(slot)))

  def resume(self, engine, params, state, slots, pages, temperature: float):
    """The carried samples back into free slots while slots and pages allow; returns the decode
    state."""
    free = list(slots.free())
    while self.samples and free:
      record = self.samples[0]
      sample, tokens = record[:2]
      seq = sample.group.prompt + tokens[:-1].tolist()
      slot = int(free[0])
      if pages is not None:
        if not pages.hold(slot, len(seq) + 1):
          break
        state = pages.sync(state)
      padded, n, _ = engine.pad_prompt(seq, engine.recompute_buckets)
      key = np.asarray(jax.random.fold_in(sample.group.key, sample.index))
      prefix = engine.prefill(params, padded, n, temperature=temperature, rng=key)
      # The slot goes on from the pending token (drawn before the release), not a new draw.
      state = engine.insert(prefix._replace(token=np.int32(tokens[-1])), state, slot)
      slots.put(slot, record)
      slots.device_active[slot] = True
      self.samples.pop(0)
      free.pop(0)
    return state
