"""load_hf_sharded: a HF checkpoint straight onto a mesh equals load_hf_safetensors + device_put,
leaf by leaf, bit for bit and in the same shardings; bad checkpoints fail before any read; and
the host memory it takes beyond the placed params stays far below the checkpoint's size."""
import json
import os
import subprocess
import sys
import textwrap

import jax
import ml_dtypes
import numpy as np
import optax
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from magistral_jax.model import hf_sharded
from magistral_jax.model import transformer as tfm
from magistral_jax.model.config import ModelConfig
from magistral_jax.model.hf_checkpoint import (SAFETENSORS_INDEX, SAFETENSORS_SINGLE,
                                               load_hf_safetensors, save_hf_safetensors)
from magistral_jax.model.hf_layout import CheckpointError
from magistral_jax.model.hf_sharded import load_hf_sharded
from magistral_jax.parallel.config import GENERATOR_RULES, TRAINER_RULES
from magistral_jax.parallel.sharding import make_mesh, param_shardings
from magistral_jax.train.step import init_state

# Dimensions chosen so the 2x4 trainer mesh shards some axes and must replicate others (2 kv
# heads over 4 'tensor' devices), as param_shardings' shapes_tree fallback does.
TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4,
            num_kv_heads=2, head_dim=8)
ARCHS = {
    "mistral": dict(architecture="MistralForCausalLM"),
    "llama_tied": dict(architecture="LlamaForCausalLM", tie_word_embeddings=True),
    "qwen2": dict(architecture="Qwen2ForCausalLM", attention_bias=True),
    "qwen3": dict(architecture="Qwen3ForCausalLM", qk_norm=True),
}


def _random_params(cfg: ModelConfig, dtype, seed=0):
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda s: rng.standard_normal(s.shape, np.float32).astype(dtype),
                      tfm.param_shapes(cfg))


def _write(tmp_path, arch="mistral", dtype="bfloat16", max_shard_bytes=None, name="ckpt"):
  cfg = ModelConfig(**TINY, **ARCHS[arch])
  path = str(tmp_path / name)
  save_hf_safetensors(_random_params(cfg, np.dtype(dtype)), cfg, path,
                      max_shard_bytes=max_shard_bytes)
  return path


def _meshes():
  return {"trainer_2x4": (make_mesh({"fsdp": 2, "tensor": 4}), TRAINER_RULES),
          "generator_1x2": (make_mesh({"data": 1, "tensor": 2}, jax.devices()[:2]),
                            GENERATOR_RULES)}


def _expected(path, mesh, rules, dtype=None):
  cfg, host = load_hf_safetensors(path, dtype=dtype)
  sh = param_shardings(tfm.param_logical_axes(cfg), mesh, rules, shapes_tree=host)
  return cfg, jax.device_put(host, sh), sh


def _assert_same(got, want, shardings):
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for (kp, g), w, sh in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want),
                            jax.tree.leaves(shardings)):
    where = jax.tree_util.keystr(kp)
    assert isinstance(g, jax.Array), where
    assert g.sharding == sh, (where, g.sharding, sh)
    assert g.dtype == w.dtype and g.shape == w.shape, where
    np.testing.assert_array_equal(np.asarray(g).view(np.uint8), np.asarray(w).view(np.uint8),
                                  err_msg=where)


@pytest.mark.parametrize("mesh_name", ["trainer_2x4", "generator_1x2"])
@pytest.mark.parametrize("arch,dtype,sharded", [
    ("mistral", "bfloat16", False), ("mistral", "float32", True), ("llama_tied", "bfloat16", True),
    ("qwen2", "bfloat16", False), ("qwen3", "bfloat16", False)])
def test_equals_load_then_device_put(tmp_path, mesh_name, arch, dtype, sharded):
  path = _write(tmp_path, arch, dtype, max_shard_bytes=20_000 if sharded else None)
  assert os.path.exists(os.path.join(path, SAFETENSORS_INDEX)) == sharded
  mesh, rules = _meshes()[mesh_name]
  want_cfg, want, sh = _expected(path, mesh, rules)
  cfg, got = load_hf_sharded(path, mesh, rules)
  assert cfg == want_cfg and cfg.param_dtype == dtype
  _assert_same(got, want, sh)


