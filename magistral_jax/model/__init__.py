"""The policy model: config, Flax decoder, KV cache, checkpoints and tokenizers."""
