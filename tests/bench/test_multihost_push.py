"""bench/multihost_push.py and bench/multihost_bulk.py run their processes and report what
BENCHMARKS.md records (tiny model or small sizes, one timed round: smoke tests of the benches,
not measurements)."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_last_line_has_the_push_and_its_baseline():
  r = subprocess.run([sys.executable, os.path.join(ROOT, "bench/multihost_push.py"),
                      "--model=tiny", "--reps=1"], cwd=ROOT, capture_output=True, text=True,
                     timeout=600)
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  out = json.loads(r.stdout.strip().splitlines()[-1])
  for key in ("cross_process_push_s", "local_copy_s", "cross_process_over_local_copy",
              "bytes_pushed", "cross_process_GBps"):
    assert key in out, out
  assert out["cross_process_push_s"] > 0 and out["local_copy_s"] > 0
  assert len(out["rounds_push_s"]) == 2   # the warm-up round and the timed one


def test_the_bulk_bench_reports_both_ways_at_each_size():
  """bench/multihost_bulk.py: BulkChannel against the key-value store (2 processes, small sizes:
  a smoke test of the bench, not a measurement)."""
  r = subprocess.run([sys.executable, os.path.join(ROOT, "bench/multihost_bulk.py"),
                      "--sizes=0.25,1", "--reps=1"], cwd=ROOT, capture_output=True, text=True,
                     timeout=600)
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  out = json.loads(r.stdout.strip().splitlines()[-1])
  assert out["sizes_mb"] == [0.25, 1.0]
  for key in ("bulk_MBps", "kv_MBps", "ratio_per_size"):
    assert len(out[key]) == 2 and all(x > 0 for x in out[key]), (key, out)
  assert out["bulk_over_kv_throughput"] > 0 and "goal_met" in out
