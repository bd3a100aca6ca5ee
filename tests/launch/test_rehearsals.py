"""The rehearsals of the paper's recipes (configs/medium.py:rehearsal, configs/small.py:rehearsal).

Each runs launch/train.py end to end on CPU through every stage of its recipe, is stopped in the
middle (config.stop_after_batches) and relaunched on the same workdir, which must continue from
the saved step and finish. A rehearsal must catch what a recipe run would hit at scale:
- weights that do not learn at the recipe's learning rate (bf16 master weights at lr 1e-6 change
  almost no element: >= 99% of the weights must have changed over the RL run);
- a sequence longer than a microbatch row (the row-fit relation of the recipe is kept, and the
  rehearsal generates sequences of the longest length a stage allows and trains on them).
"""
import importlib
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from magistral_jax import config as config_lib

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# name -> stop_after_batches of the first launch: in the middle of a stage, not at its end.
STOP_AFTER = {"medium": 3, "small": 2}


def _module(name):
  return importlib.import_module(f"configs.{name}")


# Extra launch/train.py flags for both launches, e.g. MAGISTRAL_REHEARSAL_FLAGS=
# "--config.model.param_dtype=float32" to try the weights check against another dtype.
EXTRA_FLAGS = os.environ.get("MAGISTRAL_REHEARSAL_FLAGS", "").split()


