"""The policy model against references: transformers' logits, its own full forward, packing, sharding."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from magistral_jax.model.hf_layout import hf_to_params
from magistral_jax.model import transformer as T
from magistral_jax.model.config import (LLAMA_3_2_1B, SMOLLM2_135M, ModelConfig, RopeScaling,
                                         UnsupportedArchitectureError)
from magistral_jax.parallel.sharding import ShardingCtx, make_mesh, param_shardings


def _hf_mistral(num_heads=4, num_kv_heads=2, sliding_window=None, seed=0, tie=False,
                arch="mistral", rope_scaling=None):
  import transformers
  torch.manual_seed(seed)
  kw = dict(vocab_size=211, hidden_size=64, intermediate_size=112, num_hidden_layers=3,
            num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, head_dim=16,
            rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=tie,
            max_position_embeddings=256)
  if arch == "mistral":
    hf_cfg = transformers.MistralConfig(sliding_window=sliding_window, **kw)
    model = transformers.MistralForCausalLM(hf_cfg)
  else:
    hf_cfg = transformers.LlamaConfig(rope_scaling=rope_scaling, **kw)
    model = transformers.LlamaForCausalLM(hf_cfg)
  model.eval()
  # Non-trivial norm scales, so a mis-mapped norm cannot hide behind all-ones.
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:
        p.copy_(1.0 + 0.1 * torch.randn_like(p))
  return model


def _ours_from_hf(model):
  cfg = ModelConfig.from_hf_config(model.config.to_dict())
  sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
  return cfg, hf_to_params(lambda name: sd[name], cfg)


def _hf_logits(model, tokens):
  with torch.no_grad():
    return model(torch.tensor(np.asarray(tokens))).logits.numpy()


@pytest.mark.parametrize("num_heads,num_kv_heads,sliding_window", [
    (4, 2, None),   # GQA ratio 2
    (8, 2, None),   # GQA ratio 4
    (4, 2, 5),      # sliding window shorter than the sequence
])
def test_logits_match_transformers_mistral(num_heads, num_kv_heads, sliding_window):
  model = _hf_mistral(num_heads, num_kv_heads, sliding_window)
  cfg, params = _ours_from_hf(model)
  assert cfg.sliding_window == sliding_window
  tokens = np.random.RandomState(0).randint(0, cfg.vocab_size, (2, 24))
  ours = np.asarray(T.forward_logits(params, cfg, jnp.asarray(tokens)))
  ref = _hf_logits(model, tokens)
  assert np.max(np.abs(ours - ref)) < 1e-4


def test_logits_match_transformers_llama3_rope_scaling_tied():
  rs = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}
  model = _hf_mistral(arch="llama", tie=True, rope_scaling=rs)
  cfg, params = _ours_from_hf(model)
  assert cfg.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 32) and cfg.tie_word_embeddings
  assert "lm_head" not in params
  tokens = np.random.RandomState(1).randint(0, cfg.vocab_size, (2, 40))
  ours = np.asarray(T.forward_logits(params, cfg, jnp.asarray(tokens)))
  assert np.max(np.abs(ours - _hf_logits(model, tokens))) < 1e-4


def _tiny(**kw):
  base = dict(vocab_size=101, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
              num_kv_heads=2, head_dim=8)
  base.update(kw)
  return ModelConfig(**base)


@pytest.mark.parametrize("sliding_window,layout,per_layer", [
    (None, "stacked", False), (4, "stacked", False), (4, "decode", False), (4, "decode", True),
    (None, "stacked", True)])
def test_decode_with_kv_cache_equals_full_forward(sliding_window, layout, per_layer):
  cfg = _tiny(sliding_window=sliding_window)
  params = T.init_params(cfg, jax.random.PRNGKey(0))
  tokens = jax.random.randint(jax.random.PRNGKey(1), (3, 12), 0, cfg.vocab_size)
  full = T.forward_logits(params, cfg, tokens)
  dec_params = T.to_decode_layout(params) if layout == "decode" else params
  # Prefill 5 tokens at once, then one token at a time.
  cache = T.init_cache(cfg, 3, 16, per_layer=per_layer)
  step = jax.jit(lambda p, t, c: T.decode_logits(p, cfg, t, c))
  lg, cache = step(dec_params, tokens[:, :5], cache)
  outs = [lg]
  for i in range(5, 12):
    lg, cache = step(dec_params, tokens[:, i:i + 1], cache)
    outs.append(lg)
  np.testing.assert_allclose(jnp.concatenate(outs, 1), full, atol=2e-5)
  assert np.all(np.asarray(cache.lengths) == 12)
  assert T.is_per_layer_cache(cache) == per_layer   # the cache comes back in the form it went in


def test_decode_layout_round_trip_and_same_decode():
  """The decode layout holds the same arrays, one per layer: stacking them back is bit-exact, and
  a decode step over either layout with a stacked KV cache gives bitwise the same logits and KV
  cache. With a per-layer cache (keys stored transposed, so the score product sums in another
  order) logits and cache agree to fp32 rounding, and the cache converts both ways exactly."""
  cfg = _tiny()
  params = T.init_params(cfg, jax.random.PRNGKey(0))
  dec = T.to_decode_layout(params)
  assert T.is_decode_layout(dec) and len(dec["layers"]) == cfg.num_layers
  assert dec["layers"][1]["mlp"]["up_proj"]["kernel"].shape == \
      params["layers"]["mlp"]["up_proj"]["kernel"].shape[1:]
  jax.tree.map(np.testing.assert_array_equal, T.to_stacked_layout(dec), params)
  tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 6), 0, cfg.vocab_size)
  run = jax.jit(lambda p, t: T.decode_logits(p, cfg, t, T.init_cache(cfg, 2, 8)))
  (a, ca), (b, cb) = run(params, tokens), run(dec, tokens)
  np.testing.assert_array_equal(a, b)
  jax.tree.map(np.testing.assert_array_equal, ca, cb)
  run_pl = jax.jit(lambda p, t: T.decode_logits(p, cfg, t, T.init_cache(cfg, 2, 8,
                                                                          per_layer=True)))
  c, cc = run_pl(dec, tokens)
  np.testing.assert_allclose(c, a, rtol=1e-6, atol=1e-6)
  assert len(cc.k) == cfg.num_layers
  assert cc.k[0].shape == (2, cfg.num_kv_heads, cfg.head_dim, 8)   # keys stored transposed
  assert cc.v[0].shape == (2, cfg.num_kv_heads, 8, cfg.head_dim)
  close = lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-6)
  jax.tree.map(close, T.stack_cache(cc), ca)
  jax.tree.map(np.testing.assert_array_equal, T.unstack_cache(T.stack_cache(cc)), cc)


def test_decode_slots_with_different_lengths():
  """Each slot writes at its own offset: slot b at length L_b gives the same logits as a full
  forward over that slot's own sequence."""
  cfg = _tiny()
  params = T.init_params(cfg, jax.random.PRNGKey(0))
  seqs = [np.random.RandomState(s).randint(0, cfg.vocab_size, n) for s, n in [(0, 3), (1, 7)]]
  cache = T.init_cache(cfg, 2, 12)
  # Padded prefill: both slots get 7 tokens written, but slot 0 keeps only its 3 true tokens.
  padded = np.zeros((2, 7), np.int32)
  padded[0, :3], padded[1] = seqs[0], seqs[1]
  _, cache = T.decode(params, cfg, jnp.asarray(padded), cache, num_new=jnp.array([3, 7]))
  nxt = jnp.array([[5], [9]])
  lg, cache = T.decode_logits(params, cfg, nxt, cache)
  for b in range(2):
    full = T.forward_logits(params, cfg, jnp.asarray(np.append(seqs[b], nxt[b, 0]))[None])
    np.testing.assert_allclose(lg[b, 0], full[0, -1], atol=2e-5)
  assert list(np.asarray(cache.lengths)) == [4, 8]


