"""launch/plan.py and magistral_jax/run/plan.py: the fit check's estimates against what the code
allocates. The trainer's per-device bytes against XLA's memory analysis of the real GRPO train
step compiled on CPU (a sound bound: at least the compiled peak, at most TRAIN_TOLERANCE times
it); a generator's decode state against the Engine's own arrays, exactly; the recipes' plans and
the launcher's table."""
import dataclasses
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from magistral_jax import config as config_lib
from magistral_jax.generate.engine import Engine
from magistral_jax.model import transformer as tfm
from magistral_jax.model.config import MISTRAL_SMALL_3_24B, ModelConfig
from magistral_jax.parallel.config import GENERATOR_RULES
from magistral_jax.parallel.sharding import is_logical_axes, make_mesh
from magistral_jax.rl.collate import FIELDS
from magistral_jax.run import footprint, plan as plan_lib
from magistral_jax.run.recipes import load_recipe
from magistral_jax.train.optimizer import make_optimizer
from magistral_jax.train.step import TrainState, batch_sharding, make_grpo_step, state_shardings

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The estimate may exceed the compiled peak by this factor: XLA frees a layer's residuals and
# cotangents as its backward goes, which the estimate counts whole.
TRAIN_TOLERANCE = 1.6
INT_FIELDS = ("tokens", "positions", "segment_ids", "targets")


def _tiny_run(remat, impl, mesh_shape, rows, row_len, n_mini=16):
  """A validated run config of a small model on 4 trainer devices. Compute in float32: XLA:CPU
  widens bfloat16 arithmetic to float32, so its analysis of a bfloat16 program is not what a
  GPU or TPU would hold."""
  c = load_recipe("configs/tiny.py", ROOT)
  c.model.update(vocab_size=1024, hidden_size=128, intermediate_size=384, num_layers=4,
                 num_heads=4, num_kv_heads=2, head_dim=32, param_dtype="float32",
                 dtype="float32", remat=remat, logits_chunk=128, attention_impl=impl)
  c.rl.update(microbatch_rows=rows, microbatch_tokens=rows * row_len, n_batch=n_mini,
              n_mini=n_mini, group_size=4)
  c.devices.update(trainer=4, generators=(2, 2), trainer_mesh=mesh_shape)
  c.engine.update(max_prefill_length=16)
  c.sampling.update(max_new_tokens=row_len - 16)
  return config_lib.validate(c)