def _train(workdir, *flags, timeout=900):
  return subprocess.run([sys.executable, os.path.join(ROOT, "launch/train.py"),
                         f"--workdir={workdir}", *flags, *EXTRA_FLAGS], cwd=ROOT,
                        env=dict(os.environ),
                        capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("name", ["medium", "small"])
def test_rehearsal_config_is_the_recipe_divided(name):
  mod = _module(name)
  recipe, c = mod.get_config(), mod.get_config("rehearsal")
  run = config_lib.validate(c, num_devices=8)
  L, B, G = mod.LENGTH_DIVISOR, mod.BATCH_DIVISOR, mod.GROUP_DIVISOR
  # Kept as they are.
  for section, keys in (("rl", ("eps_low", "eps_high", "adv_norm", "loss_agg")),
                        ("optimizer", ("learning_rate", "warmup_steps", "grad_clip_norm")),
                        ("model", ("param_dtype", "dtype", "remat")),
                        ("sampling", ("temperature", "top_p")),
                        ("pipeline", ("mode",))):
    for k in keys:
      assert c[section][k] == recipe[section][k], (section, k)
  assert run.rl.n_batch == run.rl.n_mini
  # The model's dimensions and the task: the CPU default's (configs/tiny.py), read from it.
  from magistral_jax.run.rehearsal import TINY_MODEL, TINY_TASK
  tiny = _module("tiny").get_config()
  assert {k: c.model[k] for k in TINY_MODEL} == {k: tiny.model[k] for k in TINY_MODEL}
  assert {k: c.data[k] for k in TINY_TASK} == {k: tiny.data[k] for k in TINY_TASK}
  assert c.tokenizer == tiny.tokenizer
  assert c.pipeline.n_async * recipe.rl.n_batch == recipe.pipeline.n_async * c.rl.n_batch
  # Divided by the stated factors.
  assert c.rl.n_batch == recipe.rl.n_batch // B and c.rl.group_size == recipe.rl.group_size // G
  assert c.engine.max_prefill_length == recipe.engine.max_prefill_length // L
  assert c.sampling.max_new_tokens == recipe.sampling.max_new_tokens // L
  assert (c.reward.l_max, c.reward.l_cache) == (recipe.reward.l_max // L,
                                                recipe.reward.l_cache // L)
  assert (c.rl.microbatch_tokens // c.rl.microbatch_rows
          == recipe.rl.microbatch_tokens // recipe.rl.microbatch_rows // L)
  # The stage schedule, each override divided like its field.
  assert [s["name"] for s in c.stages] == [s["name"] for s in recipe.stages]
  for s, r in zip(c.stages, recipe.stages):
    for k, v in r["overrides"].items():
      div = L if k.startswith(("reward.", "sampling.", "engine.")) else B
      assert s["overrides"][k] == v // div, k
  # The row-fit relation flows from the recipe: a recipe row two divided tokens shorter (too
  # short for its longest sequence) makes a rehearsal that fails the same check.
  recipe.rl.microbatch_tokens -= 2 * L * recipe.rl.microbatch_rows
  with pytest.raises(ValueError, match="longest sequence"):
    config_lib.validate(_rehearsal_of(mod, recipe))


def _rehearsal_of(mod, recipe):
  from magistral_jax.run.rehearsal import rehearsal_of
  return rehearsal_of(recipe, length_divisor=mod.LENGTH_DIVISOR, batch_divisor=mod.BATCH_DIVISOR,
                      group_divisor=mod.GROUP_DIVISOR, batches_per_stage=mod.REHEARSAL_BATCHES)


def _changed_fraction(workdir, step_a, step_b):
  """Fraction of parameter elements that differ between two checkpoints, per leaf and over all
  but the input embedding (rows of the symbols a short run never reads get no gradient at any
  precision)."""
  import jax
  from magistral_jax.analysis.workdir import load_params
  a, b = load_params(str(workdir), step_a), load_params(str(workdir), step_b)
  per_leaf, changed, total = {}, 0, 0
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
    x, y = np.asarray(x), np.asarray(y)
    key = jax.tree_util.keystr(path)
    per_leaf[key] = float(np.mean(x != y))
    if "embed" not in key:
      changed += int(np.sum(x != y))
      total += x.size
  return changed / total, per_leaf


@pytest.mark.slow
@pytest.mark.parametrize("name", ["medium", "small"])
def test_rehearsal_runs_every_stage_resumes_and_learns(name, tmp_path):
  mod = _module(name)
  c = mod.get_config("rehearsal")
  stages = list(c.stages) or [{"name": "rl", "num_batches": c.num_batches}]
  total = sum(s["num_batches"] for s in stages)
  stop = STOP_AFTER[name]
  assert 0 < stop < total
  flags = [f"--config=configs/{name}.py:rehearsal"]

  # First launch: cold start, then RL until stop_after_batches, a checkpoint, a clean exit.
  r1 = _train(tmp_path, *flags, f"--config.stop_after_batches={stop}")
  out1 = r1.stdout + r1.stderr
  assert r1.returncode == 0, out1[-5000:]
  assert f"stopping after {stop} batches" in out1, out1[-3000:]
  assert "cold-start SFT" in out1
  meta_path = tmp_path / "checkpoints"
  saved = max(int(s) for s in os.listdir(meta_path) if s.isdigit())
  assert saved == stop   # n_batch = n_mini: one optimizer step per batch

  # Second launch on the same workdir: continues from the saved step, finishes every stage.
  r2 = _train(tmp_path, *flags)
  out2 = r2.stdout + r2.stderr
  assert r2.returncode == 0, out2[-5000:]
  assert f"resumed from checkpoint {saved}" in out2, out2[-3000:]
  assert "cold-start SFT" not in out2
  for i, s in enumerate(stages):
    assert f"stage {i + 1}/{len(stages)} {s['name']!r}" in out1 + out2, s["name"]
  assert f"stage {len(stages)}/{len(stages)}" in out2
  summary = json.load(open(tmp_path / "summary.json"))
  assert summary["batches"] == total and summary["optimizer_steps"] == total
  assert summary["heldout_trained_on"] == 0

  rows = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  rl = [r for r in rows if "loss" in r and "reward" in r]
  # One row per batch, numbered 1..total across the two processes: the second went on from the
  # first's checkpoint (its first batch is stop + 1), not from 0.
  assert [int(r["batch"]) for r in rl] == list(range(1, total + 1))
  assert all(math.isfinite(r["loss"]) for r in rl)
  # Each stage decodes up to its own max_new_tokens (medium's stages set it to their l_max).
  # None went past its stage's cap, and sequences of the longest length a stage allows were
  # generated and trained on (the row-fit relation is exercised at its edge): some completion
  # ran to its stage's cap. Which stage's sampling reaches it first is up to the sampler.
  caps = [s.get("overrides", {}).get("sampling.max_new_tokens", c.sampling.max_new_tokens)
          for s in stages for _ in range(s["num_batches"])]
  lengths = [r["response_length_max"] for r in rl]
  assert all(n <= cap for n, cap in zip(lengths, caps)), (lengths, caps)
  assert any(n == cap for n, cap in zip(lengths, caps)), (lengths, caps)

  # The recipe's optimizer at the recipe's lr moved (almost) every weight over the RL run:
  # checkpoint 0 is the policy RL started from (after the cold start), `total` the last.
  frac, per_leaf = _changed_fraction(tmp_path, 0, total)
  assert frac >= 0.99, (f"only {frac:.4%} of the weights changed over {total} optimizer steps at "
                        f"lr {c.optimizer.learning_rate} with param_dtype="
                        f"{c.model.param_dtype}: {per_leaf}")