def test_packed_sequences_equal_separate_runs():
  cfg = _tiny()
  params = T.init_params(cfg, jax.random.PRNGKey(0))
  rng = np.random.RandomState(0)
  a, b = rng.randint(0, cfg.vocab_size, 6), rng.randint(0, cfg.vocab_size, 9)
  tokens = np.zeros((1, 18), np.int32)
  tokens[0, :6], tokens[0, 6:15] = a, b
  positions = np.concatenate([np.arange(6), np.arange(9), np.zeros(3)])[None].astype(np.int32)
  segments = np.array([[1] * 6 + [2] * 9 + [0] * 3])
  packed = T.forward_logits(params, cfg, jnp.asarray(tokens), jnp.asarray(positions),
                            jnp.asarray(segments))
  sep_a = T.forward_logits(params, cfg, jnp.asarray(a)[None])
  sep_b = T.forward_logits(params, cfg, jnp.asarray(b)[None])
  np.testing.assert_allclose(packed[0, :6], sep_a[0], atol=2e-5)
  np.testing.assert_allclose(packed[0, 6:15], sep_b[0], atol=2e-5)


@pytest.mark.parametrize("pieces,tied", [(0, False), (1, False), (3, True)])
def test_chunked_token_logprobs_and_entropy_match_full_softmax(pieces, tied):
  # pieces: the head's vocab ranges (0 = auto, 4 on CPU; 3 gives uneven ranges), tied or not.
  cfg = _tiny(logits_chunk=5, logits_vocab_pieces=pieces, tie_word_embeddings=tied)
  assert len(T.vocab_pieces(cfg)) == (pieces or 4)
  # The tied random embedding (normal(1)) gives logits up to ~55 and near-zero entropies: the
  # case where an lse - Σ p·lg entropy lost up to 5e-5 to cancellation (and went negative).
  tol = 1e-5
  params = T.init_params(cfg, jax.random.PRNGKey(0))
  tokens = jax.random.randint(jax.random.PRNGKey(2), (2, 13), 0, cfg.vocab_size)
  h = T.hidden_states(params, cfg, tokens)
  for temp in (1.0, 0.7):
    lp, ent = T.token_logprobs(params, cfg, h, tokens, temperature=temp, with_entropy=True)
    full = jax.nn.log_softmax(T.logits(params, cfg, h) / temp)
    ref_lp = jnp.take_along_axis(full, tokens[..., None], -1)[..., 0]
    ref_ent = -jnp.sum(jnp.exp(full) * full, -1)
    np.testing.assert_allclose(lp, ref_lp, atol=tol)
    np.testing.assert_allclose(ent, ref_ent, atol=tol)
  # Gradients through the checkpointed chunks equal those of the plain computation.
  g1 = jax.grad(lambda p: T.token_logprobs(p, cfg, T.hidden_states(p, cfg, tokens), tokens).sum())(params)
  g2 = jax.grad(lambda p: jnp.take_along_axis(jax.nn.log_softmax(T.forward_logits(p, cfg, tokens)),
                                              tokens[..., None], -1).sum())(params)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=tol), g1, g2)


