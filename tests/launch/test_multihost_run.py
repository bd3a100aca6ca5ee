"""The RL run as 3 JAX processes (launch/local_cluster.py, configs/tiny.py:multihost: trainer =
processes 0-1, FSDP over their 4 devices; generator = process 2), with its faults and resumes:

1. kill -9 the generator process mid-run: the leader says which process was lost, the launcher
   relaunches it (as a cluster's scheduler would), it rejoins with the current weights, and the
   run goes on (tests/pipeline/test_rollouts.py: its groups go to the others, none lost, none
   trained twice);
2. kill -9 trainer process 1: every process stops within a bounded time, the error names the dead
   process, and nothing is left running (no worker, no sandbox);
3. the same command resumes from the last checkpoint and completes: the reward rose over the run
   (the short form of the full run in BENCHMARKS.md "Tiny default run", as test_tiny_learns.py is of
   the one-process run), and the trainer's checkpoint, saved by two processes, restores onto
   another topology (one process, a 2-device mesh).
A killed trainer process without a run: tests/parallel/test_multihost.py.

The task is narrowed as in test_tiny_learns.py so that a short run learns. Not a timing test:
the bounds are generous multiples of the heartbeat timeout (10 s here).
"""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HEARTBEAT_S = 10
BATCHES = 14


def _command(workdir, restart=False):
  return [sys.executable, os.path.join(ROOT, "launch/local_cluster.py"), "--num_processes=3",
          "--devices_per_process=2", "--grace_s=60",
          *(["--restart_processes=2"] if restart else []), "--",
          os.path.join(ROOT, "launch/train.py"), f"--workdir={workdir}",
          f"--config=configs/tiny.py:multihost,sft_steps=50,batches={BATCHES},slip=0,"
          "n_batch=128,n_mini_per_batch=1",
          "--config.optimizer.learning_rate=1e-3", "--config.data.heldout=16",
          "--config.data.max_operand=4", "--config.data.max_steps=2",
          "--config.checkpoint.every=2",
          # Held-out evaluations mid-run: each stages weights while a push's pulls may be out.
          "--config.eval.every=4",
          # A verifier pool per host: the generator process scores its own completions.
          "--config.verifier.placement=generators"]


def _env():
  return dict(os.environ, MAGISTRAL_HEARTBEAT_TIMEOUT_S=str(HEARTBEAT_S))


def _rl_rows(workdir):
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  rows = []
  for line in open(path):
    try:
      row = json.loads(line)
    except ValueError:   # a line being written
      continue
    if "reward" in row:
      rows.append(row)
  return rows


def _process(process_id, session):
  """The pid of the run's process `process_id`, among the processes of the launcher's children."""
  for pid in _pids_of(session):
    try:
      env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
      cmd = open(f"/proc/{pid}/cmdline", "rb").read()
    except OSError:
      continue
    if b"launch/train.py" in cmd and f"MAGISTRAL_PROCESS_ID={process_id}".encode() in env:
      return pid
  return None


def _pids_of(launcher_pid):
  """Every live process whose parent chain reaches the launcher (its children and theirs)."""
  parents = {}
  for d in os.listdir("/proc"):
    if d.isdigit():
      try:
        stat = open(f"/proc/{d}/stat").read()
        parents[int(d)] = int(stat[stat.rindex(")") + 2:].split()[1])
      except (OSError, ValueError):
        continue
  out = []
  for pid in parents:
    p = pid
    while p in parents and p != 1:
      p = parents[p]
      if p == launcher_pid:
        out.append(pid)
        break
  return out


def _alive(pid):
  try:
    state = [l for l in open(f"/proc/{pid}/status") if l.startswith("State:")][0]
    return "Z" not in state
  except (OSError, IndexError):
    return False


def _wait_for_rows(launcher, workdir, n, timeout_s=900):
  deadline = time.time() + timeout_s
  while len(_rl_rows(workdir)) < n:
    assert launcher.poll() is None, launcher.stdout.read()[-5000:]
    assert time.time() < deadline, f"the run did not reach batch {n}"
    time.sleep(1)


def _kill(launcher, process_id):
  pid = _process(process_id, launcher.pid)
  assert pid is not None
  os.kill(pid, signal.SIGKILL)


