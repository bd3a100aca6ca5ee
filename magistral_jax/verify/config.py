"""The run config's `verifier` section: the CPU process pool that scores completions."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class VerifierConfig:
  """num_workers scoring processes; a task that takes longer than task_timeout_s is scored as
  failed (its worker is replaced), and each worker is replaced after max_tasks_per_worker tasks
  (what a long run's verifiers leak stays bounded)."""
  num_workers: int = 2
  task_timeout_s: float = 60.0
  max_tasks_per_worker: int = 500

  def __post_init__(self):
    if self.num_workers < 1:
      raise ValueError(f"verifier.num_workers={self.num_workers} must be >= 1")
    if not self.task_timeout_s > 0:
      raise ValueError(f"verifier.task_timeout_s={self.task_timeout_s} must be > 0")
    if self.max_tasks_per_worker < 1:
      raise ValueError(f"verifier.max_tasks_per_worker={self.max_tasks_per_worker} must be >= 1")
