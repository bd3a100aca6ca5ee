"""Live-length decode attention (model/decode_live.py) in Pallas's interpreter on CPU: the same
attention as the dense reference, reading only the key blocks a slot has reached, chosen where it
applies, and the engine's samples unchanged with it."""
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from magistral_jax.generate.config import SamplingConfig
from magistral_jax.generate.engine import Engine
from magistral_jax.generate.loop import DIRECT, GeneratorLoop
from magistral_jax.generate.requests import Request
from magistral_jax.model import decode_live as D
from magistral_jax.model import transformer as T
from magistral_jax.model.decode_choice import choose_decode
from magistral_jax.model.config import ModelConfig
from magistral_jax.parallel.sharding import make_mesh


def _inputs(b, h, kh, d, s, dtype=jnp.float32, seed=0):
  ks = jax.random.split(jax.random.PRNGKey(seed), 3)
  return (jax.random.normal(ks[0], (b, 1, h, d), dtype),
          jax.random.normal(ks[1], (b, kh, d, s), dtype),
          jax.random.normal(ks[2], (b, kh, s, d), dtype))


@pytest.mark.parametrize("h,kh,d,s", [(9, 3, 64, 192), (4, 4, 16, 32), (8, 2, 32, 512),
                                      (32, 8, 128, 128)])
def test_equals_the_dense_reference_at_every_length(h, kh, d, s):
  """Grouped-query heads (G = 3, 1, 4, 4), caches tiled by blocks of 64, 32, 128, 128; slots
  empty, at one position, at a block's edge, just past it, and full (a length past the cache
  reads the whole cache)."""
  block = D.block_for(s)
  n = jnp.array([0, 1, block, block + 1, s - 1, s, s + 7])
  q, kt, v = _inputs(len(n), h, kh, d, s)
  out = D.decode_attention(q, kt, v, n, interpret=True)
  np.testing.assert_allclose(out, D.reference(q, kt, v, jnp.minimum(n, s)), atol=2e-6,
                             rtol=1e-5)
  assert not np.any(out[0])   # a slot that attends to nothing returns zeros


def test_bf16_cache_with_fp32_queries_and_bf16_queries():
  q, kt, v = _inputs(3, 6, 2, 64, 256, seed=1)
  n = jnp.array([5, 130, 256])
  kt16, v16 = kt.astype(jnp.bfloat16), v.astype(jnp.bfloat16)
  ref = D.reference(q, kt16, v16, n)
  np.testing.assert_allclose(D.decode_attention(q, kt16, v16, n, interpret=True), ref,
                             atol=1e-5, rtol=1e-5)
  out16 = D.decode_attention(q.astype(jnp.bfloat16), kt16, v16, n, interpret=True)
  assert out16.dtype == jnp.bfloat16
  np.testing.assert_allclose(out16.astype(jnp.float32), ref, atol=3e-2, rtol=3e-2)


def test_each_slot_reads_only_the_blocks_it_has_reached():
  """The kernel's own count of the key blocks each (slot, KV head) program read is
  ceil(n / block): a slot at 300 of 512 positions reads 3 of 4 blocks of 128."""
  s = 512
  n = jnp.array([0, 1, 128, 129, 300, 512])
  q, kt, v = _inputs(len(n), 4, 2, 32, s)
  read = np.asarray(D.blocks_read(q, kt, v, n, interpret=True))
  want = [math.ceil(int(x) / D.block_for(s)) for x in n]
  assert read.shape == (len(n), 2) and read.tolist() == [[w, w] for w in want]
  assert want == [0, 1, 1, 2, 3, 4]


def test_shapes_it_refuses_say_why():
  q, kt, v = _inputs(2, 4, 2, 24, 64)
  with pytest.raises(ValueError, match="head_dim 24"):
    D.decode_attention(q, kt, v, jnp.array([1, 2]), interpret=True)
  q, kt, v = _inputs(2, 4, 2, 32, 40)
  with pytest.raises(ValueError, match="cache length 40"):
    D.decode_attention(q, kt, v, jnp.array([1, 2]), interpret=True)
  assert D.block_for(40) is None and D.block_for(48) == 16 and D.block_for(4224) == 128


