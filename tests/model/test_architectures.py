"""Bring your own model: Qwen2, Qwen3 and Mistral Small 3 checkpoints, as transformers writes them,
against transformers itself (scoring forward, greedy decode through our KV cache and through the
engine, a sharded forward, the HF -> orbax -> HF conversion) and the features we refuse.

Every model is a random-init one that transformers builds offline from a tiny config of the
architecture, saved with save_pretrained into a temporary directory and loaded with our loader.
"""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open

from magistral_jax.generate.config import SamplingConfig
from magistral_jax.generate.engine import Engine
from magistral_jax.generate.loop import GeneratorLoop
from magistral_jax.generate.requests import Request
from magistral_jax.model import transformer as T
from magistral_jax.model.config import ModelConfig, UnsupportedArchitectureError
from magistral_jax.model.hf_checkpoint import load_hf_safetensors
from magistral_jax.parallel.sharding import ShardingCtx, make_mesh, param_shardings
from magistral_jax.parallel.config import GENERATOR_RULES, TRAINER_RULES
from magistral_jax.run import convert as convert_checkpoint

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# 2 layers, hidden 64: small enough for CI on 2 cores, and every head/bias/norm mapping is there.
# initializer_range 0.1 spreads the logits, so greedy argmaxes are not near-ties that rounding
# differences between torch and XLA could flip.
BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            rms_norm_eps=1e-6, initializer_range=0.1, bos_token_id=None, eos_token_id=None)
ARCHS = {
    # Qwen2: q/k/v biases; Qwen2.5's small models tie their embeddings, the large ones do not.
    "qwen2": ("Qwen2", dict(BASE, rope_theta=1e6, tie_word_embeddings=False)),
    "qwen2_tied": ("Qwen2", dict(BASE, rope_theta=1e6, tie_word_embeddings=True)),
    # Qwen3: per-head q/k norm; head_dim 24 is not hidden / heads (16), as in Qwen3's own shapes.
    "qwen3": ("Qwen3", dict(BASE, head_dim=24, rope_theta=1e6, tie_word_embeddings=True)),
    # Mistral Small 3 scaled down with its ratios: heads*head_dim = hidden/1.25, 4 query heads per
    # kv head, intermediate 6.4x hidden, rope_theta 1e8, untied, no sliding window.
    "mistral_small": ("Mistral", dict(BASE, hidden_size=80, intermediate_size=512,
                                      num_attention_heads=8, num_key_value_heads=2, head_dim=8,
                                      rope_theta=1e8, sliding_window=None,
                                      tie_word_embeddings=False)),
}
_MODELS = {}


def hf_model(name, tmp_path_factory):
  """(transformers model in fp32, its save_pretrained directory), built once per architecture."""
  if name not in _MODELS:
    kind, kw = ARCHS[name]
    torch.manual_seed(0)
    hf_cfg = getattr(transformers, f"{kind}Config")(**kw)
    model = getattr(transformers, f"{kind}ForCausalLM")(hf_cfg)
    # Norm scales start at 1 and biases at 0: randomise both, so a mis-mapped one shows.
    with torch.no_grad():
      for pname, p in model.named_parameters():
        if "norm" in pname:
          p.uniform_(0.5, 1.5)
        elif pname.endswith(".bias"):
          p.normal_(0.0, 0.5)
    model.eval()
    path = str(tmp_path_factory.mktemp(name))
    model.save_pretrained(path, safe_serialization=True)
    _MODELS[name] = (model, path)
  return _MODELS[name]


@pytest.fixture(params=list(ARCHS))
def arch(request, tmp_path_factory):
  model, path = hf_model(request.param, tmp_path_factory)
  cfg, params = load_hf_safetensors(path)
  return request.param, model, path, cfg, params


def _hf_logits(model, seq):
  with torch.no_grad():
    return model(torch.tensor([seq])).logits[0].float().numpy()


def _packed(vocab, seed=0):
  """Two sequences (7 and 9 tokens) packed into one row of 18: positions restart, 2 padding."""
  rs = np.random.RandomState(seed)
  a, b = rs.randint(0, vocab, 7).tolist(), rs.randint(0, vocab, 9).tolist()
  tokens = np.array([a + b + [0, 0]])
  positions = np.array([list(range(7)) + list(range(9)) + [0, 0]])
  segments = np.array([[1] * 7 + [2] * 9 + [0, 0]])
  return (a, b), tokens, positions, segments


