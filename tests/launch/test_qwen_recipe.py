"""configs/qwen.py on a random-init Qwen3 checkpoint that transformers writes offline (README,
"Bring your own model"), on one device: XLA_FLAGS=--xla_force_host_platform_device_count=1, the
recipe's layout (the trainer and the generator colocated, taking turns). A user's checkpoint goes
through the two launches the recipe names: a cold start from the Hugging Face checkpoint
(launch/sft.py) and GRPO from its weights (launch/train.py), stopped after half its batches and
resumed by a second process on the same workdir; the reward rises on the tiny task (narrowed as
tests/launch/test_tiny_learns.py narrows it: operands 0..4, 1-2 steps, one optimizer step per
batch of 128 completions at lr 5e-4).

The architecture's own parts (q/k norms, a head_dim apart from hidden/heads) are in every
forward, decode and train step here; their parity with transformers is
tests/model/test_architectures.py. The colocated sync schedule is deterministic (each batch is
generated under one policy version from seeded requests, its groups ordered by id), so this run
is the same every time on a given build.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BATCHES, STOP_AT = 16, 8   # configs/qwen.py:tiny's batches, and where the first launch stops


def _launch(script, workdir, recipe_args, *flags):
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
  r = subprocess.run([sys.executable, os.path.join(ROOT, "launch", script),
                      f"--config=configs/qwen.py:{recipe_args}", f"--workdir={workdir}", *flags],
                     cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  return r.stdout + r.stderr


def _qwen3_checkpoint(path):
  transformers = pytest.importorskip("transformers")
  torch = pytest.importorskip("torch")
  torch.manual_seed(0)
  cfg = transformers.Qwen3Config(
      vocab_size=128, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
      num_attention_heads=4, num_key_value_heads=2, head_dim=48, max_position_embeddings=256,
      rope_theta=1e6, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)
  transformers.Qwen3ForCausalLM(cfg).save_pretrained(path, safe_serialization=True)


@pytest.mark.slow
@pytest.mark.long
def test_a_qwen3_checkpoint_cold_starts_learns_on_one_device_and_resumes(tmp_path):
  ckpt, sft, rl = tmp_path / "qwen3", tmp_path / "sft", tmp_path / "rl"
  _qwen3_checkpoint(ckpt)
  _launch("sft.py", sft, f"tiny,path={ckpt}")
  args = f"tiny,path={ckpt},sft={sft}/params"
  log = _launch("train.py", rl, args, f"--config.stop_after_batches={STOP_AT}")
  assert "colocated on the trainer's 1 device(s), taking turns" in log
  assert f"stopping after {STOP_AT} batches" in log
  log = _launch("train.py", rl, args)
  assert f"resumed from checkpoint {STOP_AT}" in log and "held-out pass@1" in log

  rows = [json.loads(line) for line in open(rl / "metrics.jsonl")]
  batches = [row for row in rows if "reward" in row]
  assert [row["batch"] for row in batches] == list(range(1, BATCHES + 1))   # none lost or redone
  reward = np.asarray([row["reward"] for row in batches])
  assert reward[-6:].mean() > reward[:6].mean() + 0.01, reward.round(3)
  for row in batches:
    # Taking turns: each batch is one policy version, the push moved nothing, and the generation
    # phase freed what it held before the trainer stepped.
    assert row["versions_in_batch"] == 1 and row["weight_push_s"] == 0.0
    assert row["memory/generation_released_bytes"] > 0
    assert row["memory/train_peak_bytes"] > 0
  summary = json.load(open(rl / "summary.json"))
  assert summary["batches"] == BATCHES and summary["heldout_trained_on"] == 0
  # The RL run restored the cold start's weights, whose config.json is the checkpoint's Qwen3.
  assert json.load(open(rl / "config.json"))["init"] == {"source": "orbax",
                                                         "path": f"{sft}/params"}
  saved = json.load(open(sft / "config.json"))
  assert saved["architectures"] == ["Qwen3ForCausalLM"] and saved["head_dim"] == 48