def test_choose_decode():
  kw = dict(head_dim=64, new_tokens=1, cache_length=4224, window=None)
  assert choose_decode("auto", platform="cuda", **kw) == "live"
  assert choose_decode("auto", platform="cuda", compiles=False, **kw) == "xla"
  assert choose_decode("auto", platform="cpu", **kw) == "xla"
  assert choose_decode("auto", platform="tpu", **kw) == "xla"
  assert choose_decode("xla", platform="cuda", **kw) == "xla"
  assert choose_decode("live", platform="cpu", **kw) == "live"
  assert choose_decode("live", platform="cuda", compiles=False, **kw) == "live"
  # Where it does not apply: auto keeps XLA's; an explicit request is an error.
  for bad in (dict(new_tokens=4), dict(head_dim=80), dict(cache_length=4220),
              dict(window=1024)):
    assert choose_decode("auto", platform="cuda", **{**kw, **bad}) == "xla"
    with pytest.raises(ValueError, match="decode_attention='live' takes"):
      choose_decode("live", platform="cuda", **{**kw, **bad})
  assert choose_decode("auto", platform="cuda", **{**kw, "window": 4224}) == "live"
  with pytest.raises(ValueError, match="decode_attention must be one of"):
    choose_decode("paged", platform="cuda", **kw)
  with pytest.raises(ValueError, match="decode_attention must be one of"):
    ModelConfig(decode_attention="paged")


CFG = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16)


@pytest.mark.parametrize("sampling", [SamplingConfig(greedy=True, max_new_tokens=8),
                                      SamplingConfig(temperature=0.7, top_p=0.9,
                                                     max_new_tokens=8)])
def test_the_engine_samples_the_same_with_live_decode(sampling, monkeypatch):
  """A generator on a tensor-parallel mesh of 2 (the kernel runs per shard): every sample and
  log-prob of slots at different lengths, refilled as they finish, equals XLA's decode."""
  traced = []
  kernel = D.decode_attention
  monkeypatch.setattr(D, "decode_attention", lambda *a, **kw: traced.append(a) or kernel(*a, **kw))
  mesh = make_mesh({"tensor": 2}, jax.devices()[:2])
  params = jax.jit(lambda k: jax.tree.map(lambda x: x * 4 if x.ndim > 1 else x,
                                          T.init_params(CFG, k)))(jax.random.PRNGKey(0))
  rs = np.random.RandomState(3)
  ps = [rs.randint(1, CFG.vocab_size, rs.randint(3, 14)).tolist() for _ in range(6)]
  got, read = {}, {}
  shared = ps[0][:3]   # prompts 0 and 3 continue a cached prefix: a prefill over the cache
  ps[3] = shared + ps[3]
  for impl in ("xla", "live"):
    eng = Engine(dataclasses.replace(CFG, decode_attention=impl), mesh,
                 max_concurrent_decodes=4, max_prefill_length=16, max_decode_length=16,
                 sampling=sampling, prefill_buckets=(8, 16))
    assert eng.decode_attention == impl
    loop = GeneratorLoop(eng, params, options=DIRECT, shared_prefix=shared, sampling=eng.sampling)
    for i, p in enumerate(ps):
      loop.submit(Request(i, p, max_new_tokens=2 + (5 * i) % 12, seed=i))
    got[impl] = {(c.request_id, c.sample_index): c for c in loop.run_until_idle()}
    read[impl] = loop.metrics()["attention_window_fraction"]
    assert loop.metrics()["shared_prefix_hits"] >= 2
  # XLA's step reads the whole cache; the live one what the slots hold (prompts of 3-13 tokens
  # plus up to 13 new ones in a cache of 32), and no empty slot.
  assert read["xla"] == 1.0 and 0.1 < read["live"] < 0.6
  # Traced per layer, per shard, for the generate program (and only with "live").
  assert traced and all(a[0].shape[2] == CFG.num_heads // 2 for a in traced)
  assert got["live"].keys() == got["xla"].keys() and len(got["xla"]) == 6
  for k, c in got["xla"].items():
    assert got["live"][k].tokens == c.tokens, k
    np.testing.assert_allclose(got["live"][k].logprobs, c.logprobs, atol=1e-5)


def test_a_live_engine_keeps_one_window():
  """Live decode reads what each slot holds whatever the window: more windows would only add
  compiled programs."""
  mesh = make_mesh({"tensor": 1}, jax.devices()[:1])
  kw = dict(max_concurrent_decodes=2, max_prefill_length=16, max_decode_length=16,
            attention_windows=(8, 16))
  assert Engine(dataclasses.replace(CFG, decode_attention="live"), mesh,
                **kw).attention_windows == (32,)
  assert Engine(dataclasses.replace(CFG, decode_attention="xla"), mesh,
                **kw).attention_windows == (8, 16, 32)


def test_auto_checks_the_kernel_against_the_reference_first(monkeypatch, caplog):
  """Before auto takes the kernel on a machine it runs a small call and compares it with the
  dense reference: a kernel that compiles but computes wrong (a lowering bug) is not taken."""
  from magistral_jax.model import decode_choice as A
  A.live_decode_works.cache_clear()
  assert A.live_decode_works(64, "float32") and A.live_decode_works(64, "bfloat16")
  A.live_decode_works.cache_clear()
  monkeypatch.setattr(D, "decode_attention", lambda q, *a, **kw: q * 0)
  assert not A.live_decode_works(64, "float32")
  assert "does not work here" in caplog.text and "against the dense reference" in caplog.text
  A.live_decode_works.cache_clear()
