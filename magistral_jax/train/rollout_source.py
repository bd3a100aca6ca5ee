"""What the RL loop (train.rl_loop.train) needs of the generation side, defined here by its
consumer: batches of scored groups in, the trainer's params out after each optimizer step.

pipeline.rollouts.Rollouts (generators local or colocated) and pipeline.trainer_rollouts'
LeaderRollouts and FollowerRollouts (a run of many processes) implement it; train/ imports
nothing of pipeline/.
"""
from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np

from magistral_jax.rl.advantages import ScoredGroup
from magistral_jax.rl.config import GRPOConfig
from magistral_jax.rl.minibatch import Minibatch


class Batch(Protocol):
  """n_batch completions in kept groups (`groups`), and how long the trainer waited for them."""
  groups: Sequence[ScoredGroup]
  wait_s: float


class RolloutSource(Protocol):
  def next_batch(self) -> Batch | None:
    """Blocks until the next batch is ready; None once the prompts are exhausted."""

  def minibatches(self, batch: Batch, cfg: GRPOConfig, rng: np.random.Generator
                  ) -> list[Minibatch]:
    """The batch split into one packed Minibatch per optimizer step (rl.make_minibatches). With
    many trainer processes each gets only the rows its own devices hold."""

  def push(self, params, version: int) -> float:
    """The trainer's params after an optimizer step, as policy `version`, to the generators;
    returns the seconds it took."""

  def done(self, batch: Batch) -> None:
    """The trainer has consumed `batch` (its completions leave the off-policy bound)."""

  def metrics(self, batch: Batch, trained_version: int) -> dict:
    """The batch's metrics (reward, drops, off-policy lag; `trained_version`: the policy version
    of its first optimizer step) and the generation side's since the last call."""

  def sample_text(self, batch: Batch) -> str:
    """A completion of the batch, decoded, for the run's log of samples."""

  def close(self) -> None:
    """Stops whatever the source runs (threads, generators); safe to call twice."""

  def __enter__(self) -> "RolloutSource":
    """Starts the source; `with` closes it."""

  def __exit__(self, *exc) -> None:
    ...
