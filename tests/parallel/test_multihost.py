"""Many hosts, rehearsed as 3 real JAX processes of 2 CPU devices (launch/local_cluster.py):
the weight push across processes (parallel.weight_transfer.WeightTransfer), a generator process's
error reaching the trainer with its traceback (pipeline.remote), and a trainer process killed
with -9: the others stop within a bounded time, leaving no worker process behind. The whole run
across processes, a killed generator and the resume: tests/launch/test_multihost_run.py."""
import io
import os
import time

import pytest

from magistral_jax.parallel.local_cluster import run_cluster

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def _cluster(*args):
  out = io.StringIO()
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
             MAGISTRAL_HEARTBEAT_TIMEOUT_S="10")
  old = dict(os.environ)
  os.environ.update(env)
  try:
    rc = run_cluster([os.path.join(HERE, "multihost_child.py"), *args], num_processes=3,
                     devices_per_process=2, grace_s=30, out=out, handle_signals=False)
  finally:
    os.environ.clear()
    os.environ.update(old)
  return rc, out.getvalue()


def test_push_from_an_fsdp_trainer_on_two_processes_to_a_generator_process():
  rc, out = _cluster("transfer")
  assert rc == 0, out[-5000:]
  assert "[p2] OK: received" in out and "[p0] OK: pushed" in out, out[-5000:]


def test_bulk_channels_move_arrays_between_processes_device_to_device():
  rc, out = _cluster("bulk")
  assert rc == 0, out[-5000:]
  assert "[p0] OK: received both channels" in out, out[-5000:]
  assert "[p1] OK: sent" in out and "[p2] OK: sent" in out, out[-5000:]


def test_a_generator_process_error_reaches_the_trainer_with_its_traceback():
  rc, out = _cluster("generator_raises")
  assert rc != 0, out[-5000:]   # the generator process exits with its error
  line = next((l for l in out.splitlines() if l.startswith("[p0] OK: the leader got:")), None)
  assert line is not None, out[-5000:]
  assert "generator 0 (process 2) lost" in line and "failed" in line, line
  assert "Traceback" in line, line
  assert "boom: the generator could not start" in line and "make_loop" in line, line


@pytest.mark.parametrize("scenario", ["killed_mid_pull", "killed_before_pull"])
def test_a_generator_killed_with_its_completions_unpulled_is_lost_not_waited_for(scenario):
  # Killed while the leader pulls its completions, the pull fails; killed before the leader
  # connects, the pull never completes: the leader's reader checks the generator's heartbeats
  # while it waits (10 s timeout here). Either way the generator is lost, and the run goes on.
  rc, out = _cluster(scenario)
  assert "process 2 exited with code -9 (killed by SIGKILL)" in out, out[-5000:]
  line = next((l for l in out.splitlines() if l.startswith("[p0] OK: the leader lost it")), None)
  assert line is not None, out[-5000:]
  if scenario == "killed_before_pull":
    assert "stopped sending heartbeats" in line, line
  assert float(line.split("after ")[1].split("s:")[0]) < 40, line


def test_a_killed_trainer_process_stops_the_others_and_leaves_no_orphans(tmp_path):
  t = time.time()
  rc, out = _cluster("trainer_killed", str(tmp_path))
  took = time.time() - t
  assert rc != 0 and "process 1 exited with code -9 (killed by SIGKILL)" in out, out[-5000:]
  assert "[p2] OK: received" in out, out[-5000:]
  # Processes 0 and 2 were waiting for messages: process 0's liveness watch stopped it (10 s
  # heartbeat timeout here), naming the dead process; process 2 lost the service with it; all
  # well before the launcher's 30 s grace.
  assert "trainer process 1 stopped sending heartbeats" in out, out[-5000:]
  assert "SIGTERM to the processes still running" not in out, out[-5000:]
  assert took < 90, took
  pids = [int(p) for p in open(tmp_path / "pids").read().split()]
  assert pids   # the generator's verifier pool worker
  time.sleep(1)
  for pid in pids:
    try:
      state = [l for l in open(f"/proc/{pid}/status") if l.startswith("State:")][0]
    except OSError:
      continue   # gone
    assert "Z" in state, f"verifier worker {pid} outlived its process: {state}"


def test_the_layout_of_one_process_and_its_errors():
  import jax
  from configs import tiny
  from magistral_jax import config as config_lib
  from magistral_jax.parallel import multihost

  def devices(arg=None):
    return config_lib.validate(tiny.get_config(arg)).devices
  assert multihost.process_layout(devices()) is None   # one process: split_devices
  with pytest.raises(ValueError, match="many processes, but this is one.*local_cluster"):
    multihost.process_layout(devices("multihost"))
  with pytest.raises(ValueError, match="1 <= trainer_processes < num_processes"):
    multihost.check_process_layout(3, 3)
  with pytest.raises(ValueError, match="generator_process_devices=3: a generator process has 2"):
    multihost.check_process_layout(2, 3, 3, 2)
  # A generator on the first of its process's devices (configs/tiny.py:multihost): here every
  # device is process 0's.
  one = multihost.ProcessLayout(1, 2, (1,), (0,), generator_process_devices=1)
  assert one.generator_devices() == [jax.devices()[:1]]
  assert multihost.ProcessLayout(1, 2, (1,), (0,)).generator_devices() == [jax.devices()]
  layout = multihost.ProcessLayout(2, 4, (0, 1), (2, 3))
  assert layout.role == "generator 0" and not layout.is_trainer and layout.generator_index == 0
  assert multihost.ProcessLayout(0, 4, (0, 1), (2, 3)).role == "trainer leader"