def test_forward_on_2x4_mesh_equals_unsharded():
  assert jax.device_count() == 8
  cfg = _tiny(num_heads=4, num_kv_heads=4, vocab_size=128, intermediate_size=64)
  params = T.init_params(cfg, jax.random.PRNGKey(0))
  tokens = jax.random.randint(jax.random.PRNGKey(1), (4, 16), 0, cfg.vocab_size)
  ref = T.forward_logits(params, cfg, tokens)
  mesh = make_mesh({"fsdp": 2, "tensor": 4})
  shard = ShardingCtx(mesh)
  shardings = param_shardings(T.param_logical_axes(cfg), mesh, shapes_tree=params)
  sharded = jax.device_put(params, shardings)
  # The parameters really are split across devices.
  q = sharded["layers"]["attn"]["q_proj"]["kernel"]
  assert q.sharding.shard_shape(q.shape) == (2, 16, 1, 8)
  tok = jax.device_put(tokens, shard.sharding(("act_batch", None)))
  fwd = jax.jit(lambda p, t: T.forward_logits(p, cfg, t, shard=shard))
  np.testing.assert_allclose(fwd(sharded, tok), ref, atol=1e-5)


def test_compute_dtype_bf16_with_fp32_params_stays_close():
  cfg = _tiny()
  params = T.init_params(cfg, jax.random.PRNGKey(0))
  tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 8), 0, cfg.vocab_size)
  ref = T.forward_logits(params, cfg, tokens)
  bf = T.forward_logits(params, cfg.replace(dtype="bfloat16"), tokens)
  assert bf.dtype == jnp.float32  # logits always come back in fp32
  assert float(jnp.max(jnp.abs(bf - ref))) < 0.1
  p16 = T.init_params(cfg.replace(param_dtype="bfloat16"), jax.random.PRNGKey(0))
  assert p16["layers"]["mlp"]["up_proj"]["kernel"].dtype == jnp.bfloat16


def test_unsupported_architecture_is_named():
  with pytest.raises(UnsupportedArchitectureError, match="GPT2LMHeadModel"):
    ModelConfig.from_hf_config({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})


def test_model_section_rejects_unknown_fields_and_reads_rope_scaling():
  import ml_collections

  from magistral_jax.config import checked_fields
  cd = ml_collections.ConfigDict(dict(vocab_size=64, hidden_sise=32))
  with pytest.raises(ValueError, match="hidden_sise"):
    checked_fields(ModelConfig, cd, "model")
  cd = ml_collections.ConfigDict(dict(vocab_size=64, num_layers=3,
                                      rope_scaling=dict(factor=32.0)))
  cfg = ModelConfig(**checked_fields(ModelConfig, cd, "model"))
  assert cfg.vocab_size == 64 and cfg.num_layers == 3 and cfg.rope_scaling.factor == 32.0
  assert ModelConfig(rope_scaling={}).rope_scaling is None


def test_model_presets_have_the_published_sizes():
  """The random-init presets the benchmarks use: SmolLM2-135M (134,515,008 parameters) and
  Llama-3.2-1B (1,235,814,400, tied head); the parameter tree holds exactly that many."""
  for cfg, n in ((SMOLLM2_135M, 134_515_008), (LLAMA_3_2_1B, 1_235_814_400)):
    assert cfg.num_params() == n
    assert sum(int(np.prod(x.shape)) for x in jax.tree.leaves(T.param_shapes(cfg))) == n
  assert LLAMA_3_2_1B.rope_scaling.factor == 32.0 and LLAMA_3_2_1B.tie_word_embeddings
