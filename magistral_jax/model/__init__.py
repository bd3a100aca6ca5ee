"""The policy model: config, Flax decoder, KV cache, checkpoints and tokenizers."""
from magistral_jax.model.config import ModelConfig, RopeScaling, UnsupportedArchitectureError
from magistral_jax.model.transformer import (KVCache, Transformer, cache_logical_axes, decode,
                                             decode_logits, forward_logits, hidden_states,
                                             init_cache, init_params, logits, param_logical_axes,
                                             param_shapes, token_logprobs)
