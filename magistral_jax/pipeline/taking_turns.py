"""Colocated sync: generation and training take turns on the same devices (pipeline.rollouts).

For a run on one GPU or one TPU VM whose chips should not be split. There are no generator
threads: a generation phase steps each generator in the trainer's thread until its work is done
(still continuous batching over its slots; the verifier pool scores completions as they finish).

    push(params, version)  -> noted only: no second copy of the weights during training, no
                              device-to-device transfer
    begin()                -> every generator loads the newest pushed params (cast to its dtype
                              and laid out for decoding) and gets an empty KV cache
    generate() ...         -> the phase: one decode step of each busy generator per call
    end()                  -> every generator frees its weights copy and its KV cache
                              (GeneratorLoop.release), so that the train step's activations have
                              the memory the cache had

Each phase reports its memory: `memory/generate_peak_bytes`, the bytes in use on the devices at
the end of the phase, when the weights copy, the KV cache and the shared prefix cache are all
allocated; `memory/generation_released_bytes`, what the release freed; and `weight_reload_s`, the
load at its start. The methods are those of every schedule (pipeline.schedule.Schedule).
"""
from __future__ import annotations

import logging
import time
from typing import Sequence

from magistral_jax.generate.loop import GeneratorLoop
from magistral_jax.parallel.memory import bytes_in_use
from magistral_jax.pipeline.errors import PipelineError

log = logging.getLogger(__name__)


class TakingTurns:
  """The generation phases of colocated sync mode, over GeneratorLoops built with
  background_prefill=False (the trainer's thread steps them; no thread of theirs may)."""

  def __init__(self, generators: Sequence[GeneratorLoop], carry_over: bool = False):
    for g in generators:
      if not isinstance(g, GeneratorLoop):
        raise TypeError(f"colocated sync mode steps GeneratorLoops in the trainer's thread, not "
                        f"a {type(g).__name__}")
      if g.options.background_prefill:
        raise ValueError("colocated sync mode steps the generators in the trainer's thread; "
                         "build them with background_prefill=False")
    self.generators = list(generators)
    # The generators' devices, in order: each phase's memory is measured on them (end).
    self.devices = list(dict.fromkeys(d for g in self.generators
                                      for d in g.engine.mesh.devices.flat))
    if len(self.devices) > 1 and all(d.platform == "cpu" for d in self.devices):
      log.warning("colocated on %d CPU devices: XLA:CPU can deadlock a train step there (two "
                  "devices waiting in different collectives of one launch; "
                  "docs/design_notes.md, 'Hangs on the simulated devices'); one device "
                  "(devices.trainer=1) is the colocated layout that is tested", len(self.devices))
    # End a phase with samples still generating: they carry into the next (generate/carry.py).
    self.carry_over = carry_over
    self._latest: tuple | None = None   # (params, version) of the newest push, not loaded yet
    self.metrics: dict[str, float] = {}
    self._phase_t0 = 0.0

  def start(self) -> None:
    """Nothing to start: the generators have no thread of their own."""

  def push(self, params, version: int) -> float:
    """The trainer's newest params: only noted, the next phase loads them (0 s here; its load
    time is the metric `weight_reload_s`)."""
    self._latest = (params, int(version))
    return 0.0

  def begin(self) -> None:
    """The generators get the newest pushed params and an empty KV cache."""
    t = time.time()
    for g in self.generators:
      if g.released:
        if self._latest is None:
          raise PipelineError("colocated generation phase: the generators released their "
                              "weights and no push has brought new ones (call push(params, "
                              "version) after each training phase)")
        g.reload(*self._latest)   # waits for the load: its finiteness check reads every weight
    self._latest = None
    self.metrics["weight_reload_s"] = time.time() - t
    self._phase_t0 = time.time()

  def generate(self) -> bool:
    """One decode step of each generator with work; an idle one records its step in flight (the
    last samples). Returns whether any generator was busy."""
    busy = False
    for g in self.generators:
      if g.idle():
        g.run_until_idle()
      else:
        g.step()
        busy = True
    return busy

  def end(self) -> None:
    """Measures the phase's memory, then frees the generators' weights copies and KV caches for
    the training phase."""
    peak = bytes_in_use(self.devices)
    for g in self.generators:
      g.release(carry=self.carry_over)
    phase_s = time.time() - self._phase_t0
    released = peak - bytes_in_use(self.devices)
    self.metrics.update({"generation_phase_s": phase_s,
                         "carried_samples": float(sum(len(g.carry) for g in self.generators)),
                         "memory/generate_peak_bytes": float(peak),
                         "memory/generation_released_bytes": float(released)})
