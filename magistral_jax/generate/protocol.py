"""What a rollout pipeline needs of a generator (pipeline.rollouts.Rollouts), as a Protocol.

Two implement it: GeneratorLoop (generate/loop.py, on this process's devices) and
pipeline.remote.RemoteGenerator (a GeneratorLoop in another process, seen through a mailbox).
Where the two differ (a push moves the trainer's params device to device onto a local engine, or
through the cross-process weight transfer), the protocol has one method both implement, so the
pipeline never asks which kind it holds.
"""
from __future__ import annotations

from typing import Callable, Protocol

from magistral_jax.generate.counters import LoopCounters
from magistral_jax.generate.requests import Request, Sample


class GeneratorLimits(Protocol):
  """The engine's shapes that bound every sample (a row of the trainer's batch must hold a
  prompt and its completion) and size the generator's slots."""
  max_concurrent_decodes: int
  max_prefill_length: int
  max_decode_length: int


class Generator(Protocol):
  """engine: its limits. callback: called with each finished Sample (from the generator's own
  thread), set by the pipeline before start(). counters: the loop's running counters
  (counters.LoopCounters: steps, active_slot_steps, decode_time_s, idle_time_s,
  shared_prefix_hits, ...), read for the pipeline's utilisation metrics."""
  engine: GeneratorLimits
  callback: Callable[[Sample], None] | None
  counters: LoopCounters

  def start(self) -> object:
    """Starts generating in the generator's own thread."""

  def stop(self, timeout: float | None = 30.0) -> None:
    """Stops it; raises TimeoutError when it is still running after `timeout` seconds."""

  def check(self) -> None:
    """Raises the generator's failure, if it failed (with its traceback)."""

  def submit(self, request: Request) -> None:
    """Queues a request (its group's samples come back through `callback`); raises ValueError,
    queueing nothing, for one the generator cannot take (e.g. a prompt over its limits)."""

  def push(self, params, version: int, cast: dict | None = None) -> None:
    """The trainer's params as policy `version`, in flight (the generator continues its
    sequences on them). Returns once the generator has them. `cast`: a dict the generators of
    one push share, so those on one dtype share one cast of the params."""