def _compiled_train_peak(run) -> int:
  """The per-device peak of the GRPO step compiled for `run`'s trainer (abstract inputs: nothing
  is allocated), from XLA's memory analysis."""
  cfg, rl = run.model, run.rl
  tx = make_optimizer(run.optimizer)
  rules = run.sharding.trainer_rules
  mesh = make_mesh(run.devices.trainer_mesh, jax.devices()[:run.devices.trainer])
  step = make_grpo_step(cfg, rl, tx, mesh, rules)
  shapes = tfm.param_shapes(cfg)
  scalar = jax.ShapeDtypeStruct((), jnp.int32)
  state = TrainState(scalar, shapes, jax.eval_shape(tx.init, shapes), scalar)
  state = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), state,
                       state_shardings(cfg, tx, mesh, rules))
  n_micro = -(-rl.n_mini // rl.microbatch_rows)   # the estimate's worst case of collation
  bsh = batch_sharding(mesh, rules)
  batch = {k: jax.ShapeDtypeStruct((n_micro, rl.microbatch_rows, rl.row_len),
                                   jnp.int32 if k in INT_FIELDS else jnp.float32, sharding=bsh)
           for k in FIELDS}
  return footprint.compiled_memory(step.lower(state, batch).compile())[0]


@pytest.mark.parametrize("remat,impl,mesh_shape,rows,row_len", [
    ("none", "dense", {"fsdp": 4}, 8, 256),                 # every residual, a T x T matrix
    ("full", "blockwise", {"fsdp": 2, "tensor": 2}, 4, 1024),   # layer inputs, linear attention
])
def test_trainer_estimate_bounds_the_compiled_step(remat, impl, mesh_shape, rows, row_len):
  run = _tiny_run(remat, impl, mesh_shape, rows, row_len)
  est = footprint.trainer_bytes(run, run.model, "cpu")
  assert est["attention"] == impl and est["remat"] == remat
  peak = _compiled_train_peak(run)
  assert peak <= est["total"] <= TRAIN_TOLERANCE * peak, (est["parts"], peak)
  # Weights and moments are exact: the compiled step's arguments hold them and the batch.
  p = est["parts"]
  assert p["weights"] == sum(
      footprint.shard_elems(s.shape, ax, run.sharding.trainer_rules, est["mesh"]) * 4
      for ax, s in zip(jax.tree.leaves(tfm.param_logical_axes(run.model),
                                       is_leaf=is_logical_axes),
                       jax.tree.leaves(tfm.param_shapes(run.model))))
  assert p["optimizer"] >= 2 * p["weights"]


def test_generator_decode_state_is_the_engines_exactly():
  cfg = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=3,
                    num_heads=4, num_kv_heads=2, head_dim=16, dtype="bfloat16")
  mesh_shape = {"tensor": 2, "data": 2}
  devices = jax.devices()[4:8]
  engine = Engine(cfg, make_mesh(mesh_shape, devices), GENERATOR_RULES,
                  max_concurrent_decodes=8, max_prefill_length=24, max_decode_length=40)
  state = engine.init_decode_state()
  on_first = sum(s.data.nbytes for a in jax.tree.leaves(state) for s in a.addressable_shards
                 if s.device == devices[0])
  cache_on_first = sum(s.data.nbytes for a in jax.tree.leaves((state.cache.k, state.cache.v))
                       for s in a.addressable_shards if s.device == devices[0])
  est = footprint.decode_state_bytes(cfg, 8, 24 + 40, GENERATOR_RULES,
                                     footprint.mesh_sizes(mesh_shape, 4))
  assert est["kv_cache"] == cache_on_first
  assert est["kv_cache"] + est["slot_vectors"] == on_first
  # 8 slots x 64 positions x 3 layers x (K + V) x 2 kv heads x 16 over data 2 x tensor 2, bf16.
  assert est["kv_cache"] == 8 * 64 * 3 * 2 * 2 * 16 * 2 // 4


