"""The RL prompt stream with each group's sampling seed: what a run draws, and what its checkpoint
keeps so that a resumed run draws the prompts and seeds that a run never stopped would (before,
a resumed run drew the first batches' seeds again)."""
from __future__ import annotations

from typing import Iterator

import numpy as np


class SeededPrompts:
  """`prompts` (task dicts; `state()` if the run checkpoints them), each drawn with a seed from
  one numpy stream of `seed`, fast-forwarded past the `seeds_drawn` a resumed run had drawn."""

  def __init__(self, prompts: Iterator[dict], seed: int = 0, seeds_drawn: int = 0):
    self.prompts = prompts
    self.rng = np.random.default_rng(seed)
    for _ in range(seeds_drawn):   # one draw at a time, as drawn: numpy fills arrays otherwise
      self.rng.integers(2**31)
    self.seeds_drawn = seeds_drawn
    self.exhausted = False

  def seed(self) -> int:
    self.seeds_drawn += 1
    return int(self.rng.integers(2**31))

  def next(self) -> dict | None:
    """The next prompt; None, then always, once the stream ends."""
    task = None if self.exhausted else next(self.prompts, None)
    self.exhausted = task is None
    return task

  def state(self) -> tuple[dict, dict]:
    """(the prompt stream's state, the seeds drawn): a checkpoint's `data` and `rng`."""
    return self.prompts.state(), {"seeds_drawn": self.seeds_drawn}
