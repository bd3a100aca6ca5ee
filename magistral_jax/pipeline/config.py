"""The run config's `pipeline` section: the paper's asynchronous bounds (paper §4, §5)."""
from __future__ import annotations

import dataclasses

from magistral_jax.rl.config import GRPOConfig


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
  """The run config's `pipeline` section (magistral_jax/config.py takes its defaults from here)."""
  mode: str = "async"        # 'async' (paper) | 'sync' (barrier between phases)
  # The paper's n_async (paper §4: n_async / n_batch <= 2 for Medium): completions generated and
  # not yet trained on (generating, scoring, waiting for their group or a batch, being trained
  # on). 0 means 2 * n_batch.
  n_async: int = 0
  # Loosens that bound: generating + queued may reach n_async + max_queue, while generating alone
  # stays within n_async. 0 (the default) is the paper's bound.
  max_queue: int = 0
  sample_every: int = 5      # log one decoded sample every N batches (0 = never)
  batch_timeout_s: float = 1800.0  # a batch that does not fill in this time is an error, not a hang
  # Stop, naming the likely cause (e.g. no completion meets the format), once this many groups in
  # a row were dropped: no batch can form. 0 = never. A run that drops 95% of its groups at random
  # sees 256 in a row about once in 10^7 groups (98%: once in 10^4).
  max_consecutive_dropped: int = 256
  wait_log_s: float = 30.0   # while the trainer waits for a batch, a progress line this often
  # Many hosts: with every generator process lost, how long the leader waits for a relaunched one
  # to rejoin before it stops the run (pipeline/remote.py).
  generator_rejoin_s: float = 600.0
  # Colocated async: generation and training take turns on the devices (as colocated sync does),
  # generation running up to n_async ahead; a phase ends once its batch is ready, and the samples
  # still generating carry into the next phase (generate/carry.py: tokens kept, their KV
  # prefilled again under the new weights) instead of the phase waiting for its longest one.
  carry_over: bool = False

  def __post_init__(self):
    if self.mode not in ("async", "sync"):
      raise ValueError(f"pipeline.mode must be async|sync, got {self.mode!r}")
    if self.carry_over and self.mode != "async":
      raise ValueError("pipeline.carry_over carries samples into the next phase, within n_async: "
                       "it needs pipeline.mode='async' (sync mode trains on one version)")
    if (min(self.n_async, self.max_queue, self.sample_every, self.max_consecutive_dropped,
            self.wait_log_s, self.generator_rejoin_s) < 0 or self.batch_timeout_s <= 0):
      raise ValueError(f"pipeline: n_async, max_queue, sample_every, max_consecutive_dropped, "
                       f"wait_log_s, generator_rejoin_s must be >= 0 and batch_timeout_s > 0, "
                       f"got {self}")

  def bounds(self, grpo: GRPOConfig) -> tuple[int, int]:
    """(n_async, max_queue) with the 0 default of n_async resolved; errors for bounds that could
    never fill a batch."""
    n_async = self.n_async or 2 * grpo.n_batch
    if self.mode == "async":
      if n_async < grpo.group_size:
        raise ValueError(f"n_async={n_async} < group_size={grpo.group_size}: no group could "
                         "ever be submitted")
      if n_async + self.max_queue < grpo.n_batch:
        raise ValueError(f"n_async + max_queue = {n_async + self.max_queue} < "
                         f"n_batch={grpo.n_batch}: a batch could never fill")
    return n_async, self.max_queue