@pytest.mark.parametrize("src,dtype", [("bfloat16", "float32"), ("float32", "bfloat16")])
def test_dtype_casts_as_load_hf_safetensors_does(tmp_path, src, dtype):
  path = _write(tmp_path, "mistral", src)
  mesh, rules = _meshes()["trainer_2x4"]
  want_cfg, want, sh = _expected(path, mesh, rules, dtype=dtype)
  cfg, got = load_hf_sharded(path, mesh, rules, dtype=dtype)
  assert cfg == want_cfg and cfg.param_dtype == dtype
  _assert_same(got, want, sh)


def test_reads_in_runs_of_rows_through_short_lived_maps(tmp_path, monkeypatch):
  """A run far smaller than a row block: every multi-run path (the embedding's slices, the layer
  tensors, the tied check) gives the same bytes."""
  monkeypatch.setattr(hf_sharded, "_CHUNK_BYTES", 100)
  path = _write(tmp_path, "mistral", "bfloat16")
  with safe_open(os.path.join(path, SAFETENSORS_SINGLE), framework="numpy") as f:
    tensors = {n: f.get_tensor(n) for n in f.keys()}
  tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]   # a tied head, written anyway
  save_file(tensors, os.path.join(path, SAFETENSORS_SINGLE), metadata={"format": "pt"})
  with open(os.path.join(path, "config.json")) as f:
    conf = json.load(f)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(dict(conf, tie_word_embeddings=True), f)
  mesh, rules = _meshes()["trainer_2x4"]
  _, want, sh = _expected(path, mesh, rules)
  _, got = load_hf_sharded(path, mesh, rules)
  _assert_same(got, want, sh)


def test_placed_params_go_into_init_state_as_they_are(tmp_path):
  path = _write(tmp_path, "mistral", "float32")
  mesh, rules = _meshes()["trainer_2x4"]
  cfg, params = load_hf_sharded(path, mesh, rules)
  sh = param_shardings(tfm.param_logical_axes(cfg), mesh, rules, tfm.param_shapes(cfg))
  placed = jax.device_put(params, sh)   # what init_state does first: nothing to move
  assert all(a is b for a, b in zip(jax.tree.leaves(placed), jax.tree.leaves(params)))
  state = init_state(cfg, optax.sgd(1e-3), jax.random.PRNGKey(0), mesh, rules, params=params)
  for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(params)):
    assert a.sharding == b.sharding
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ---- bad checkpoints: the same errors as load_hf_safetensors, before anything is read ---------
def _rewrite(path, edit):
  file = os.path.join(path, SAFETENSORS_SINGLE)
  with safe_open(file, framework="numpy") as f:
    tensors = edit({n: f.get_tensor(n) for n in f.keys()})
  save_file(tensors, file, metadata={"format": "pt"})


@pytest.mark.parametrize("damage", ["missing", "wrong_shape", "tied_head_differs"])
def test_bad_checkpoint_raises_the_same_error_before_reading(tmp_path, monkeypatch, damage):
  if damage == "tied_head_differs":
    path = _write(tmp_path, "llama_tied", "float32")
    _rewrite(path, lambda t: dict(t, **{"lm_head.weight": t["model.embed_tokens.weight"] + 1}))
  else:
    path = _write(tmp_path, "mistral", "float32")
    name = "model.layers.1.mlp.up_proj.weight"
    _rewrite(path, (lambda t: {k: v for k, v in t.items() if k != name}) if damage == "missing"
             else (lambda t: dict(t, **{name: np.zeros((40, 32), np.float32)})))
  with pytest.raises(CheckpointError) as want:
    load_hf_safetensors(path)
  mesh, rules = _meshes()["generator_1x2"]
  placed = []
  real_put = jax.device_put
  monkeypatch.setattr(jax, "device_put", lambda *a, **k: placed.append(1) or real_put(*a, **k))
  if damage != "tied_head_differs":   # the tied check reads the two tensors, nothing else
    monkeypatch.setattr(hf_sharded._Reader, "read", lambda *a: pytest.fail("read a tensor"))
  with pytest.raises(CheckpointError) as got:
    load_hf_sharded(path, mesh, rules)
  assert str(got.value) == str(want.value)
  assert not placed


