"""HF safetensors import/export, orbax save/restore across meshes, and bad-checkpoint errors.

The HF source is a small random MistralForCausalLM written by transformers' save_pretrained.
"""
import json
import os

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from safetensors import safe_open
from safetensors.numpy import save_file

from magistral_jax.model.config import ModelConfig, UnsupportedArchitectureError
from magistral_jax.model.gguf_checkpoint import unpermute_gguf_qk
from magistral_jax.model.hf_checkpoint import (SAFETENSORS_INDEX, SAFETENSORS_SINGLE,
                                               load_hf_safetensors, save_hf_safetensors)
from magistral_jax.model.hf_layout import CheckpointError
from magistral_jax.model.orbax_params import (read_orbax_config, restore_params_orbax,
                                              save_params_orbax)
from magistral_jax.run import convert as convert_checkpoint

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64)


def _hf_model(kind="mistral", dtype="float32", tie=False, seed=0):
  torch.manual_seed(seed)
  if kind == "mistral":
    model = transformers.MistralForCausalLM(transformers.MistralConfig(**TINY, sliding_window=32))
  else:
    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**TINY, tie_word_embeddings=tie))
  # Random norms too (they start at 1.0), so a swapped norm would show.
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:
        p.uniform_(0.5, 1.5)
  return model.to(getattr(torch, dtype)).eval()


def _save_hf(model, path, sharded=False):
  model.save_pretrained(path, max_shard_size="20KB" if sharded else "1GB")
  return path


def _read_all(path):
  """name -> numpy tensor over every safetensors file in a directory."""
  out = {}
  for fn in sorted(os.listdir(path)):
    if fn.endswith(".safetensors"):
      with safe_open(os.path.join(path, fn), framework="numpy") as f:
        for name in f.keys():
          out[name] = f.get_tensor(name)
  return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
def test_hf_round_trip_is_bit_exact(tmp_path, dtype, sharded):
  src = _save_hf(_hf_model(dtype=dtype), tmp_path / "src", sharded=sharded)
  if sharded:
    assert os.path.exists(src / SAFETENSORS_INDEX)
  cfg, params = load_hf_safetensors(str(src))
  assert cfg.architecture == "MistralForCausalLM" and cfg.param_dtype == dtype
  assert params["layers"]["attn"]["q_proj"]["kernel"].shape == (2, 32, 4, 8)
  assert params["layers"]["attn"]["o_proj"]["kernel"].shape == (2, 4, 8, 32)
  files = save_hf_safetensors(params, cfg, str(tmp_path / "out"),
                                 max_shard_bytes=30_000 if sharded else None)
  assert (len(files) > 1) == sharded
  a, b = _read_all(src), _read_all(tmp_path / "out")
  assert sorted(a) == sorted(b)
  for name in a:
    assert a[name].dtype == b[name].dtype == np.dtype(dtype), name
    assert a[name].shape == b[name].shape, name
    assert a[name].tobytes() == b[name].tobytes(), name


def test_export_loads_in_transformers_with_equal_weights(tmp_path):
  model = _hf_model(dtype="bfloat16")
  cfg, params = load_hf_safetensors(str(_save_hf(model, tmp_path / "src")))
  save_hf_safetensors(params, cfg, str(tmp_path / "out"), max_shard_bytes=30_000)
  back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"),
                                                           dtype=torch.bfloat16)
  assert type(back).__name__ == "MistralForCausalLM"
  assert back.config.sliding_window == 32 and back.config.num_key_value_heads == 2
  want, got = model.state_dict(), back.state_dict()
  assert want.keys() == got.keys()
  for k in want:
    assert torch.equal(want[k], got[k]), k


