"""The generation side of the RL run: a run's generators (generators), the verifier pool and
group scoring (Rollouts), and the many-process roles (remote)."""
from magistral_jax.lazy_exports import lazy_exports

__getattr__, __all__ = lazy_exports(__name__, {
    "errors": ("PipelineError",),
    "rollouts": ("RolloutBatch", "Rollouts"),
    "config": ("PipelineConfig",),
})