# ---- host memory -----------------------------------------------------------------------------
# The peak is the child's VmHWM, not getrusage's ru_maxrss: Linux keeps the larger of the parent's
# high-water mark (a pytest process that just wrote the checkpoint) and the child's across the
# fork and exec, so ru_maxrss would measure this test, not the loader.
_CHILD = textwrap.dedent("""
    import json, sys
    import jax
    from magistral_jax.model.hf_sharded import load_hf_sharded
    from magistral_jax.parallel.config import TRAINER_RULES
    from magistral_jax.parallel.sharding import make_mesh

    def status(key):   # kB
      return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(key))

    mesh = make_mesh({"fsdp": -1})
    jax.block_until_ready(jax.jit(lambda: jax.numpy.zeros(8))())   # the runtime, before the mark
    before = status("VmRSS:")
    _, params = load_hf_sharded(sys.argv[1], mesh, TRAINER_RULES)
    jax.block_until_ready(params)
    print(json.dumps({"before": before << 10, "peak": status("VmHWM:") << 10,
                      "params": sum(x.nbytes for x in jax.tree.leaves(params))}))
""")


def test_host_memory_beyond_the_params_is_far_below_the_checkpoint(tmp_path):
  # About 470 MB of bf16 in 12 layers of 34 MB: the loader holds about one layer (its arrays on
  # the devices, and a tensor and its slices on the host) beside the params at any time.
  cfg = ModelConfig(vocab_size=16384, hidden_size=1024, intermediate_size=4096, num_layers=12,
                    num_heads=8, num_kv_heads=8, head_dim=128)
  path = str(tmp_path / "big")
  params = jax.tree.map(lambda s: np.ones(s.shape, ml_dtypes.bfloat16), tfm.param_shapes(cfg))
  save_hf_safetensors(params, cfg, path)
  del params
  size = os.path.getsize(os.path.join(path, SAFETENSORS_SINGLE))
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
             JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, "-c", _CHILD, path], capture_output=True, text=True,
                       env=env, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  r = json.loads(out.stdout.strip().splitlines()[-1])
  assert size - (1 << 20) < r["params"] <= size   # the file is the params and a header
  # Besides: its compiled programs and the allocator's free lists, a few tens of MB at any size.
  # load_hf_safetensors holds about `size` beyond the params.
  overhead = r["peak"] - r["before"] - r["params"]
  assert overhead < size / 3, f"{overhead / 2**20:.0f} MB for {size / 2**20:.0f} MB"


def test_load_policy_with_a_mesh_loads_onto_it(tmp_path):
  from magistral_jax.model.config import InitConfig
  from magistral_jax.model.loading import load_policy
  cfg = ModelConfig(**dict(TINY, vocab_size=320), **ARCHS["mistral"])   # the char tokenizer's
  path = str(tmp_path / "ckpt")
  save_hf_safetensors(_random_params(cfg, np.dtype("bfloat16")), cfg, path)
  mesh, rules = _meshes()["trainer_2x4"]
  run_model = ModelConfig(param_dtype="float32")
  init = InitConfig(source="hf", path=path)
  _, want_cfg, want = load_policy(run_model, init)
  _, got_cfg, got = load_policy(run_model, init, mesh=mesh, rules=rules)
  assert got_cfg == want_cfg and got_cfg.param_dtype == "float32"   # the run's, as before
  sh = param_shardings(tfm.param_logical_axes(got_cfg), mesh, rules, tfm.param_shapes(got_cfg))
  _assert_same(got, jax.device_put(want, sh), sh)


def test_two_processes_each_load_their_own_slices(tmp_path):
  """Many hosts, rehearsed as 2 JAX processes of 2 CPU devices (launch/local_cluster.py): one
  load onto a 2x2 mesh over both; each process's shards equal the whole-model loader's blocks,
  and it reads only its own devices' part of the leaves with no layer axis."""
  import io
  from magistral_jax.parallel.local_cluster import run_cluster
  path = _write(tmp_path, "mistral", "bfloat16", max_shard_bytes=20_000)
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  out = io.StringIO()
  old = dict(os.environ)
  os.environ["PYTHONPATH"] = root + os.pathsep + os.environ.get("PYTHONPATH", "")
  try:
    rc = run_cluster([os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                   "hf_sharded_child.py"), path],
                     num_processes=2, devices_per_process=2, grace_s=30, out=out,
                     handle_signals=False)
  finally:
    os.environ.clear()
    os.environ.update(old)
  text = out.getvalue()
  assert rc == 0, text[-5000:]
  assert "[p0] OK" in text and "[p1] OK" in text, text[-5000:]
