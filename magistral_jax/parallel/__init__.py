"""Device meshes and logical-axis sharding rules."""
from magistral_jax.lazy_exports import lazy_exports

__getattr__, __all__ = lazy_exports(__name__, {
    "sharding": ("ShardingCtx", "constrain", "logical_sharding", "logical_to_spec", "make_mesh",
        "param_shardings", "replicated"),
    "config": ("DEFAULT_RULES", "GENERATOR_RULES", "LOGICAL_AXES", "MESH_AXES", "TRAINER_RULES",
        "ShardingConfig", "rules_from_config"),
})
