"""launch/train.py on the tiny config: rejects a bad config before any work; every recipe validates.

A tiny run's outputs and its resume: tests/launch/test_tiny_learns.py.
"""
import os
import subprocess
import sys

import pytest

from magistral_jax import config as config_lib

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _load(arg=None):
  from configs import tiny
  return tiny.get_config(arg)


def _train(workdir, *flags, timeout=900):
  env = dict(os.environ)
  return subprocess.run([sys.executable, os.path.join(ROOT, "launch/train.py"),
                         f"--workdir={workdir}", *flags], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=timeout)


def test_config_errors_are_clear_before_any_work():
  c = _load()
  config_lib.validate(c, num_devices=8)
  bad = _load()
  bad.rl.n_mini = 24
  with pytest.raises(ValueError, match="n_batch=64 is not a multiple of n_mini=24"):
    config_lib.validate(bad)
  bad = _load()
  bad.rl.group_size = 1
  bad.rl.n_mini = bad.rl.n_batch = 4
  with pytest.raises(ValueError, match="group_size=1"):
    config_lib.validate(bad)
  with pytest.raises(ValueError, match="needs|has 2"):
    config_lib.validate(_load(), num_devices=2)
  bad = _load()
  bad.model.hidden_sise = 3
  with pytest.raises(ValueError, match="hidden_sise"):
    config_lib.validate(bad)
  bad = _load()
  bad.engine.attention_windows = 0
  with pytest.raises(ValueError, match="attention_windows=0"):
    config_lib.validate(bad)
  bad = _load()
  bad.engine.loop_prefill_below = 1.5
  with pytest.raises(ValueError, match="loop_prefill_below=1.5"):
    config_lib.validate(bad)
  with pytest.raises(ValueError, match="bad config argument"):
    _load("adv_nrom=group")
  assert _load("adv_norm=group,mode=sync").rl.adv_norm == "group"


def test_unknown_flag_override_fails_before_work(tmp_path):
  r = _train(tmp_path, "--config=configs/tiny.py", "--config.rl.eps_hihg=0.3", timeout=120)
  assert r.returncode != 0 and "eps_hihg" in (r.stderr + r.stdout)
  r = _train(tmp_path, "--config=configs/tiny.py", "--config.rl.n_batch=abc", timeout=120)
  assert r.returncode != 0
  assert not os.path.exists(tmp_path / "checkpoints")


@pytest.mark.parametrize("name", ["tiny", "tiny:mode=sync,n_mini_per_batch=1", "smollm2",
                                  "smollm2:ci", "smollm2:gpu", "smollm2:sft", "smollm2:sft,ci",
                                  "smollm2_learn", "smollm2_learn:control,colocated",
                                  "smollm2_learn:sft,colocated", "smollm2_learn:gpu,colocated",
                                  "smollm2_learn:task=synthetic/999/2-4",
                                  "small", "medium", "sft_small"])
def test_every_recipe_validates(name):
  import importlib
  name, _, arg = name.partition(":")
  c = importlib.import_module(f"configs.{name}").get_config(arg or None)
  run = config_lib.validate(c)
  if name == "medium":   # the paper's stage schedule: 16k/24k/32k budgets, 8k/4k/2k batches
    assert [s["overrides"]["rl.n_batch"] for s in c.stages] == [8192, 4096, 2048]
    assert [s["overrides"]["reward.l_max"] - c.reward.l_cache for s in c.stages] == [
        16384, 24576, 32768]
    # each stage decodes up to its own l_max (the KV cache and decode steps a stage needs)
    assert [s["overrides"]["sampling.max_new_tokens"] for s in c.stages] == [
        s["overrides"]["reward.l_max"] for s in c.stages] == [24576, 32768, 40960]
    assert run.rl.eps_high == 0.28 and run.rl.n_batch == run.rl.n_mini
  if name == "smollm2_learn":
    assert c.data.source == "synthetic" and c.data.heldout >= 256 and c.eval.k >= 4
    assert c.reward.control == ("random" if "control" in arg else "none")
    assert c.eval.before == ("control" not in arg)
    if "task=" in arg:
      assert (c.data.max_operand, c.data.min_steps, c.data.max_steps) == (999, 2, 4)
  if name == "small":
    assert run.rl.eps_high == 0.3 and run.rl.n_batch == 2048
    assert run.reward.l_max - run.reward.l_cache == 32768


def test_the_evaluation_and_every_stage_share_the_generators_engine():
  """The run builds its engines through pipeline.generators.engine_for with one dict per run:
  the tiny default's evaluation (T=0.7) runs on the first generator's engine (T=1.0), and a later
  stage with the same shapes reuses it, so neither compiles programs of its own. An evaluation
  whose compiled-in sampling differs (greedy) gets its own engine."""
  import dataclasses
  import jax
  from magistral_jax.model import transformer as T
  from magistral_jax.model.loading import load_policy
  from magistral_jax.pipeline.generators import make_generators
  from magistral_jax.eval.in_run import eval_loop_factory
  from magistral_jax.run.stages import training_sampling
  run = config_lib.validate(_load())
  tok, model_cfg, _ = load_policy(run.model, run.init, run.tokenizer, load_weights=False)
  params = T.init_params(model_cfg, jax.random.PRNGKey(0))
  devs = jax.devices()[4:6]
  engines = {}
  evaluation = eval_loop_factory(run, model_cfg, devs, tok, None, engines)
  kw = dict(mesh_shape=run.devices.generator_mesh, rules=run.sharding.generator_rules,
            engines=engines)
  sampling = training_sampling(run, tok.eos_id)
  stage_1 = make_generators(model_cfg, params, [devs], sampling, run.engine, **kw)
  stage_2 = make_generators(model_cfg, params, [devs], sampling, run.engine, **kw)
  loop = evaluation(params)
  assert len(engines) == 1 and loop.engine is stage_1[0].engine is stage_2[0].engine
  assert (loop.sampling.temperature, stage_1[0].sampling.temperature) == (0.7, 1.0)
  greedy = dataclasses.replace(run, eval=dataclasses.replace(run.eval, greedy=True))
  eval_loop_factory(greedy, model_cfg, devs, tok, None, engines)
  assert len(engines) == 2