def test_kernels_compute_what_the_hf_projections_compute(tmp_path):
  """Not just a reversible shuffle: x @ our kernel equals the torch Linear's output."""
  model = _hf_model()
  cfg, params = load_hf_safetensors(str(_save_hf(model, tmp_path / "src")))
  layer = model.model.layers[1]
  x = np.random.default_rng(0).standard_normal((3, cfg.hidden_size)).astype(np.float32)
  lp = jax.tree.map(lambda a: a[1], params["layers"])
  with torch.no_grad():
    tx = torch.from_numpy(x)
    q = layer.self_attn.q_proj(tx).numpy().reshape(3, cfg.num_heads, cfg.head_dim)
    k = layer.self_attn.k_proj(tx).numpy().reshape(3, cfg.num_kv_heads, cfg.head_dim)
    heads = np.random.default_rng(1).standard_normal((3, cfg.num_heads, cfg.head_dim)).astype(np.float32)
    o = layer.self_attn.o_proj(torch.from_numpy(heads.reshape(3, -1))).numpy()
    mlp = layer.mlp(tx).numpy()
    logits = model.lm_head(tx).numpy()
  close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)  # noqa: E731
  attn, mlp_k = lp["attn"], {k: v["kernel"] for k, v in lp["mlp"].items()}
  close(np.einsum("bd,dhk->bhk", x, attn["q_proj"]["kernel"]), q)
  close(np.einsum("bd,dhk->bhk", x, attn["k_proj"]["kernel"]), k)
  close(np.einsum("bhk,hkd->bd", heads, attn["o_proj"]["kernel"]), o)
  silu = lambda z: z / (1 + np.exp(-z))  # noqa: E731
  close((silu(x @ mlp_k["gate_proj"]) * (x @ mlp_k["up_proj"])) @ mlp_k["down_proj"], mlp)
  close(x @ params["lm_head"]["kernel"], logits)
  np.testing.assert_array_equal(lp["mlp_norm"]["scale"],
                                layer.post_attention_layernorm.weight.detach().numpy())


def test_tied_embeddings_have_no_lm_head(tmp_path):
  src = _save_hf(_hf_model(kind="llama", tie=True), tmp_path / "src")
  assert "lm_head.weight" not in _read_all(src)
  cfg, params = load_hf_safetensors(str(src))
  assert cfg.tie_word_embeddings and "lm_head" not in params
  save_hf_safetensors(params, cfg, str(tmp_path / "out"))
  a, b = _read_all(src), _read_all(tmp_path / "out")
  assert sorted(a) == sorted(b) and all(a[n].tobytes() == b[n].tobytes() for n in a)
  with open(tmp_path / "out" / "config.json") as f:
    assert json.load(f)["tie_word_embeddings"] is True


def test_tied_checkpoint_with_an_explicit_lm_head_must_match_the_embedding(tmp_path):
  src = str(_save_hf(_hf_model(kind="llama", tie=True), tmp_path / "src"))
  _rewrite(src, lambda t: dict(t, **{"lm_head.weight": t["model.embed_tokens.weight"].copy()}))
  cfg, params = load_hf_safetensors(src)
  assert "lm_head" not in params
  _rewrite(src, lambda t: dict(t, **{"lm_head.weight": t["lm_head.weight"] + 1}))
  with pytest.raises(CheckpointError, match="lm_head.weight differs"):
    load_hf_safetensors(src)


def test_dtype_argument_casts_every_leaf(tmp_path):
  cfg, params = load_hf_safetensors(str(_save_hf(_hf_model(), tmp_path / "src")), dtype="bfloat16")
  assert cfg.param_dtype == "bfloat16"
  assert {str(x.dtype) for x in jax.tree.leaves(params)} == {"bfloat16"}


# ---- bad input ----------------------------------------------------------------------------------
def _rewrite(src, edit):
  """Rewrites the single model.safetensors of `src` through `edit(tensors) -> tensors`."""
  file = os.path.join(src, SAFETENSORS_SINGLE)
  tensors = edit(_read_all(src))
  save_file(tensors, file, metadata={"format": "pt"})


@pytest.fixture
def hf_dir(tmp_path):
  return str(_save_hf(_hf_model(), tmp_path / "src"))


def test_missing_tensor_is_named(hf_dir):
  name = "model.layers.1.mlp.down_proj.weight"
  _rewrite(hf_dir, lambda t: {k: v for k, v in t.items() if k != name})
  with pytest.raises(CheckpointError, match=r"missing tensor\(s\): " + name.replace(".", r"\.")):
    load_hf_safetensors(hf_dir)


def test_extra_tensor_is_named(hf_dir):
  extra = "model.layers.0.self_attn.q_proj.bias"
  _rewrite(hf_dir, lambda t: dict(t, **{extra: np.zeros(32, np.float32)}))
  with pytest.raises(CheckpointError, match=extra.replace(".", r"\.")):
    load_hf_safetensors(hf_dir)


def test_wrong_shape_names_tensor_and_both_shapes(hf_dir):
  name = "model.layers.0.mlp.up_proj.weight"
  _rewrite(hf_dir, lambda t: dict(t, **{name: np.zeros((40, 32), np.float32)}))
  with pytest.raises(CheckpointError) as e:
    load_hf_safetensors(hf_dir)
  assert name in str(e.value) and "(40, 32)" in str(e.value) and "(48, 32)" in str(e.value)


