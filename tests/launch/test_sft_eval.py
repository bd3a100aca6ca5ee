"""launch/sft.py and launch/eval.py on the tiny config: SFT writes loadable params and resumes;
eval reads a run's checkpoint or the config's init weights and writes its table/JSON; the SFT
packing of SftLoader batches matches the trainer's own collation; sweeps expand correctly."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ["--config.data.heldout=4", "--config.eval.max_new_tokens=16", "--config.eval.greedy=True",
        "--config.eval.k=1"]


def _launch(script, workdir, *flags, timeout=300):
  return subprocess.run([sys.executable, os.path.join(ROOT, "launch", script),
                         f"--workdir={workdir}", *flags], cwd=ROOT, capture_output=True,
                        text=True, timeout=timeout)


def _ok(r):
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  return r.stdout + r.stderr


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
  """3 SFT steps with a checkpoint at 3, then a second invocation continuing to 5."""
  wd = tmp_path_factory.mktemp("sft")
  first = _ok(_launch("sft.py", wd, "--config=configs/tiny.py:sft_steps=3",
                      "--config.checkpoint.every=3"))
  second = _ok(_launch("sft.py", wd, "--config=configs/tiny.py:sft_steps=5",
                       "--config.checkpoint.every=3"))
  return wd, first, second


def test_sft_writes_params_metrics_and_resumes(sft_run):
  wd, first, second = sft_run
  assert "resumed SFT" not in first and "resumed SFT from step 3" in second
  summary = json.load(open(wd / "sft_summary.json"))
  assert summary["sft_steps"] == 5 and np.isfinite(summary["final_nll_per_token"])
  rows = [json.loads(l) for l in open(wd / "metrics.jsonl")]
  assert [r["step"] for r in rows] == [3, 5] and all("sft/nll_per_token" in r for r in rows)
  steps = sorted(int(s) for s in os.listdir(wd / "checkpoints") if s.isdigit())
  assert steps[-1] == 5
  # What configs/small.py's init.source="orbax" reads: the model config beside the params.
  from magistral_jax.model.orbax_params import read_orbax_config, restore_params_orbax
  cfg = read_orbax_config(str(wd / "params"))
  assert cfg.hidden_size == 128 and cfg.num_layers == 4
  params = restore_params_orbax(str(wd / "params"))
  assert params["embed"]["embedding"].shape == (cfg.vocab_size, 128)
  assert json.load(open(wd / "sft_config.json"))["sft"]["num_steps"] == 5


def test_eval_from_checkpoint_and_from_init_agree(sft_run, tmp_path):
  wd, _, _ = sft_run
  out = _ok(_launch("eval.py", wd, "--config=configs/tiny.py", *TINY))
  assert "pass@1" in out and "synthetic" in out
  res = json.load(open(wd / "eval_5.json"))
  s = res["sets"]["synthetic"]
  assert res["checkpoint"] == 5 and s["num_problems"] == 4 and len(s["rows"]) == 4
  assert 0.0 <= s["pass@1"] <= 1.0 and "maj@1" in s
  # The same weights through init.source=orbax (the RL warm start path): same greedy samples.
  _ok(_launch("eval.py", tmp_path, "--config=configs/tiny.py", "--checkpoint=init",
              "--config.init.source=orbax", f"--config.init.path={wd / 'params'}", *TINY))
  init = json.load(open(tmp_path / "eval_init.json"))["sets"]["synthetic"]
  assert [r["sample"] for r in init["rows"]] == [r["sample"] for r in s["rows"]]
  r = _launch("eval.py", wd, "--config=configs/tiny.py", "--checkpoint=99", *TINY)
  assert r.returncode != 0 and "no checkpoint 99" in r.stdout + r.stderr


def test_sft_loader_batches_match_the_trainer_collation():
  """A packed SftLoader row -> the same targets/loss mask/positions sft_collate builds."""
  from magistral_jax.train.sft import loader_batch_arrays, sft_collate
  pairs = [([1, 5, 6], [7, 8, 2]), ([1, 9], [10, 11, 12, 2])]
  arrays, _ = sft_collate(pairs, 16, 1)
  # The loader's packed row: each sequence whole, loss_mask on response tokens, segment ids 1..
  row = {k: np.zeros((1, 16), np.int32) for k in ("tokens", "loss_mask", "segment_ids",
                                                  "positions")}
  start = 0
  for seg, (p, c) in enumerate(pairs, start=1):
    n = len(p) + len(c)
    row["tokens"][0, start:start + n] = p + c
    row["loss_mask"][0, start + len(p):start + n] = 1
    row["segment_ids"][0, start:start + n] = seg
    row["positions"][0, start:start + n] = np.arange(n)
    start += n
  got = loader_batch_arrays(row, 1)
  mask = arrays["loss_mask"][0, 0] > 0
  assert int(mask.sum()) == int(got["loss_mask"].sum()) == 7
  # sft_collate drops each sequence's last input token; compare the predicted (target) tokens.
  np.testing.assert_array_equal(got["targets"][0, 0][got["loss_mask"][0, 0] > 0],
                                arrays["targets"][0, 0][mask])
  np.testing.assert_allclose(got["weights"].sum(), 1.0)
  with pytest.raises(ValueError, match="multiple of sft.rows_per_micro"):
    loader_batch_arrays({k: np.concatenate([v] * 3) for k, v in row.items()}, 2)


def test_sft_on_a_built_trace_dataset(tmp_path):
  from magistral_jax.data import jsonl, synthetic, tfds_builders as tb
  rows = [{"id": f"s{i}", "prompt": p["problem"], "completion": synthetic.trace(p)}
          for i, p in enumerate(synthetic.take(24, 0, "sft"))]
  jsonl.write_jsonl(str(tmp_path / "s.jsonl"), rows)
  tb.build_dataset("sft", "traces", str(tmp_path / "s.jsonl"), str(tmp_path / "data"))
  wd = tmp_path / "run"
  _ok(_launch("sft.py", wd, "--config=configs/tiny.py", "--config.data.source=traces",
              f"--config.data.data_dir={tmp_path / 'data'}", "--config.sft.num_steps=0",
              "--config.sft.epochs=1", "--config.sft.batch_size=4", "--config.sft.row_len=256"))
  summary = json.load(open(wd / "sft_summary.json"))
  # One epoch of 24 traces packed 4 rows a batch: at least one full batch, and it ends.
  assert summary["sft_steps"] >= 1 and np.isfinite(summary["final_nll_per_token"])
  assert os.path.isdir(wd / "params")
  r = _launch("sft.py", tmp_path / "bad", "--config=configs/tiny.py",
              "--config.data.source=traces", "--config.sft.num_steps=0")
  assert r.returncode != 0 and "data.data_dir" in r.stdout + r.stderr


def test_sweep_expands_the_grid_and_checks_axes_before_running():
  from magistral_jax.run import sweep
  from magistral_jax.run.recipes import load_recipe
  tiny = load_recipe("configs/tiny.py", ROOT)
  axes = sweep.parse_sweep("rl.eps_high=0.2,0.28; rl.adv_norm=minibatch,group")
  sweep.check_axes(tiny, axes)
  points = sweep.expand("configs/tiny.py:batches=2", axes, "/r", extra="--config.seed=3")
  assert [p["name"] for p in points] == [
      "eps_high_0.2-adv_norm_minibatch", "eps_high_0.2-adv_norm_group",
      "eps_high_0.28-adv_norm_minibatch", "eps_high_0.28-adv_norm_group"]
  assert points[1]["argv"][2:] == [
      "--config=configs/tiny.py:batches=2", "--workdir=/r/eps_high_0.2-adv_norm_group",
      "--config.rl.eps_high=0.2", "--config.rl.adv_norm=group", "--config.seed=3"]
  with pytest.raises(ValueError, match="no field 'rl.eps_hgh'"):
    sweep.check_axes(tiny, sweep.parse_sweep("rl.eps_hgh=0.2"))
  with pytest.raises(ValueError, match="is int"):
    sweep.check_axes(tiny, sweep.parse_sweep("rl.n_batch=x"))
  with pytest.raises(FileNotFoundError, match="no such file"):
    load_recipe("configs/nosuch.py", ROOT)
  for bad in ("", "rl.eps_high", "rl.eps_high=", "a=1;a=2"):
    with pytest.raises(ValueError):
      sweep.parse_sweep(bad)


def test_sweep_runs_points_in_sequence_and_collects_summaries(tmp_path):
  root = tmp_path / "sweep"
  cmd = [sys.executable, os.path.join(ROOT, "launch/sweep.py"),
         "--config=configs/tiny.py:sft_steps=2", "--script=launch/sft.py",
         "--sweep=sft.learning_rate=0.003", f"--workdir_root={root}"]
  dry = subprocess.run(cmd + ["--dry_run"], cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert dry.returncode == 0 and "--config.sft.learning_rate=0.003" in dry.stdout
  assert not root.exists()
  _ok(subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300))
  res = json.load(open(root / "sweep.json"))
  assert [r["name"] for r in res] == ["learning_rate_0.003"]
  assert res[0]["returncode"] == 0 and res[0]["summary"]["sft_steps"] == 2
  assert res[0]["overrides"] == {"sft.learning_rate": "0.003"}
  again = _ok(subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120))
  assert "already finished, skipped" in again


def test_train_problem_stream_excludes_heldout_and_resumes(tmp_path):
  """The non-synthetic RL prompt stream (data.prompts; shipped math500 via ProblemLoader)."""
  from magistral_jax import config as config_lib
  from magistral_jax.data.prompts import TrainProblems, heldout_problems
  c = config_lib.default_config()
  c.data.update(source="math500", data_dir=str(tmp_path), heldout=16)
  heldout = heldout_problems(c)
  ids = {p["id"] for p in heldout}
  assert len(heldout) == 16 and len(ids) == 16
  stream = TrainProblems(c, ids)
  first = [next(stream)["id"] for _ in range(20)]
  state = json.loads(json.dumps(stream.state()))   # as it goes through the checkpoint meta
  rest = [next(stream)["id"] for _ in range(10)]
  assert not ids & set(first + rest) and len(set(first + rest)) == 30
  resumed = TrainProblems(c, ids, state)
  assert [next(resumed)["id"] for _ in range(10)] == rest
  c.data.source = "gsm8k"   # the alias of the shipped gsm8k_test
  assert heldout_problems(c)[0]["source"] == "gsm8k_test"