def test_a_paged_generator_counts_its_pools_and_a_dense_one_its_drain():
  """A paged engine's pools on one device are the estimate's (tensor-split KV heads, a pool per
  data replica); the plan counts them instead of a cache per slot, and no compaction peak; a
  dense cache's drain compaction (half the slots) is counted beside it."""
  cfg = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=3,
                    num_heads=4, num_kv_heads=2, head_dim=16, dtype="bfloat16")
  for shape in ({"tensor": 2}, {"data": 2, "tensor": 2}):
    devices = jax.devices()[4:4 + math.prod(shape.values())]
    engine = Engine(cfg, make_mesh(shape, devices), GENERATOR_RULES,
                    max_concurrent_decodes=8, max_prefill_length=24, max_decode_length=40,
                    kv_pages=33, page_size=16)
    state = engine.init_decode_state()
    pools_on_first = sum(s.data.nbytes for a in jax.tree.leaves((state.cache.k, state.cache.v))
                         for s in a.addressable_shards if s.device == devices[0])
    assert footprint.page_pool_bytes(cfg, 33, 16, GENERATOR_RULES, footprint.mesh_sizes(
        shape, len(devices))) == pools_on_first == 2 * 3 * 33 * 16 * 16 * 2   # 1 KV head a device
  run = config_lib.validate(load_recipe("configs/tiny.py", ROOT))
  run = dataclasses.replace(run, devices=dataclasses.replace(run.devices,
                                                             generator_mesh={"tensor": -1}))
  paged = dataclasses.replace(run, engine=dataclasses.replace(run.engine, kv_cache="paged"))
  g_paged = footprint.generator_bytes(paged, cfg, "cuda", 2)
  g_dense = footprint.generator_bytes(run, cfg, "cpu", 2)   # auto: a short cache on CPU
  slots, positions = run.engine.max_concurrent_decodes, g_dense["cache_length"]
  assert g_paged["kv_pages"] == slots * -(-positions // 16) + 1
  assert g_paged["parts"]["drain_compaction"] == 0
  assert g_dense["kv_pages"] is None
  assert g_dense["parts"]["drain_compaction"] == g_dense["parts"]["kv_cache"] // 2


def test_devices_and_model_specs():
  assert plan_lib.parse_devices("v5p-128") == plan_lib.Devices("v5p", 64, 95 * 2**30)
  assert plan_lib.parse_devices("8xH100").count == 8
  assert plan_lib.parse_devices("16xH200", 100).memory_bytes == 100 * 2**30
  assert plan_lib.parse_devices("H100").count is None
  with pytest.raises(ValueError, match="v5p-128"):
    plan_lib.parse_devices("a100")
  run_model = ModelConfig(param_dtype="float32", dtype="bfloat16", remat="full")
  small = plan_lib.model_from_spec("mistral_small_3_24b", run_model)
  assert small.replace(param_dtype="float32", dtype="float32", remat="none") == \
      MISTRAL_SMALL_3_24B.replace(dtype="float32")
  assert (small.dtype, small.remat) == ("bfloat16", "full")
  custom = plan_lib.model_from_spec("hidden_size=256,num_layers=3,tie_word_embeddings=true",
                                    run_model)
  assert (custom.hidden_size, custom.num_layers, custom.tie_word_embeddings) == (256, 3, True)
  with pytest.raises(ValueError, match="hidden_sise"):
    plan_lib.model_from_spec("hidden_sise=3", run_model)


def test_small_recipe_plans():
  """configs/small.py with Mistral Small 3: the recipe's 32 devices, and one 8-device box."""
  c = load_recipe("configs/small.py", ROOT)
  [(name, p)] = plan_lib.plan_stages(c, "mistral_small_3_24b", "v5p-128")
  assert name == "rl" and p["devices_needed"] == 32 and p["enough_devices"]
  tr, gen = p["trainer"], p["generators"][8]
  # fp32 master weights over 16 FSDP devices; two fp32 moments; bf16 weights over tensor 4.
  n = MISTRAL_SMALL_3_24B.num_params()
  assert abs(tr["parts"]["weights"] - 4 * n / 16) / (4 * n / 16) < 0.01
  assert tr["parts"]["optimizer"] >= 2 * tr["parts"]["weights"]
  assert abs(gen["parts"]["weights"] - 2 * n / 4) / (2 * n / 4) < 0.01
  # 256 slots x (4k + 40k) positions x 40 layers x K and V x 8 kv heads x 128, bf16, over
  # data 2 x tensor 4: paged (on TPU), a pool per data replica of a dense cache's worth and its
  # null page (16 positions).
  assert gen["parts"]["kv_cache"] == (256 * 45056 + 2 * 16) * 40 * 2 * 8 * 128 * 2 // 8
  assert tr["attention"] == "tpu_flash" and p["trainer_without_remat"]["total"] > tr["total"]
  box = plan_lib.plan(p["run"], plan_lib.model_from_spec("mistral_small_3_24b", p["run"].model),
                      "8xH100", layout="colocated")
  assert box["colocated"] and box["devices_needed"] == 8
  assert box["run"].rl.microbatch_rows == 8 and box["run"].rl.row_len == 45056
  assert list(box["roles"]) == ["trainer+generator"]
  assert "DOES NOT FIT" in plan_lib.format_plan(box) or box["fits"]
  short = plan_lib.plan(p["run"], plan_lib.model_from_spec("mistral_small_3_24b", p["run"].model),
                        "8xH100")
  assert not short["enough_devices"] and not short["fits"]


def test_medium_largest_stage_and_launcher():
  c = load_recipe("configs/medium.py", ROOT)
  stages = plan_lib.plan_stages(c, "mistral_small_3_24b", "v5p-128")
  assert [s for s, _ in stages] == ["16k", "24k", "32k"]
  # Each stage decodes up to its own l_max: the last one's 40k-position KV cache outweighs the
  # first one's larger batch stack.
  assert plan_lib.largest(stages)[0] == "32k"
  out = subprocess.run(
      [sys.executable, "launch/plan.py", "--config=configs/medium.py",
       "--model=hidden_size=1024,intermediate_size=4096,num_layers=8,num_heads=8,"
       "num_kv_heads=8,head_dim=128,vocab_size=32768", "--devices=v5p-128", "--json"],
      cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "stage 32k" in out.stdout and "the layout needs 128 devices; 64 given" in out.stdout
  assert '"devices_needed": 128' in out.stdout
