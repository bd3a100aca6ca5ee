"""Run checkpoints (train/checkpointing.py): exact round trip, keep-N, fallback past a corrupted or
partial latest checkpoint, and resume = the uninterrupted run at the train-step level."""
import glob
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from magistral_jax.model.config import ModelConfig
from magistral_jax.parallel.config import TRAINER_RULES
from magistral_jax.parallel.sharding import make_mesh
from magistral_jax.rl import collate as C
from magistral_jax.rl.advantages import ScoredGroup
from magistral_jax.rl.config import GRPOConfig
from magistral_jax.rl.minibatch import make_minibatches
from magistral_jax.train import optimizer as O
from magistral_jax.train import step as S
from magistral_jax.train.checkpointing import RunCheckpointer, abstract_like
from magistral_jax.train.rl_loop import Trainer


def _tree(scale):
  rng = np.random.default_rng(0)   # random, hence incompressible: corruption cannot hide
  return {"w": jnp.asarray(rng.normal(size=(64, 32)).astype(np.float32) * scale),
          "b": {"c": jnp.arange(8, dtype=jnp.int32) * int(scale)}}


def _three_steps(d, keep=3):
  ck = RunCheckpointer(d, keep=keep)
  for s in (1, 2, 3):
    ck.save(s, _tree(s), {"step": s, "data": {"consumed": 10 * s}}, force=True)
  ck.close()


def _assert_tree_equal(a, b):
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


def test_round_trip_and_keep_n(tmp_path):
  _three_steps(tmp_path / "ck", keep=2)
  ck = RunCheckpointer(tmp_path / "ck", keep=2)
  assert ck.steps() == [2, 3]                     # keep=2: step 1 was garbage-collected
  step, state, meta = ck.restore_latest(abstract_like(_tree(1)))
  assert step == 3 and meta == {"step": 3, "data": {"consumed": 30}}
  _assert_tree_equal(state, _tree(3))
  assert state["b"]["c"].dtype == jnp.int32
  ck.close()


def _corrupt_data(step_dir):
  files = glob.glob(os.path.join(step_dir, "state", "**", "d", "*"), recursive=True)
  assert files
  for f in files:   # a torn write: each data file cut in half
    data = open(f, "rb").read()
    open(f, "wb").write(data[:len(data) // 2])


def _partial_meta(step_dir):
  os.remove(os.path.join(step_dir, "meta", "metadata"))


@pytest.mark.parametrize("damage", [_corrupt_data, _partial_meta])
def test_broken_latest_falls_back_with_warning_and_is_moved_aside(tmp_path, caplog, damage):
  d = tmp_path / "ck"
  _three_steps(d)
  damage(str(d / "3"))
  ck = RunCheckpointer(d, keep=3)
  with caplog.at_level(logging.WARNING):
    step, state, meta = ck.restore_latest(abstract_like(_tree(1)))
  assert step == 2 and meta["data"] == {"consumed": 20}
  _assert_tree_equal(state, _tree(2))
  assert "checkpoint 3" in caplog.text and "cannot be restored" in caplog.text
  # The broken step is kept (moved aside), and the resumed run can write step 3 again.
  assert ck.steps() == [1, 2]
  assert len(os.listdir(str(d) + ".broken")) == 1
  assert ck.save(3, _tree(5), {"step": 3}, force=True)
  ck.close()
  ck = RunCheckpointer(d, keep=3)
  step, state, _ = ck.restore_latest(abstract_like(_tree(1)))
  assert step == 3
  _assert_tree_equal(state, _tree(5))
  ck.close()


def test_nothing_restorable_returns_none(tmp_path):
  d = tmp_path / "ck"
  ck = RunCheckpointer(d)
  assert ck.restore_latest(abstract_like(_tree(1))) is None   # empty directory
  ck.close()
  _three_steps(d)
  for s in (1, 2, 3):
    _partial_meta(str(d / str(s)))
  ck = RunCheckpointer(d)
  assert ck.restore_latest(abstract_like(_tree(1))) is None
  assert ck.steps() == [1, 2, 3]   # nothing to resume from: nothing is moved
  ck.close()


# ---- resume == uninterrupted, at the train-step level ---------------------------------------

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8, logits_chunk=16)
GRPO = GRPOConfig(n_batch=8, n_mini=8, group_size=4, microbatch_tokens=128, microbatch_rows=4)
TX = O.make_optimizer(O.OptimizerConfig(learning_rate=1e-2))


def _batch(index):
  """Batch `index` of a fixed stream: what a seeded data iterator at position `index` yields."""
  rng = np.random.default_rng(1000 + index)
  out = []
  for i in range(GRPO.n_batch):
    c = rng.integers(3, CFG.vocab_size, rng.integers(2, 12))
    out.append(C.Completion(rng.integers(3, CFG.vocab_size, rng.integers(1, 5)), c,
                            -np.abs(rng.normal(4.0, 0.3, len(c))), float(rng.normal()),
                            i // GRPO.group_size))
  return out


def _run(step_fn, state, mesh, start, stop):
  trainer = Trainer(step_fn, state, mesh, TRAINER_RULES)
  for b in range(start, stop):
    comps = _batch(b)
    groups = [ScoredGroup(g, [c for c in comps if c.group_id == g], [])
              for g in sorted({c.group_id for c in comps})]
    for mb in make_minibatches(groups, GRPO):
      trainer.step(mb)
  return trainer.state


def test_resume_gives_the_same_params_as_an_uninterrupted_run(tmp_path):
  mesh = make_mesh({"fsdp": 4}, jax.devices()[:4])
  step_fn = S.make_grpo_step(CFG, GRPO, TX, mesh, TRAINER_RULES)
  straight = _run(step_fn, S.init_state(CFG, TX, jax.random.PRNGKey(0), mesh, TRAINER_RULES),
                  mesh, 0, 4)

  first = _run(step_fn, S.init_state(CFG, TX, jax.random.PRNGKey(0), mesh, TRAINER_RULES),
               mesh, 0, 2)
  ck = RunCheckpointer(tmp_path / "ck", keep=2)
  ck.save(2, first, {"batches": 2, "data": {"consumed": 2}})
  ck.close()
  del first

  # "Restart": a fresh state from a different seed, overwritten by the checkpoint.
  fresh = S.init_state(CFG, TX, jax.random.PRNGKey(7), mesh, TRAINER_RULES)
  ck = RunCheckpointer(tmp_path / "ck", keep=2)
  step, resumed, meta = ck.restore_latest(abstract_like(fresh))
  ck.close()
  assert step == 2 and int(resumed.step) == 2
  assert (jax.tree.leaves(resumed.params)[0].sharding ==
          jax.tree.leaves(fresh.params)[0].sharding)
  resumed = _run(step_fn, resumed, mesh, meta["data"]["consumed"], 4)

  assert int(resumed.step) == int(straight.step) == 4
  _assert_tree_equal(resumed.params, straight.params)
  _assert_tree_equal(resumed.opt_state, straight.opt_state)
  # and the checkpoint mattered: 2 steps from the fresh seed land elsewhere
  other = _run(step_fn, fresh, mesh, 2, 4)
  assert not np.array_equal(np.asarray(other.params["embed"]["embedding"]),
                            np.asarray(straight.params["embed"]["embedding"]))
