"""The jitted train step: exact microbatching on the real model, 8-device parity, NaN guard,
an RL step that moves log-probs the right way, remat parity, and the optimizer schedule."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from magistral_jax.model import transformer as tfm
from magistral_jax.model.config import ModelConfig
from magistral_jax.parallel.sharding import make_mesh
from magistral_jax.rl import collate as C
from magistral_jax.rl.advantages import ScoredGroup
from magistral_jax.rl.config import GRPOConfig
from magistral_jax.rl.minibatch import collate_minibatch, make_minibatches, normalize_advantages
from magistral_jax.train import optimizer as O
from magistral_jax.train import step as S

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8, logits_chunk=16)


def completions(seed=0, n=8, group_size=4):
  rng = np.random.default_rng(seed)
  out = []
  for i in range(n):
    c = rng.integers(1, CFG.vocab_size, rng.integers(2, 14))
    out.append(C.Completion(rng.integers(1, CFG.vocab_size, rng.integers(1, 5)), c,
                            -np.abs(rng.normal(4.0, 0.3, len(c))), float(rng.normal()), i // group_size))
  return out


def grpo_cfg(**kw):
  base = dict(n_batch=8, n_mini=8, group_size=4, microbatch_tokens=256, microbatch_rows=8)
  base.update(kw)
  return GRPOConfig(**base)


TX = O.make_optimizer(O.OptimizerConfig(learning_rate=1e-2))


# Compiles dominate this file's run time: one initial state and one step function per
# (remat, mesh) are shared by all tests (same batch shapes -> one compile each).
@functools.lru_cache(maxsize=None)
def state0():
  # Device arrays throughout: host arrays would be a different jit cache key (a recompile).
  return S.init_state(CFG, TX, jax.random.PRNGKey(0))


def params0():
  return state0().params


@functools.lru_cache(maxsize=None)
def step_fn(remat="none", mesh_shape=None, dtype="float32"):
  mesh = None if mesh_shape is None else make_mesh(dict(mesh_shape))
  cfg = CFG.replace(remat=remat, dtype=dtype)
  return S.make_grpo_step(cfg, grpo_cfg(), TX, mesh, donate=False), mesh


def run_step(batch, state=None, remat="none", mesh_shape=None, dtype="float32"):
  step, mesh = step_fn(remat, mesh_shape, dtype)
  state = state0() if state is None else state
  if mesh is not None:
    state = S.place_state(state, CFG, TX, mesh)
  state, metrics = step(state, S.shard_batch(batch, mesh))
  return state, jax.device_get(metrics)


@pytest.mark.slow
def test_microbatched_gradient_equals_the_unsplit_minibatch_on_the_model():
  comps = completions(1)
  g = grpo_cfg(kl_coef=0.1, entropy_coef=0.01, loss_agg="sequence")
  gid = np.array([c.group_id for c in comps])
  adv = normalize_advantages([c.advantage for c in comps], gid)
  w = C.aggregation_weights([len(c.completion_tokens) for c in comps], gid, g.loss_agg)
  # Split: greedy rows, one row per microbatch (the other rows of each microbatch left empty).
  # Unsplit: one sequence per row, all in the first microbatch. Both have the same stack shape
  # (the unsplit one padded with empty microbatches), so one compile serves both.
  rows = C.first_fit([c.num_tokens for c in comps], 24)
  assert len(rows) > 1
  split, _ = C.pack(comps, adv, w, 24, 8, bins=[b for r in rows for b in [r] + [[]] * 7])
  whole, _ = C.pack(comps, adv, w, 24, 8, bins=[[i] for i in range(8)], min_microbatches=len(rows))
  assert split["tokens"].shape == whole["tokens"].shape
  params = params0()
  ref = jax.tree.map(lambda p: p * 0.9, params)
  loss_fn = S.grpo_loss_fn(CFG, g)
  acc = jax.jit(functools.partial(S.accumulate_gradients, loss_fn))
  g1, s1 = acc(params, jax.tree.map(jnp.asarray, whole), ref)
  g2, s2 = acc(params, jax.tree.map(jnp.asarray, split), ref)
  np.testing.assert_allclose(s1["loss"], s2["loss"], rtol=1e-5)
  assert float(s1["tokens"]) == float(s2["tokens"]) == sum(len(c.completion_tokens) for c in comps)
  for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)


@pytest.mark.slow
def test_train_step_on_8_devices_equals_single_device():
  g = grpo_cfg()
  batch = collate_minibatch(completions(2), g).arrays
  single, m1 = run_step(batch)
  sharded, m8 = run_step(batch, mesh_shape=(("data", 2), ("fsdp", 2), ("tensor", 2)))
  for k in ("loss", "grad_norm", "clip_low_frac", "entropy", "ratio_mean"):
    np.testing.assert_allclose(m8[k], m1[k], rtol=2e-5, atol=1e-7, err_msg=k)
  for a, b in zip(jax.tree.leaves(single.params), jax.tree.leaves(sharded.params)):
    # Adam's first step is ≈ lr·sign(g): entries with g ≈ 0 amplify reduction-order noise.
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5)
  assert int(sharded.step) == 1 and int(sharded.skipped) == 0


def test_non_finite_step_is_skipped_and_state_unchanged():
  g = grpo_cfg()
  batch = collate_minibatch(completions(3), g).arrays
  batch["old_logprobs"][0, 0, batch["loss_mask"][0, 0] > 0] = np.nan
  good, _ = run_step(collate_minibatch(completions(3), g).arrays)
  assert int(good.step) == 1
  bad, m = run_step(batch, state=good)
  assert float(m["update_applied"]) == 0.0 and int(bad.skipped) == 1
  assert int(bad.step) == 1
  for a, b in zip(jax.tree.leaves((good.params, good.opt_state)),
                  jax.tree.leaves((bad.params, bad.opt_state))):
    np.testing.assert_array_equal(a, b)


def completion_logprobs(params, batch, comps, placement):
  h = tfm.hidden_states(params, CFG, batch["tokens"][0], batch["positions"][0], batch["segment_ids"][0])
  lp = tfm.token_logprobs(params, CFG, h, batch["targets"][0])
  return np.array([x.sum() for x in C.unpack_tokens(np.asarray(lp)[None], comps, placement)])


def test_rl_step_raises_positive_and_lowers_negative_advantage_completions():
  comps = completions(4)
  g = grpo_cfg()
  mb = collate_minibatch(comps, g)
  batch, placement = mb.arrays, mb.placement
  assert batch["tokens"].shape[0] == 1
  params = params0()
  before = completion_logprobs(params, batch, comps, placement)
  # On-policy: the generator's log-probs are the current policy's.
  for c, lp in zip(comps, C.unpack_tokens(np.asarray(
      tfm.token_logprobs(params, CFG, tfm.hidden_states(params, CFG, batch["tokens"][0],
                         batch["positions"][0], batch["segment_ids"][0]), batch["targets"][0]))[None],
      comps, placement)):
    c.old_logprobs = lp
  mb = collate_minibatch(comps, g)
  batch, placement = mb.arrays, mb.placement
  state, m = run_step(batch)
  after = completion_logprobs(state.params, batch, comps, placement)
  adv = np.array([a[0] for a in C.unpack_tokens(batch["advantages"], comps, placement)])
  assert float(m["ratio_mean"]) == pytest.approx(1.0, abs=1e-5)
  np.testing.assert_array_less(0, (after - before)[adv > 0])
  np.testing.assert_array_less((after - before)[adv < 0], 0)


def test_remat_gives_the_same_step():
  g = grpo_cfg()
  batch = collate_minibatch(completions(5), g).arrays
  a, _ = run_step(batch, remat="none")
  b, _ = run_step(batch, remat="full")
  for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7)


def test_warmup_then_cosine_schedule():
  sched = O.learning_rate_schedule(O.OptimizerConfig(learning_rate=1.0, warmup_steps=10,
                                                     schedule="cosine", decay_steps=100,
                                                     final_lr_frac=0.1))
  assert float(sched(0)) == 0.0 and float(sched(5)) == pytest.approx(0.5)
  assert float(sched(10)) == pytest.approx(1.0)
  assert float(sched(60)) == pytest.approx(0.55, abs=1e-3)
  assert float(sched(110)) == pytest.approx(0.1)
  with pytest.raises(ValueError, match="schedule"):
    O.OptimizerConfig(schedule="linear")


def test_rows_not_divisible_by_data_parallel_size_raise():
  g = grpo_cfg(microbatch_tokens=64, microbatch_rows=2)
  batch = collate_minibatch(completions(6), g).arrays
  with pytest.raises(ValueError, match="not a multiple of the trainer's data-parallel size 8"):
    S.shard_batch(batch, make_mesh({"fsdp": 8}))


def test_trainer_takes_one_optimizer_step_per_minibatch():
  from magistral_jax.train.rl_loop import Trainer
  g = grpo_cfg(n_mini=4)                      # 8 completions -> 2 minibatches -> 2 steps
  comps = completions(7)
  groups = [ScoredGroup(gid, [c for c in comps if c.group_id == gid], []) for gid in (0, 1)]
  trainer = Trainer(step_fn()[0], state0(), version=3)
  history = [trainer.step(mb) for mb in make_minibatches(groups, g, np.random.default_rng(0))]
  assert int(trainer.state.step) == 2 and trainer.opt_steps == 2 and trainer.version == 5
  assert all(h["update_applied"] == 1.0 for h in history)


@pytest.mark.slow
def test_bf16_compute_keeps_fp32_master_weights():
  g = grpo_cfg()
  batch = collate_minibatch(completions(8), g).arrays
  _, m32 = run_step(batch)
  state, m16 = run_step(batch, remat="none", dtype="bfloat16")
  assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(state.params))
  assert float(m16["update_applied"]) == 1.0
  np.testing.assert_allclose(m16["loss"], m32["loss"], rtol=0.05, atol=1e-3)
  np.testing.assert_allclose(m16["entropy"], m32["entropy"], rtol=0.02)