def test_config_mismatch_reports_every_problem(hf_dir):
  cfg = ModelConfig.from_hf_config(hf_dir).replace(num_layers=3, intermediate_size=64)
  with pytest.raises(CheckpointError) as e:
    load_hf_safetensors(hf_dir, cfg=cfg)
  msg = str(e.value)
  assert "model.layers.2.self_attn.q_proj.weight" in msg  # missing layer
  assert "(48, 32)" in msg and "(64, 32)" in msg          # mis-shaped MLP


def test_unsupported_architecture_is_named(hf_dir):
  path = os.path.join(hf_dir, "config.json")
  with open(path) as f:
    conf = json.load(f)
  conf["architectures"] = ["GPT2LMHeadModel"]
  with open(path, "w") as f:
    json.dump(conf, f)
  with pytest.raises(UnsupportedArchitectureError, match="GPT2LMHeadModel"):
    load_hf_safetensors(hf_dir)


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_safetensors_names_the_file(hf_dir, damage):
  file = os.path.join(hf_dir, SAFETENSORS_SINGLE)
  data = open(file, "rb").read()
  with open(file, "wb") as f:
    f.write(data[: len(data) // 2] if damage == "truncate" else b"\x07not a safetensors file" * 10)
  with pytest.raises(CheckpointError, match=file):
    load_hf_safetensors(hf_dir)


def test_missing_shard_names_the_file(tmp_path):
  src = _save_hf(_hf_model(), tmp_path / "src", sharded=True)
  shard = sorted(fn for fn in os.listdir(src) if fn.endswith(".safetensors"))[-1]
  os.remove(src / shard)
  with pytest.raises(CheckpointError, match=shard):
    load_hf_safetensors(str(src))


def test_export_rejects_params_that_do_not_match_config(hf_dir, tmp_path):
  cfg, params = load_hf_safetensors(hf_dir)
  params["layers"]["mlp"]["up_proj"]["kernel"] = np.zeros((2, 32, 40), np.float32)
  with pytest.raises(CheckpointError, match=r"layers/mlp/up_proj/kernel.*\(2, 32, 40\).*\(2, 32, 48\)"):
    save_hf_safetensors(params, cfg, str(tmp_path / "out"))
  assert not os.path.exists(tmp_path / "out")  # validated before anything is written


# ---- GGUF q/k layout ----------------------------------------------------------------------------
def test_unpermute_inverts_llama_cpp_rope_permutation():
  # llama.cpp's converter: per head, rows (2, Dh/2) -> (Dh/2, 2), i.e. rotate-half -> interleaved.
  n_heads, head_dim, d = 3, 8, 5
  w = np.arange(n_heads * head_dim * d, dtype=np.float32).reshape(n_heads * head_dim, d)
  permuted = w.reshape(n_heads, 2, head_dim // 2, d).swapaxes(1, 2).reshape(w.shape)
  assert not np.array_equal(permuted, w)
  np.testing.assert_array_equal(unpermute_gguf_qk(permuted, n_heads), w)


# ---- orbax --------------------------------------------------------------------------------------
def _mesh(shape):
  return Mesh(np.array(jax.devices()[:8]).reshape(shape), ("data", "model"))


def _shardings(params, mesh, spec_fn):
  return jax.tree.map(lambda x: NamedSharding(mesh, spec_fn(x)), params)


def _spec_a(x):  # shard the first two dims where they divide
  return P(*(["data", "model"][: x.ndim]))


def _spec_b(x):  # a different layout: last dim over 'data'
  return P(*([None] * (x.ndim - 1) + ["data"]))


@pytest.mark.parametrize("target", [(4, 2), (8, 1)])
def test_orbax_restore_onto_a_different_mesh(hf_dir, tmp_path, target):
  cfg, host = load_hf_safetensors(hf_dir)
  src_mesh = _mesh((2, 4))
  params = jax.device_put(host, _shardings(host, src_mesh, _spec_a))
  assert len(params["embed"]["embedding"].sharding.device_set) == 8
  save_params_orbax(str(tmp_path / "ckpt" / "params"), params, cfg)
  dst = _shardings(host, _mesh(target), _spec_b)
  restored = restore_params_orbax(str(tmp_path / "ckpt" / "params"), target_shardings=dst)
  for (path, want), got, sh in zip(jax.tree_util.tree_leaves_with_path(host),
                                   jax.tree.leaves(restored), jax.tree.leaves(dst)):
    assert got.sharding == sh, path
    np.testing.assert_array_equal(np.asarray(got), want, err_msg=str(path))
  assert read_orbax_config(str(tmp_path / "ckpt" / "params")) == cfg


def test_orbax_restore_with_the_model_param_shardings(hf_dir, tmp_path):
  """Trainer layout (fsdp x tensor) -> generator layout (tensor only), via the lead's rules."""
  sharding = pytest.importorskip("magistral_jax.parallel.sharding")
  from magistral_jax.parallel import config as parallel_config
  transformer = pytest.importorskip("magistral_jax.model.transformer")
  cfg, host = load_hf_safetensors(hf_dir)
  axes = transformer.param_logical_axes(cfg)
  train_mesh = sharding.make_mesh({"fsdp": 2, "tensor": 4})
  gen_mesh = sharding.make_mesh({"data": 4, "tensor": 2})
  params = jax.device_put(host, sharding.param_shardings(axes, train_mesh, shapes_tree=host))
  save_params_orbax(str(tmp_path / "params"), params)
  dst = sharding.param_shardings(axes, gen_mesh, parallel_config.GENERATOR_RULES, shapes_tree=host)
  restored = restore_params_orbax(str(tmp_path / "params"), target_shardings=dst)
  for want, got, sh in zip(jax.tree.leaves(host), jax.tree.leaves(restored), jax.tree.leaves(dst)):
    assert got.sharding == sh
    np.testing.assert_array_equal(np.asarray(got), want)


def test_an_orbax_init_loads_onto_the_trainers_mesh_by_its_rules(tmp_path):
  """load_policy(init.source=orbax, mesh=...) restores each param laid out as init_state takes
  it, not on the default device: in a run of many processes that device may be another
  process's (tests/launch/test_multihost_run.py restores an SFT checkpoint onto two)."""
  from magistral_jax.model.config import InitConfig
  from magistral_jax.model.loading import load_policy
  from magistral_jax.model.transformer import init_params, param_logical_axes
  from magistral_jax.parallel.sharding import make_mesh, param_shardings
  cfg = ModelConfig(vocab_size=104, hidden_size=64, intermediate_size=128, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=16)
  host = jax.device_get(init_params(cfg, jax.random.PRNGKey(0)))
  save_params_orbax(str(tmp_path / "sft" / "params"), host, cfg)
  mesh = make_mesh({"fsdp": 4}, jax.devices()[:4])
  _, got_cfg, params = load_policy(cfg, InitConfig(source="orbax",
                                                   path=str(tmp_path / "sft" / "params")),
                                   tokenizer="char", mesh=mesh)
  want = param_shardings(param_logical_axes(got_cfg), mesh, shapes_tree=host)
  for x, sh, ref in zip(jax.tree.leaves(params), jax.tree.leaves(want), jax.tree.leaves(host)):
    assert x.sharding == sh
    np.testing.assert_array_equal(np.asarray(x), ref)
  assert any(len(sh.device_set) == 4 and not sh.is_fully_replicated for sh in jax.tree.leaves(want))


def test_orbax_restore_of_missing_checkpoint_is_clear(tmp_path):
  with pytest.raises(CheckpointError, match="no orbax checkpoint"):
    restore_params_orbax(str(tmp_path / "nope"))


# ---- launch/convert_checkpoint.py (run/convert.py) -----------------------------------------------
def test_convert_hf_to_orbax_and_back_is_bit_exact(tmp_path):
  src = _save_hf(_hf_model(dtype="bfloat16"), tmp_path / "src")
  convert_checkpoint.convert("hf_to_orbax", str(src), str(tmp_path / "orbax"))
  assert os.path.exists(tmp_path / "orbax" / "config.json")
  convert_checkpoint.convert("orbax_to_hf", str(tmp_path / "orbax"), str(tmp_path / "hf"))
  a, b = _read_all(src), _read_all(tmp_path / "hf")
  assert sorted(a) == sorted(b)
  assert all(a[n].dtype == b[n].dtype and a[n].tobytes() == b[n].tobytes() for n in a)
  assert ModelConfig.from_hf_config(str(tmp_path / "hf")) == ModelConfig.from_hf_config(str(src))