def _run_kill_generator_then_trainer(workdir):
  """Starts the run (generator process relaunched when it dies), kill -9s the generator once 3
  RL batches are logged, waits for 3 more, then kill -9s trainer process 1; returns (launcher exit
  code, its output, seconds from the second kill to the launcher's exit, the run's process tree
  just before it)."""
  launcher = subprocess.Popen(_command(workdir, restart=True), cwd=ROOT, env=_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  try:
    _wait_for_rows(launcher, workdir, 3)
    _kill(launcher, 2)
    _wait_for_rows(launcher, workdir, 6)
    tree = _pids_of(launcher.pid)
    _kill(launcher, 1)
    t_kill = time.time()
    out, _ = launcher.communicate(timeout=300)
    return launcher.returncode, out, time.time() - t_kill, tree
  finally:
    if launcher.poll() is None:
      launcher.kill()


def _assert_stopped_cleanly(rc, out, took, tree, victim):
  assert rc != 0, out[-5000:]
  assert f"process {victim} exited with code -9 (killed by SIGKILL)" in out, out[-5000:]
  # The survivors stop by themselves: the leader's liveness watch names the dead process (or a
  # collective with it fails first), and the generator loses the service with the leader.
  assert any(m in out for m in (f"trainer process {victim} stopped sending heartbeats", "Gloo",
                                "gloo")), out[-8000:]
  assert took < 6 * HEARTBEAT_S + 60, took
  time.sleep(1)
  assert not [p for p in tree if _alive(p)], "orphans: " + ", ".join(
      open(f"/proc/{p}/cmdline").read().replace("\0", " ")[:120] for p in tree if _alive(p))


@pytest.mark.slow
@pytest.mark.long
def test_three_process_run_survives_kills_resumes_and_learns(tmp_path):
  workdir = str(tmp_path / "run")
  # 1. The generator process dies and comes back; 2. a trainer process dies.
  rc, out, took, tree = _run_kill_generator_then_trainer(workdir)
  assert "process 2 exited with code -9 (killed by SIGKILL); relaunching it (1 of 3)" in out, \
      out[-5000:]
  assert "generator 0 (process 2) lost" in out, out[-5000:]
  assert "generator 0 (process 2) rejoined (incarnation 2) at policy version" in out, out[-5000:]
  _assert_stopped_cleanly(rc, out, took, tree, victim=1)
  # 3. Resume to the end.
  r = subprocess.run(_command(workdir), cwd=ROOT, env=_env(), capture_output=True, text=True,
                     timeout=1200)
  assert r.returncode == 0, r.stdout[-6000:]
  assert "resumed from checkpoint" in r.stdout and "held-out pass@1" in r.stdout, r.stdout[-3000:]
  # Batches redone after a resume are logged again: the last record of each counts.
  by_batch = {int(row["batch"]): row for row in _rl_rows(workdir)}
  assert sorted(by_batch) == list(range(1, BATCHES + 1))
  reward = np.asarray([by_batch[b]["reward"] for b in sorted(by_batch)])
  assert reward[-5:].mean() > reward[:5].mean() + 0.01, reward.round(3)
  summary = json.load(open(os.path.join(workdir, "summary.json")))
  assert summary["batches"] == BATCHES and "heldout_accuracy_after" in summary
  assert summary["heldout_trained_on"] == 0   # the leader's record of what it trained on
  # The mid-run evaluations (eval.every=4) ran, each staging weights between two pushes.
  curve = [json.loads(l) for l in open(os.path.join(workdir, "heldout_curve.jsonl"))]
  assert {4, 8, 12} <= {int(row["batch"]) for row in curve}, curve

  # The checkpoint two processes saved restores in one, on another mesh.
  import jax
  from configs import tiny
  from magistral_jax import config as config_lib
  from magistral_jax.model.loading import load_policy
  from magistral_jax.parallel.sharding import make_mesh
  from magistral_jax.train.checkpointing import RunCheckpointer, abstract_like
  from magistral_jax.train.optimizer import make_optimizer
  from magistral_jax.train.step import init_state
  run = config_lib.validate(tiny.get_config("multihost"))
  _, model_cfg, _ = load_policy(run.model, run.init, run.tokenizer, load_weights=False)
  mesh = make_mesh({"fsdp": 2}, jax.devices()[:2])
  state = init_state(model_cfg, make_optimizer(run.optimizer),
                     jax.random.PRNGKey(1), mesh)
  ckpt = RunCheckpointer(os.path.join(workdir, "checkpoints"))
  step, restored, meta = ckpt.restore_latest(abstract_like(state))
  ckpt.close()
  assert step == summary["optimizer_steps"] and meta["batches"] == BATCHES
  for x in jax.tree.leaves(restored.params):
    assert x.sharding.mesh.devices.size == 2 and bool(np.isfinite(np.asarray(x)).all())


@pytest.mark.slow
def test_three_process_run_with_tool_calls(tmp_path):
  """configs/tiny.py:multihost,tools (issue #67) from a cold start that taught the tiny model to
  call the interpreter: in RL the generator process parks samples for their calls (the real
  sandbox), scores them itself (verifier.placement=generators: graded_text), and ships them with
  their tool masks to the trainer processes, which train with the results out of the loss; the
  held-out evaluation on the generator process calls the tool too. The cold start (60 steps,
  which already leave a policy that calls the tool often) runs on its own, on one device
  (launch/sft.py; the cold start over two processes is the test above's): through gloo it was
  most of this test's time. So the 3-process run also restores weights saved by one process onto
  its FSDP mesh over two."""
  sft, workdir = str(tmp_path / "sft"), str(tmp_path / "run")
  r = subprocess.run([sys.executable, os.path.join(ROOT, "launch/sft.py"), f"--workdir={sft}",
                      "--config=configs/tiny.py:tools,colocated,sft_steps=60"], cwd=ROOT,
                     env=dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1"),
                     capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  cmd = [sys.executable, os.path.join(ROOT, "launch/local_cluster.py"), "--num_processes=3",
         "--devices_per_process=2", "--grace_s=60", "--",
         os.path.join(ROOT, "launch/train.py"), f"--workdir={workdir}",
         "--config=configs/tiny.py:multihost,tools,batches=2", "--config.init.source=orbax",
         f"--config.init.path={sft}/params",
         "--config.data.heldout=8", "--config.eval.k=1", "--config.verifier.placement=generators",
         "--config.pipeline.sample_every=1"]
  r = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=1200)
  assert r.returncode == 0, r.stdout[-6000:]
  rows = _rl_rows(workdir)
  assert [int(row["batch"]) for row in rows] == [1, 2]
  assert sum(row["tool_calls_per_sample"] for row in rows) > 0, rows
  # The generator process's own counts reach the leader's metrics with its completions.
  assert rows[-1]["generator_tool_calls"] > 0 and rows[-1]["tool_result_tokens_mean"] > 0
  assert all(0.0 <= row["void_turn_frac"] <= 1.0 and np.isfinite(row["loss"]) for row in rows)
  shown = [json.loads(l)["text"] for l in open(os.path.join(workdir, "samples.jsonl"))]
  assert any("<result>" in t and "tool calls" in t for t in shown), shown
  after = json.load(open(os.path.join(workdir, "eval_after.json")))
  assert after["tool_calls_mean"] > 0, after
