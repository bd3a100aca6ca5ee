"""launch/filter_data.py end to end on a shipped set (format filter: no model needed)."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_filter_data_format_filter_on_math500(tmp_path):
  r = subprocess.run([sys.executable, os.path.join(ROOT, "launch/filter_data.py"),
                      "--shipped=math500", "--filters=format", f"--data_dir={tmp_path}/tfds",
                      f"--out_dir={tmp_path}/out"], cwd=ROOT, capture_output=True, text=True,
                     timeout=600)
  assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
  out = tmp_path / "out"
  report = json.load(open(out / "math500.report.json"))
  assert report["read"]["rows_read"] == 500
  assert report["format"]["kept"] == 499 and report["kept"] == 499
  assert report["format"]["dropped"] == {"multiple_choice_unstatable": 1}
  assert report["format"]["rewritten"] == {"multiple_choice": 2}
  rows = [json.loads(l) for l in open(out / "math500.jsonl")]
  assert len(rows) == 499 and all(r["answer"] for r in rows)
  assert os.path.isdir(report["dataset"])   # the filtered TFDS dataset was built


def test_filter_data_takes_the_run_config_and_rejects_a_bad_one(tmp_path):
  base = [sys.executable, os.path.join(ROOT, "launch/filter_data.py"), "--shipped=math500",
          "--filters=format", f"--data_dir={tmp_path}/tfds", f"--out_dir={tmp_path}/out"]
  r = subprocess.run(base + ["--config=configs/tiny.py", "--config.rl.n_mini=7"], cwd=ROOT,
                     capture_output=True, text=True, timeout=600)
  assert r.returncode != 0 and "n_mini=7" in r.stdout + r.stderr
  assert not os.path.exists(tmp_path / "out" / "math500.jsonl")   # rejected before any work
  r = subprocess.run(base + ["--config=configs/tiny.py"], cwd=ROOT, capture_output=True,
                     text=True, timeout=600)
  assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
  assert json.load(open(tmp_path / "out" / "math500.report.json"))["kept"] == 499


def test_convert_checkpoint_casts_to_the_run_configs_param_dtype(tmp_path):
  import jax
  import jax.numpy as jnp
  from magistral_jax.model.hf_checkpoint import save_hf_safetensors
  from magistral_jax.model.orbax_params import restore_params_orbax
  from magistral_jax.model import transformer as T
  from magistral_jax.model.config import ModelConfig
  cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=8)
  save_hf_safetensors(jax.device_get(T.init_params(cfg, jax.random.PRNGKey(0))), cfg,
                      str(tmp_path / "hf"))
  r = subprocess.run([sys.executable, os.path.join(ROOT, "launch/convert_checkpoint.py"),
                      "--direction=hf_to_orbax",
                      f"--input={tmp_path}/hf", f"--output={tmp_path}/orbax",
                      "--config=configs/tiny.py", "--config.model.param_dtype=bfloat16"],
                     cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
  assert '"param_dtype": "bfloat16"' in r.stdout
  params = restore_params_orbax(str(tmp_path / "orbax" / "params"))
  assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype("bfloat16")}
