"""How generation and training share time (pipeline.rollouts): the schedule Rollouts runs its
generators on, chosen once when it is built.

- `Concurrent`: every generator runs in its own thread, on devices of its own or (colocated
  async: one batch of lookahead) beside the trainer's step; a push moves the trainer's params
  onto each at once. Colocated, a push copies the params (the trainer donates its state), and
  the generators' weights copy and KV cache stay resident beside the trainer's step, so both
  must fit together.
- `TakingTurns` (pipeline.taking_turns; colocated sync, the default, and colocated async with
  pipeline.carry_over): the trainer's thread steps the generators in phases between train steps;
  they free their weights copy and KV cache before each train step, a push is only noted, and
  the next phase loads the newest params (the phases report their memory). With carry-over a
  phase ends once its batch is ready and the unfinished samples go on in the next one.

Both have the same methods, called by Rollouts at the same points: `start` with the pipeline,
`push` after each optimizer step, and `begin` / `generate` ... / `end` around the wait for each
batch; `metrics` joins the pipeline's.
"""
from __future__ import annotations

import time
from typing import Protocol, Sequence

from magistral_jax.generate.protocol import Generator
from magistral_jax.pipeline.taking_turns import TakingTurns


class Schedule(Protocol):
  metrics: dict[str, float]

  def start(self) -> None:
    """The pipeline starts."""

  def push(self, params, version: int) -> float:
    """The trainer's new params of policy `version`; returns the seconds the push took."""

  def begin(self) -> None:
    """Sync mode, before the generation of a batch."""

  def generate(self) -> bool:
    """Sync mode, while the batch fills: generation in the caller's thread, if the schedule does
    any; returns whether it did (the caller then waits less for scored samples)."""

  def end(self) -> None:
    """Sync mode, once the batch is full: before the trainer steps on it."""


class Concurrent:
  """The generators run in their own threads (see the module docstring)."""

  def __init__(self, generators: Sequence[Generator]):
    self.generators = list(generators)
    self.metrics: dict[str, float] = {}

  def start(self) -> None:
    for g in self.generators:
      g.start()

  def push(self, params, version: int) -> float:
    """Every generator gets the params, in flight (Generator.push): a local one device to device
    after a cast to its weight dtype on the trainer's devices, done once per dtype (bf16 under
    fp32 master weights and bf16 compute, ModelConfig.serving_param_dtype, so the transfer moves
    half the bytes); one in another process through its weight transfer."""
    t = time.time()
    cast = {}
    for g in self.generators:
      g.push(params, version, cast)
    return time.time() - t

  def begin(self) -> None:
    pass

  def generate(self) -> bool:
    return False

  def end(self) -> None:
    pass


def schedule_for(generators: Sequence[Generator], colocated: bool, mode: str,
                 carry_over: bool = False) -> Schedule:
  """TakingTurns for colocated sync mode and colocated carry-over (async), else Concurrent."""
  if colocated and (mode == "sync" or carry_over):
    return TakingTurns(generators, carry_over=carry_over)
  return Concurrent(generators)
