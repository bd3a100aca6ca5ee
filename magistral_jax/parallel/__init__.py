"""Device meshes and logical-axis sharding rules."""
from magistral_jax.parallel.sharding import (ShardingCtx, constrain, logical_sharding,
                                             logical_to_spec, make_mesh, param_shardings,
                                             replicated)
from magistral_jax.parallel.config import (DEFAULT_RULES, GENERATOR_RULES, LOGICAL_AXES, MESH_AXES,
                                           TRAINER_RULES, ShardingConfig, rules_from_config)

__all__ = ["DEFAULT_RULES", "GENERATOR_RULES", "LOGICAL_AXES", "MESH_AXES", "TRAINER_RULES",
           "ShardingConfig", "ShardingCtx", "constrain", "logical_sharding", "logical_to_spec",
           "make_mesh", "param_shardings", "replicated", "rules_from_config"]
