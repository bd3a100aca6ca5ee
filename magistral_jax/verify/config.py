"""The run config's `verifier` section: the CPU pool that scores completions, and where it runs."""
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
  # Where completions are scored in a many-host run (README.md "Many hosts"): "leader", one pool
  # on the trainer leader's host; "generators", a pool on each generator process's host, which
  # sends its completions back scored (scoring grows with the generator hosts).
  placement: str = "leader"
  # The pool: "processes" (verify/pool.py, on this host) or "ray" (verify/ray_pool.py: Ray actors
  # on the hosts of the Ray cluster at `ray_address`; "" starts a Ray instance on this host).
  backend: str = "processes"
  ray_address: str = ""

  def __post_init__(self):
    if self.placement not in ("leader", "generators"):
      raise ValueError(f"verifier.placement must be leader|generators, got {self.placement!r}")
    if self.backend not in ("processes", "ray"):
      raise ValueError(f"verifier.backend must be processes|ray, got {self.backend!r}")
    if self.num_workers < 1:
      raise ValueError(f"verifier.num_workers={self.num_workers} must be >= 1")
    if not self.task_timeout_s > 0:
      raise ValueError(f"verifier.task_timeout_s={self.task_timeout_s} must be > 0")
    if self.max_tasks_per_worker < 1:
      raise ValueError(f"verifier.max_tasks_per_worker={self.max_tasks_per_worker} must be >= 1")
