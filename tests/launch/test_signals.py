"""Ctrl-C on a running RL job: a clean shutdown, no orphan processes (generators, verifier pool)."""
import os
import signal
import subprocess
import sys
import time

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_ctrl_c_mid_run_shuts_down_cleanly(tmp_path):
  # No warm start: the random policy never fills a batch, so the pipeline stays busy until the
  # signal. Its stall check is off, or 256 dropped groups in a row would stop the run first (on
  # a warm compilation cache they are reached within seconds of the stage's start).
  cmd = [sys.executable, os.path.join(ROOT, "launch/train.py"),
         "--config=configs/tiny.py:batches=50,sft_steps=0", "--config.data.heldout=4",
         "--config.pipeline.max_consecutive_dropped=0", f"--workdir={tmp_path}"]
  proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  lines, deadline = [], time.time() + 400
  try:
    for line in proc.stdout:
      lines.append(line)
      if "stage 1/1" in line or time.time() > deadline:
        break
    assert any("stage 1/1" in l for l in lines), "".join(lines[-30:])
    time.sleep(5)   # let generators and the verifier pool get busy
    children = psutil.Process(proc.pid).children(recursive=True)
    assert children, "the verifier pool should have worker processes"
    proc.send_signal(signal.SIGINT)
    try:
      rest, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
      proc.kill()
      rest, _ = proc.communicate()
      raise AssertionError("no exit within 120 s of SIGINT; the run's last output:\n"
                           + rest[-6000:]) from None
  finally:
    if proc.poll() is None:
      proc.kill()
  out = "".join(lines) + rest
  assert proc.returncode != 0 and "KeyboardInterrupt" in out
  gone, alive = psutil.wait_procs(children, timeout=15)
  assert not alive, f"orphans left: {[p.pid for p in alive]}"
  # The checkpoint written on the way out is restorable by the next run.
  assert any(d.isdigit() for d in os.listdir(tmp_path / "checkpoints"))
