"""CPU verifier pool (pool): scores completions with `magistral_jax.rewards.reward.compute_reward`.
The Ray backend (ray_pool, an optional extra) is imported only when asked for, so `ray` stays
optional."""