def test_config_reads_each_architecture(arch):
  name, model, path, cfg, params = arch
  hf = model.config
  assert cfg.architecture == type(model).__name__
  assert cfg.attention_bias == name.startswith("qwen2") and cfg.o_proj_bias is False
  assert cfg.qk_norm == (name == "qwen3")
  head_dim = getattr(hf, "head_dim", hf.hidden_size // hf.num_attention_heads)   # Qwen2: none
  assert cfg.head_dim == head_dim and cfg.tie_word_embeddings == hf.tie_word_embeddings
  assert cfg.rope_theta == ARCHS[name][1]["rope_theta"] and cfg.sliding_window is None
  assert ("lm_head" in params) != cfg.tie_word_embeddings
  attn = params["layers"]["attn"]
  assert ("bias" in attn["q_proj"]) == cfg.attention_bias and "bias" not in attn["o_proj"]
  assert ("q_norm" in attn) == cfg.qk_norm
  # What we write back reads as the same config, in transformers too.
  back = cfg.to_hf_config()
  assert ModelConfig.from_hf_config(back, param_dtype=cfg.param_dtype) == cfg
  rebuilt = transformers.AutoConfig.for_model(back.pop("model_type"), **back)
  for key in ("hidden_size", "num_key_value_heads", "tie_word_embeddings", "intermediate_size",
              "vocab_size", "rms_norm_eps", "sliding_window"):
    assert getattr(rebuilt, key) == getattr(hf, key), key
  assert rebuilt.head_dim == head_dim and rebuilt.rope_parameters == hf.rope_parameters
  assert getattr(rebuilt, "attention_bias", None) == getattr(hf, "attention_bias", None)


def test_packed_scoring_logits_match_transformers(arch):
  """fp32 tightly, and bf16 weights and compute within bf16's rounding, against transformers
  run on each sequence alone."""
  name, model, path, cfg, params = arch
  (a, b), tokens, positions, segments = _packed(cfg.vocab_size)
  refs = [_hf_logits(model, s) for s in (a, b)]
  scale = max(1.0, max(float(np.max(np.abs(r))) for r in refs))
  fwd = jax.jit(lambda p, c: T.forward_logits(p, c, tokens, positions, segments), static_argnums=1)
  ours = np.asarray(fwd(params, cfg))[0]
  assert np.max(np.abs(ours[:7] - refs[0])) < 1e-4 * scale
  assert np.max(np.abs(ours[7:16] - refs[1])) < 1e-4 * scale
  cfg16, params16 = load_hf_safetensors(path, dtype="bfloat16")
  ours16 = np.asarray(fwd(params16, cfg16.replace(dtype="bfloat16")))[0]
  assert np.max(np.abs(ours16[:7] - refs[0])) < 0.05 * scale
  assert np.max(np.abs(ours16[7:16] - refs[1])) < 0.05 * scale


PROMPTS = [[5, 17, 42], [200, 3, 3, 9, 77, 150, 31], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
NEW = 8


def _hf_greedy(model, prompt):
  with torch.no_grad():
    out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, min_new_tokens=NEW,
                         do_sample=False, pad_token_id=0)
  return out[0, len(prompt):].tolist()


def test_greedy_decode_through_kv_cache_matches_transformers_generate(arch):
  """A padded prefill of all prompts (num_new = their lengths), then one token per step: the
  scanned decode over the stacked cache, as the scoring side's params are laid out."""
  name, model, path, cfg, params = arch
  lens = np.array([len(p) for p in PROMPTS])
  pad = max(lens)
  tokens = np.array([p + [0] * (pad - len(p)) for p in PROMPTS])
  cache = T.init_cache(cfg, len(PROMPTS), pad + NEW)
  prefill = jax.jit(lambda p, t, c, n: T.decode_logits(p, cfg, t, c, num_new=n))
  step = jax.jit(lambda p, t, c: T.decode_logits(p, cfg, t, c))
  lg, cache = prefill(params, jnp.asarray(tokens), cache, jnp.asarray(lens))
  nxt = np.argmax(np.asarray(lg)[np.arange(len(PROMPTS)), lens - 1], -1)
  out = [nxt]
  for _ in range(NEW - 1):
    lg, cache = step(params, jnp.asarray(nxt)[:, None], cache)
    nxt = np.argmax(np.asarray(lg)[:, 0], -1)
    out.append(nxt)
  ours = np.stack(out, 1).tolist()
  assert ours == [_hf_greedy(model, p) for p in PROMPTS]


def test_engine_greedy_matches_transformers_generate(arch):
  """The generation engine (decode layout, per-layer cache, params sharded by the generator
  rules over 2 devices) and its loop, greedy."""
  name, model, path, cfg, params = arch
  mesh = make_mesh({"tensor": 2}, jax.devices()[:2])
  greedy = SamplingConfig(greedy=True, max_new_tokens=NEW)
  engine = Engine(cfg, mesh, GENERATOR_RULES, max_concurrent_decodes=4, max_prefill_length=16,
                  max_decode_length=16, sampling=greedy, prefill_buckets=(16,))
  loop = GeneratorLoop(engine, params, sampling=engine.sampling)
  for i, p in enumerate(PROMPTS):
    loop.submit(Request(i, p))
  got = {c.request_id: c.tokens for c in loop.run_until_idle()}
  assert [got[i] for i in range(len(PROMPTS))] == [_hf_greedy(model, p) for p in PROMPTS]


def test_forward_sharded_on_2x4_mesh_with_trainer_rules_equals_unsharded(arch):
  name, model, path, cfg, params = arch
  _, tokens, positions, segments = _packed(cfg.vocab_size, seed=1)
  tokens, positions, segments = (np.tile(x, (2, 1)) for x in (tokens, positions, segments))
  ref = T.forward_logits(params, cfg, tokens, positions, segments)
  mesh = make_mesh({"fsdp": 2, "tensor": 4})
  shard = ShardingCtx(mesh, TRAINER_RULES)
  sharded = jax.device_put(params, param_shardings(T.param_logical_axes(cfg), mesh,
                                                   TRAINER_RULES, params))
  if cfg.attention_bias:   # the biases are laid out with their heads
    bias = sharded["layers"]["attn"]["q_proj"]["bias"]
    assert bias.sharding.shard_shape(bias.shape) == (2, cfg.num_heads // 4, cfg.head_dim)
  fwd = jax.jit(lambda p, t, pos, seg: T.forward_logits(p, cfg, t, pos, seg, shard=shard))
  np.testing.assert_allclose(fwd(sharded, tokens, positions, segments), ref, atol=1e-5)


def _read_all(path):
  out = {}
  for fn in sorted(os.listdir(path)):
    if fn.endswith(".safetensors"):
      with safe_open(os.path.join(path, fn), framework="numpy") as f:
        out.update({n: f.get_tensor(n) for n in f.keys()})
  return out


def test_convert_hf_to_orbax_to_hf_is_bit_exact(arch, tmp_path):
  """launch/convert_checkpoint.py's two directions: the same tensors bit for bit, a config.json
  that reads as the same model (ours and transformers'), and the same logits in transformers."""
  name, model, path, cfg, params = arch
  convert_checkpoint.convert("hf_to_orbax", path, str(tmp_path / "orbax"))
  convert_checkpoint.convert("orbax_to_hf", str(tmp_path / "orbax"), str(tmp_path / "hf"))
  a, b = _read_all(path), _read_all(tmp_path / "hf")
  assert sorted(a) == sorted(b)
  for n in a:
    assert a[n].dtype == b[n].dtype and a[n].shape == b[n].shape, n
    assert a[n].tobytes() == b[n].tobytes(), n
  assert ModelConfig.from_hf_config(str(tmp_path / "hf")) == ModelConfig.from_hf_config(path)
  with open(os.path.join(path, "config.json")) as f:
    src = json.load(f)
  with open(tmp_path / "hf" / "config.json") as f:
    out = json.load(f)
  for key in ("architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size",
              "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
              "tie_word_embeddings", "use_sliding_window", "attention_bias"):
    assert out.get(key) == src.get(key), key
  # Qwen2's config.json has no head_dim (hidden / heads); ours states it, which transformers reads
  assert out["head_dim"] == src.get("head_dim", src["hidden_size"] // src["num_attention_heads"])
  back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
  seq = PROMPTS[1]
  np.testing.assert_array_equal(_hf_logits(back, seq), _hf_logits(model, seq))


# ---- what we refuse -----------------------------------------------------------------------------
def _refused(hf: dict, match: str):
  with pytest.raises(UnsupportedArchitectureError, match=match):
    ModelConfig.from_hf_config(hf)


def test_mixture_of_experts_configs_are_refused():
  moe = transformers.Qwen3MoeConfig(**BASE).to_dict()
  _refused(moe | {"architectures": ["Qwen3MoeForCausalLM"]}, "mixture-of-experts.*num_experts")
  _refused(transformers.Qwen2MoeConfig(**BASE).to_dict(), "mixture-of-experts")
  dense_with_experts = transformers.Qwen2Config(**BASE).to_dict() | {
      "architectures": ["Qwen2ForCausalLM"], "num_experts": 8}
  _refused(dense_with_experts, "mixture-of-experts.*num_experts")


@pytest.mark.parametrize("rope", [
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    {"type": "dynamic", "factor": 2.0},
    {"rope_type": "linear", "factor": 2.0}])
def test_other_rope_types_are_refused(rope):
  hf = transformers.Qwen2Config(**BASE).to_dict() | {"architectures": ["Qwen2ForCausalLM"]}
  kind = rope.get("rope_type", rope.get("type"))
  _refused(dict(hf, rope_scaling=rope), f"rope_scaling type '{kind}'")
  # transformers 5 writes it as rope_parameters
  params = dict(rope, rope_type=kind, rope_theta=1e6)
  params.pop("type", None)
  _refused(dict(hf, rope_scaling=None, rope_parameters=params), f"'{kind}'")


def test_qwen_sliding_window_is_refused_and_nothing_loads(tmp_path):
  hf = transformers.Qwen2Config(**BASE, use_sliding_window=True, sliding_window=16,
                                max_window_layers=1).to_dict()
  hf["architectures"] = ["Qwen2ForCausalLM"]
  _refused(hf, "use_sliding_window=true")
  with open(tmp_path / "config.json", "w") as f:
    json.dump(hf, f)
  (tmp_path / "model.safetensors").write_bytes(b"not read")
  with pytest.raises(UnsupportedArchitectureError, match="use_sliding_window"):
    load_hf_safetensors(str(tmp_path))   # refused before any weight file is read
  # use_sliding_window false with a window size (as Qwen2.5's config.json has) is plain attention
  hf.update(use_sliding_window=False, layer_types=None)
  assert ModelConfig.from_hf_config(hf).sliding_window is None


def test_other_unsupported_features_are_named():
  hf = transformers.LlamaConfig(**BASE).to_dict() | {"architectures": ["LlamaForCausalLM"]}
  _refused(dict(hf, mlp_bias=True), "mlp_bias")
  _refused(dict(hf, hidden_act="gelu"), "hidden_act='gelu'")
  _refused(dict(hf, quantization_config={"quant_method": "fp8"}), "quantized.*fp8")
  q3 = transformers.Qwen3Config(**BASE).to_dict() | {"architectures": ["Qwen3ForCausalLM"]}
  _refused(dict(q3, layer_types=["full_attention", "sliding_attention"]), "sliding_attention")
  _refused(dict(q3, rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                     "partial_rotary_factor": 0.5}), "partial_rotary_factor")
  # A config the architecture cannot express is refused where it is built.
  with pytest.raises(UnsupportedArchitectureError, match="attention_bias=False"):
    ModelConfig(architecture="Qwen2ForCausalLM")
  with pytest.raises(UnsupportedArchitectureError, match="qk_norm"):
    ModelConfig(architecture="Qwen3ForCausalLM")
  with pytest.raises(UnsupportedArchitectureError, match="GPTNeoX"):
    ModelConfig(architecture="GPTNeoXForCausalLM")


@pytest.mark.parametrize("kind", ["Llama", "Qwen3"])
def test_llama_and_qwen3_attention_bias_put_a_bias_on_every_projection(kind, tmp_path):
  """attention_bias in Llama's and Qwen3's config.json adds o_proj's bias too (Qwen2 has none
  there): loaded and scored like transformers."""
  torch.manual_seed(1)
  kw = dict(BASE, head_dim=16, attention_bias=True, tie_word_embeddings=True)
  hf_cfg = getattr(transformers, f"{kind}Config")(**kw)
  model = getattr(transformers, f"{kind}ForCausalLM")(hf_cfg)
  with torch.no_grad():
    for pname, p in model.named_parameters():
      if pname.endswith(".bias"):
        p.normal_(0.0, 0.5)
  model.eval().save_pretrained(str(tmp_path), safe_serialization=True)
  cfg, params = load_hf_safetensors(str(tmp_path))
  assert cfg.attention_bias and cfg.o_proj_bias and cfg.qk_norm == (kind == "Qwen3")
  assert params["layers"]["attn"]["o_proj"]["bias"].shape == (2, 64)
  seq = PROMPTS[2]
  ref = _hf_logits(model, seq)
  ours = np.asarray(T.forward_logits(params, cfg, jnp.asarray([seq])))[0]
  assert np.max(np.abs(ours - ref)) < 1e-4 * max(1.0, np.max(np.abs(ref)))
  assert ModelConfig.from_hf_config(cfg.to_hf_config(), param_dtype="float32") == cfg


def test_mistral_small_3_config_json_as_shipped_reads_as_the_preset():
  from magistral_jax.model.config import MISTRAL_SMALL_3_24B
  shipped = {"architectures": ["MistralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1,
             "eos_token_id": 2, "head_dim": 128, "hidden_act": "silu", "hidden_size": 5120,
             "initializer_range": 0.02, "intermediate_size": 32768,
             "max_position_embeddings": 32768, "model_type": "mistral", "num_attention_heads": 32,
             "num_hidden_layers": 40, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
             "rope_theta": 100000000.0, "sliding_window": None, "tie_word_embeddings": False,
             "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 131072}
  assert ModelConfig.from_hf_config(shipped) == MISTRAL_SMALL_3_24B
  assert MISTRAL_SMALL_3_24B.num_params() == 23_572_403_200   # "24B"


@pytest.mark.parametrize("remat", ["none", "full"])
def test_training_gradients_reach_the_new_parameters(remat):
  """The GRPO step differentiates token_logprobs: every bias and q/k norm scale gets a finite,
  non-zero gradient, with and without per-layer rematerialisation."""
  cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_heads=4,
                    num_kv_heads=2, head_dim=12, architecture="Qwen3ForCausalLM", qk_norm=True,
                    attention_bias=True, o_proj_bias=True, remat=remat)
  params = T.init_params(cfg, jax.random.PRNGKey(0))
  tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 10), 0, cfg.vocab_size)

  def loss(p):
    h = T.hidden_states(p, cfg, tokens[:, :-1])
    return -jnp.mean(T.token_logprobs(p, cfg, h, tokens[:, 1:]))

  attn = jax.jit(jax.grad(loss))(params)["layers"]["attn"]
  for leaf in (attn["q_proj"]["bias"], attn["k_proj"]["bias"], attn["v_proj"]["bias"],
               attn["o_proj"]["bias"], attn["q_norm"]["scale"], attn["k_norm"]["scale"]):
    assert bool(jnp.all(jnp.isfinite(leaf))) and float(jnp.max(jnp.abs(leaf))) > 0


def test_run_config_model_section_round_trips_the_new_fields():
  """The run config's `model` section is built from ModelConfig's defaults (config_section):
  the new fields are in it, and a Qwen3 config comes back from its ConfigDict unchanged."""
  import dataclasses

  from magistral_jax.config import checked_fields, config_section
  section = config_section(ModelConfig)
  assert (section.attention_bias, section.o_proj_bias, section.qk_norm) == (False, False, False)
  cfg = ModelConfig(architecture="Qwen3ForCausalLM", qk_norm=True, head_dim=24,
                    attention_bias=True, o_proj_bias=True, rope_theta=1e6)
  section.update({f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)})
  assert ModelConfig(**checked_fields(ModelConfig, section, "model")) == cfg
