"""Device meshes, logical-axis sharding rules and trainer -> generator resharding."""
from magistral_jax.parallel.sharding import (DEFAULT_RULES, GENERATOR_RULES, MESH_AXES,
                                             TRAINER_RULES, ShardingCtx, constrain,
                                             logical_sharding, logical_to_spec, make_mesh,
                                             param_shardings, replicated, reshard)

__all__ = ["DEFAULT_RULES", "GENERATOR_RULES", "MESH_AXES", "TRAINER_RULES", "ShardingCtx",
           "constrain", "logical_sharding", "logical_to_spec", "make_mesh", "param_shardings",
           "replicated", "reshard"]
