"""Many hosts, rehearsed as 3 real JAX processes of 2 CPU devices (launch/local_cluster.py):
the weight push across processes (parallel.multihost.WeightTransfer) and a generator process's
error reaching the trainer with its traceback (pipeline.remote). The whole run across processes,
its faults and its resume: tests/launch/test_multihost_run.py."""
import io
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "launch"))
from local_cluster import run_cluster  # noqa: E402


def _cluster(scenario):
  out = io.StringIO()
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
             MAGISTRAL_HEARTBEAT_TIMEOUT_S="10")
  old = dict(os.environ)
  os.environ.update(env)
  try:
    rc = run_cluster([os.path.join(HERE, "multihost_child.py"), scenario], num_processes=3,
                     devices_per_process=2, grace_s=30, out=out, handle_signals=False)
  finally:
    os.environ.clear()
    os.environ.update(old)
  return rc, out.getvalue()


def test_push_from_an_fsdp_trainer_on_two_processes_to_a_generator_process():
  rc, out = _cluster("transfer")
  assert rc == 0, out[-5000:]
  assert "[p2] OK: received" in out and "[p0] OK: pushed" in out, out[-5000:]


def test_a_generator_process_error_reaches_the_trainer_with_its_traceback():
  rc, out = _cluster("generator_raises")
  assert rc != 0, out[-5000:]   # the generator process exits with its error
  line = next((l for l in out.splitlines() if l.startswith("[p0] OK: the leader got:")), None)
  assert line is not None, out[-5000:]
  assert "generator 0 (process 2) failed" in line and "Traceback" in line, line
  assert "boom: the generator could not start" in line and "make_loop" in line, line
