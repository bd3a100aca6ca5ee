"""CPU verifier pool: scores completions with `magistral_jax.rewards.compute_reward`."""
from magistral_jax.verify.pool import VerifierPool


def RayVerifierPool(*args, **kwargs):   # noqa: N802  (a class behind a lazy import)
  """The Ray backend (optional extra); imported lazily so `ray` stays optional."""
  from magistral_jax.verify.ray_pool import RayVerifierPool as cls
  return cls(*args, **kwargs)


__all__ = ["VerifierPool", "RayVerifierPool"]
