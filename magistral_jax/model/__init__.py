"""The policy model: config, Flax decoder, KV cache, checkpoints and tokenizers."""
from magistral_jax.lazy_exports import lazy_exports

__getattr__, __all__ = lazy_exports(__name__, {
    "config": ("ModelConfig", "RopeScaling", "UnsupportedArchitectureError"),
    "transformer": ("KVCache", "Transformer", "cache_logical_axes", "decode", "decode_logits",
        "forward_logits", "hidden_states", "init_cache", "init_params", "logits",
        "param_logical_axes", "param_shapes", "token_logprobs"),
})
