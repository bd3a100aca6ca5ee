"""The generation side of the RL run: generators, verifier pool and group scoring (Rollouts), and
the assembly of a run's parts (build)."""
from magistral_jax.pipeline.errors import PipelineError
from magistral_jax.pipeline.rollouts import RolloutBatch, Rollouts
from magistral_jax.pipeline.config import PipelineConfig

__all__ = ["PipelineConfig", "PipelineError", "RolloutBatch", "Rollouts"]
