"""model/named.py: models by name, as the benchmarks and tools pick them."""
import jax
import numpy as np
import pytest

from magistral_jax.model import named
from magistral_jax.model import transformer as T
from magistral_jax.model.config import LLAMA_3_2_1B, SMOLLM2_135M, ModelConfig


def test_llama1b_is_always_a_random_init_of_its_shapes_in_the_asked_dtype():
  cfg, params, source, path = named.load_model("llama1b", "bfloat16", weights="auto")
  assert params is None and path is None and "random init" in source
  assert cfg.num_layers == LLAMA_3_2_1B.num_layers and cfg.param_dtype == "bfloat16"


def test_smollm2_random_says_it_was_asked_for():
  cfg, params, source, _ = named.load_model("smollm2", "float32", weights="random")
  assert params is None and "asked for" in source
  assert cfg.hidden_size == SMOLLM2_135M.hidden_size


def test_bad_name_and_weights_say_what_is_accepted():
  with pytest.raises(ValueError, match="smollm2 or llama1b"):
    named.load_model("gpt2", "float32")
  with pytest.raises(ValueError, match="auto, gguf or random"):
    named.load_model("smollm2", "float32", weights="hf")


def test_random_params_is_transformer_init_params_of_the_seed():
  cfg = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=16, num_layers=1,
                    num_heads=2, num_kv_heads=1, head_dim=8)
  got = named.random_params(cfg, seed=3)
  want = T.init_params(cfg, jax.random.PRNGKey(3))
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
