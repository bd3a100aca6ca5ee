"""The run config's `eval` section: the held-out evaluation (paper §4: temperature 0.7, top-p
1.0 for math, 0.95 for code; pass@1 averaged over k samples and maj@k)."""
from __future__ import annotations

import dataclasses

from magistral_jax.generate.config import SamplingConfig


@dataclasses.dataclass(frozen=True)
class EvalConfig:
  """k samples per problem at `temperature`/`top_p` (or greedy), each up to max_new_tokens.
  before: a run evaluates its initial weights (False: a control run from the same weights as
  the run it controls); every: also every that many RL batches (the learning curve; 0 = only
  before and after)."""
  k: int = 1
  temperature: float = 0.7
  top_p: float = 1.0
  greedy: bool = True
  max_new_tokens: int = 256
  before: bool = True
  every: int = 0

  def __post_init__(self):
    if self.k < 1:
      raise ValueError(f"eval.k={self.k}: at least one sample per problem")
    if self.every < 0:
      raise ValueError(f"eval.every={self.every} must be >= 0 (0: before and after only)")

  def sampling(self, eos_id: int | None = None) -> SamplingConfig:
    """The evaluation's sampler."""
    return SamplingConfig(temperature=self.temperature, top_p=self.top_p, greedy=self.greedy,
                          max_new_tokens=self.max_new_tokens, eos_id=eos_id)
