"""launch/train.py on the tiny config: runs, writes what it promises, resumes, rejects bad config."""
import json
import os
import subprocess
import sys

import pytest

from magistral_jax import config as config_lib

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _load(arg=None):
  sys.path.insert(0, ROOT)
  import importlib.util
  spec = importlib.util.spec_from_file_location("tiny_cfg", os.path.join(ROOT, "configs/tiny.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod.get_config(arg)


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
  with pytest.raises(ValueError, match="unknown config argument"):
    _load("adv_nrom=group")
  assert _load("adv_norm=group,mode=sync").rl.adv_norm == "group"


def test_unknown_flag_override_fails_before_work(tmp_path):
  r = _train(tmp_path, "--config=configs/tiny.py", "--config.rl.eps_hihg=0.3", timeout=120)
  assert r.returncode != 0 and "eps_hihg" in (r.stderr + r.stdout)
  r = _train(tmp_path, "--config=configs/tiny.py", "--config.rl.n_batch=abc", timeout=120)
  assert r.returncode != 0
  assert not os.path.exists(tmp_path / "checkpoints")


def test_tiny_run_writes_summary_metrics_checkpoints_and_resumes(tmp_path):
  flags = ["--config=configs/tiny.py:batches=2,sft_steps=10", "--config.checkpoint.every=1",
           "--config.data.heldout=8"]
  r = _train(tmp_path, *flags)
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  summary = json.load(open(tmp_path / "summary.json"))
  for key in ("heldout_accuracy_before", "heldout_accuracy_after", "format_rate", "wall_time_s"):
    assert key in summary
  assert summary["batches"] == 2
  rows = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  assert any("reward" in r for r in rows)
  # The tiny system prompt (35 of its ~50-token prompts) is prefilled once per weights version
  # and every training prompt continues it (engine.shared_prefix_cache, on by default).
  assert "shared prompt prefix: 35 tokens" in r.stdout + r.stderr
  assert max(r.get("generator_shared_prefix_hits", 0) for r in rows) > 0
  assert os.listdir(tmp_path / "tb")
  steps = sorted(int(s) for s in os.listdir(tmp_path / "checkpoints") if s.isdigit())
  assert steps and steps[-1] == summary["optimizer_steps"] == 4   # 2 optimizer steps per batch
  # A second invocation with a larger budget resumes from the checkpoint, not from scratch.
  r = _train(tmp_path, "--config=configs/tiny.py:batches=3,sft_steps=10",
             "--config.data.heldout=8")
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  out = r.stdout + r.stderr
  assert "resumed from checkpoint 4" in out
  assert "cold-start SFT" not in out
  resumed = json.load(open(tmp_path / "summary.json"))
  assert resumed["batches"] == 3
  # Wall time adds up across the two processes (the checkpoint carries the first one's).
  assert resumed["wall_time_s"] > summary["wall_time_s"]


@pytest.mark.parametrize("name", ["tiny", "tiny:mode=sync,n_mini_per_batch=1", "smollm2",
                                  "smollm2:ci", "smollm2:gpu", "smollm2:sft", "smollm2:sft,ci",
                                  "small", "medium", "sft_small"])
def test_every_recipe_validates(name):
  import importlib.util
  name, _, arg = name.partition(":")
  spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, f"configs/{name}.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  c = mod.get_config(arg or None)
  run = config_lib.validate(c)
  if name == "medium":   # the paper's stage schedule: 16k/24k/32k budgets, 8k/4k/2k batches
    assert [s["overrides"]["rl.n_batch"] for s in c.stages] == [8192, 4096, 2048]
    assert [s["overrides"]["reward.l_max"] - c.reward.l_cache for s in c.stages] == [
        16384, 24576, 32768]
    assert run.rl.eps_high == 0.28 and run.rl.n_batch == run.rl.n_mini
  if name == "small":
    assert run.rl.eps_high == 0.3 and run.rl.n_batch == 2048
    assert run.reward.l_max - run.reward.l_cache == 32768
