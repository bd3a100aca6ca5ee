"""The optional JetStream adapter. The package is an extra; the driving test skips without it."""
import importlib.util

import jax
import numpy as np
import pytest

from magistral_jax.generate.config import SamplingConfig
from magistral_jax.generate.engine import Engine
from magistral_jax.generate import jetstream_adapter as JA
from magistral_jax.model import transformer as T
from magistral_jax.model.config import ModelConfig
from magistral_jax.parallel.sharding import make_mesh

CFG = ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                  num_kv_heads=1, head_dim=8)
HAVE_JETSTREAM = importlib.util.find_spec("jetstream") is not None


def _engine():
  return Engine(CFG, make_mesh({"tensor": 1}, jax.devices()[:1]), max_concurrent_decodes=2,
                max_prefill_length=8, max_decode_length=4, prefill_buckets=(8,),
                sampling=SamplingConfig(greedy=True))


@pytest.mark.skipif(HAVE_JETSTREAM, reason="jetstream is installed")
def test_adapter_without_the_extra_names_it_in_the_error():
  with pytest.raises(ImportError, match="google-jetstream"):
    JA.make_jetstream_engine(_engine(), T.init_params(CFG, jax.random.PRNGKey(0)),
                             temperature=1.0)
  assert hasattr(jax, "tree_map")  # the shim was installed before the import was tried


@pytest.mark.skipif(not HAVE_JETSTREAM, reason="optional extra google-jetstream not installed")
def test_jetstream_engine_contract_drives_our_engine():
  eng = _engine()
  js = JA.make_jetstream_engine(eng, T.init_params(CFG, jax.random.PRNGKey(0)), temperature=1.0)
  params = js.load_params()
  state = js.init_decode_state()
  padded, n, _ = eng.pad_prompt([3, 4, 5])
  prefix, first = js.prefill(params=params, padded_tokens=padded, true_length=n)
  state = js.insert(prefix, state, 1)
  state, res = js.generate(params, state)
  data = np.asarray(res.data)
  assert data.shape == (2, 3) and data[1, 1] == 1 and data[1, 2] == n + 1
  assert js.max_concurrent_decodes == 2 and js.max_prefill_length == 8
