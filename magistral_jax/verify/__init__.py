"""CPU verifier pool: scores completions with `magistral_jax.rewards.compute_reward`. The Ray
backend (an optional extra) is imported only when asked for, so `ray` stays optional."""
from magistral_jax.lazy_exports import lazy_exports

__getattr__, __all__ = lazy_exports(__name__, {
    "pool": ("VerifierPool",),
    "ray_pool": ("RayVerifierPool",),
    "config": ("VerifierConfig",),
})
