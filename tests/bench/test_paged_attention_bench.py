"""bench/paged_attention.py runs as a script on tiny shapes (the GPU mode's code path too, its
kernel left out on CPU) and its last line holds what BENCHMARKS.md reads: the paged path checked
against dense inside the bench, its bytes read close to the live lengths, dense's far above."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_last_line_has_both_paths_and_the_read_ratios():
  r = subprocess.run([sys.executable, "bench/paged_attention.py", "--slots=8,3", "--cache=512",
                      "--page_size=16", "--q_heads=4", "--kv_heads=2", "--head_dim=16",
                      "--repeats=1"], cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  out = json.loads(r.stdout.strip().splitlines()[-1])
  assert out["bench"] == "paged_attention" and len(out["runs"]) == 2
  many, tail = out["runs"]
  assert many["ragged"]["kv_read_over_live"] < 1.5 < many["dense"]["kv_read_over_live"]
  assert many["ragged"]["max_abs_err"] < 1e-3 and many["in_flight_ratio"] > 1
  assert tail["live_fraction"] == 1.0          # a run of <= 4 slots is the long tail
  assert tail["dense"]["kv_read_over_live"] == 1.0
  for run in out["runs"]:
    assert run["paged_over_dense_step"] > 0 and run["best_paged"] == "ragged"


def test_the_gpu_mode_rehearses_on_cpu_with_jax_s_kernel_interpreted():
  r = subprocess.run([sys.executable, "bench/paged_attention.py", "--gpu", "--slots=4",
                      "--cache=64", "--page_size=16", "--copy_mb=8", "--repeats=1",
                      "--q_heads=4", "--kv_heads=2", "--head_dim=16", "--dtype=float32"],
                     cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  (run,) = json.loads(r.stdout.strip().splitlines()[-1])["runs"]
  assert run["pallas_gpu"]["max_abs_err"] < 1e-3 and "of_copy_bandwidth" in run["pallas_gpu"]
  assert run["pallas_gpu"]["kv_read_over_live"] == 1.0


def test_the_engine_level_bench_runs_the_loop_on_both_caches():
  """bench/paged_decode.py on tiny lengths, more requests than the dense slots: the same samples,
  the paged steps reading close to the live positions and dense far above, more in flight."""
  r = subprocess.run([sys.executable, "bench/paged_decode.py", "--requests=16", "--cache=256",
                      "--prompt_mean=40", "--new_mean=12", "--layers=1", "--dense_slots=4",
                      "--paged_slots=8"], cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  out = json.loads(r.stdout.strip().splitlines()[-1])
  assert out["bench"] == "paged_decode" and out["same_samples"] == 1.0
  assert out["dense"]["tokens"] == out["paged"]["tokens"] > 0
  # (the ragged loop reads whole chunks of pages: on these tiny lengths, about one)
  assert out["kv_read_over_live"] < out["dense"]["kv_read_over_live"] / 2
  assert out["in_flight_ratio"] > 1.0 and out["preempted_frac"] <= 1.0   # 8 slots' against 4
  assert out["paged_read_per_token_over_dense"] < 0.5
  assert out["paged_over_dense_tokens_per_s"] > 0
