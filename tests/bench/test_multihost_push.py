"""bench/multihost_push.py runs its 3 processes and reports what BENCHMARKS.md records (tiny
model, one timed round: a smoke test of the bench, not a measurement)."""
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
