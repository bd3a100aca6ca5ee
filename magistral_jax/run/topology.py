"""Where an RL run's parts live: one process, or many (leader and followers). run/train.py's RLRun
is the paper's loop; a topology gives it the stage's generators, the stage's RolloutSource, the
held-out evaluation and the end of the run, so the loop never asks how many processes there are.

One process: the trainer and the generators on this process's devices (parallel/layout.py), the
verifier pool here. Many processes (`devices.trainer_processes`): the trainer processes train
(SPMD); the leader among them runs the pipeline, drives each generator process through a
RemoteGenerator (pipeline/remote.py) and sends each batch on to the other trainer processes
(pipeline/trainer_rollouts.py); every other process serves one generator
(run/generator_process.py). Weights for the generator processes (stage starts, pushes,
evaluations) are staged on every trainer process, as one program, and offered by the leader.
"""
from __future__ import annotations

import logging

import jax

from magistral_jax.eval.in_run import eval_loop_factory, run_eval
from magistral_jax.parallel import liveness, multihost
from magistral_jax.parallel.layout import run_devices
from magistral_jax.parallel.sharding import make_mesh
from magistral_jax.pipeline.generators import engine_for, make_generators, tool_turns_for
from magistral_jax.pipeline.remote import (GeneratorLost, RemoteGenerator, remote_eval,
                                           weight_transfer)
from magistral_jax.pipeline.rollouts import Rollouts
from magistral_jax.pipeline.trainer_rollouts import FollowerRollouts, LeaderRollouts
from magistral_jax.train.step import batch_sharding

log = logging.getLogger("train")


def topology_for(run):
  """The run's topology, from its config (parallel/multihost.process_layout), with every config
  error it can find raised before any work."""
  layout = multihost.process_layout(run.devices)
  return OneProcess(run) if layout is None else ManyProcesses(run, layout)


class OneProcess:
  """The trainer, the generators, the pool and the evaluation in this process."""
  leader = True             # writes the run's files and runs the pipeline
  is_trainer = True
  trainer_processes = None  # the checkpointer's: this process alone

  def __init__(self, run):
    run.devices.check_layout(jax.device_count())   # device counts before any work
    if run.verifier.placement != "leader":
      raise ValueError(f"verifier.placement={run.verifier.placement!r} scores on the generator "
                       "processes of a many-host run; this run is one process (use leader)")
    self.run = run
    self.tdev, self.gdevs = run_devices(run.devices)
    self.scores_on_leader = True

  def start(self, tmesh, model_cfg, tok, system_prompt, shared_prefix) -> None:
    """The evaluation's generator loop, on the first generator slice. `engines`
    (generators.engine_for): the evaluation and every stage share an engine."""
    self.model_cfg, self.tok = model_cfg, tok
    self.system_prompt, self.shared_prefix = system_prompt, shared_prefix
    self.engines = {}
    self.eval_loop = eval_loop_factory(self.run, model_cfg, self.gdevs[0], tok, shared_prefix,
                                       self.engines)

  def guard(self, pool) -> None:
    """Nothing to do: the pool closes with the run (RLRun.close)."""

  def generators(self, stage, sampling, engine_cfg, params, version: int) -> list:
    """Local generator loops on this process's generator slices. Colocated: they load the
    trainer's params where they are (same devices, no host round trip)."""
    srun = stage.run
    params = params if srun.colocated else jax.device_get(params)
    return make_generators(self.model_cfg, params, self.gdevs, sampling, engine_cfg,
                           mesh_shape=srun.devices.generator_mesh, version=version,
                           seed=self.run.seed + stage.index,
                           rules=srun.sharding.generator_rules,
                           shared_prefix=self.shared_prefix, engines=self.engines,
                           tools=tool_turns_for(srun.tools, self.tok))

  def rollouts(self, stage, prompts, tmesh, **kw):
    return Rollouts(prompts=prompts, colocated=stage.run.colocated, **kw)

  def evaluate(self, params, tag: str, version: int, heldout, pool):
    return run_eval(self.eval_loop, pool, self.tok, heldout, self.run, self.system_prompt,
                    jax.device_get(params), tag)

  def end(self, finished: bool) -> None:
    """Before the run's resources close: nothing to tell anyone."""

  def leave(self, finished: bool) -> None:
    """After: nothing to wait for."""


class ManyProcesses:
  """This process's part of a many-process run (see the module docstring)."""

  def __init__(self, run, layout):
    self.run, self.layout = run, layout
    self.leader, self.is_trainer = layout.is_leader, layout.is_trainer
    self.trainer_processes = layout.trainer_processes
    self.tdev, self.gdevs = layout.trainer_devices(), layout.generator_devices()
    # The leader's pool scores the completions, unless the generator processes do.
    self.scores_on_leader = run.verifier.placement == "leader"
    self.remote_gens: list = []

  def start(self, tmesh, model_cfg, tok, system_prompt, shared_prefix) -> None:
    """The trainer processes watch each other, share a mailbox and a weight transfer; the leader
    connects to every generator process, which it drives for the whole run."""
    layout, run = self.layout, self.run
    log.info("process %d of %d: %s | trainer processes %s | generator processes %s",
             layout.process_id, layout.num_processes, layout.role, layout.trainer_processes,
             layout.generator_processes)
    self.model_cfg = model_cfg
    timeout = multihost.heartbeat_timeout_s()
    liveness.stop_on_dead_trainers(multihost.watch(), layout.trainer_processes,
                                   layout.process_id, timeout)
    self.mailbox = multihost.Mailbox("run")
    self.transfer = weight_transfer(model_cfg, make_mesh(run.devices.generator_mesh,
                                                         self.gdevs[0]),
                                    run.sharding.generator_rules, list(tmesh.devices.flat))
    if self.leader:
      self.remote_gens = [RemoteGenerator(self.mailbox, g, p, self.transfer, multihost.watch(),
                                          timeout).connect()
                          for g, p in enumerate(layout.generator_processes)]

  def guard(self, pool) -> None:
    """A fatal stop (a dead trainer process) closes the pool too."""
    liveness.at_fatal_exit(pool.close)

  def generators(self, stage, sampling, engine_cfg, params, version: int) -> list:
    """The leader's handles to the generator processes, which start the stage on the trainer's
    weights (staged on every trainer process; a generator rejoining meanwhile gets them)."""
    srun, si = stage.run, stage.index
    with self.transfer.lock:
      self.transfer.stage(params, version)
      for g, devs in zip(self.remote_gens, self.gdevs):
        g.begin_stage(si, engine_for(self.model_cfg, devs, sampling, engine_cfg,
                                     mesh_shape=srun.devices.generator_mesh,
                                     rules=srun.sharding.generator_rules))
    for g in self.remote_gens:
      try:
        if g.serving:
          g.wait_for(("stage", si), f"the start of stage {si}")
      except GeneratorLost as e:
        log.warning("%s", e)
    return self.remote_gens

  def rollouts(self, stage, prompts, tmesh, **kw):
    """The leader's RolloutSource sends each batch on to the other trainer processes; theirs
    receive it."""
    srun = stage.run
    if self.leader:
      return LeaderRollouts(mailbox=self.mailbox, transfer=self.transfer,
                            follower_processes=self.layout.trainer_processes[1:],
                            batch_sharding=batch_sharding(tmesh, srun.sharding.trainer_rules),
                            stage=stage.index, prompts=prompts, **kw)
    me = self.layout.process_id
    return FollowerRollouts(mailbox=self.mailbox, process=me,
                            follower=self.layout.trainer_processes.index(me) - 1,
                            stage=stage.index, transfer=self.transfer,
                            batch_timeout_s=srun.pipeline.batch_timeout_s)

  def evaluate(self, params, tag: str, version: int, heldout, pool):
    """On the generator processes; the result on the leader, None on the other trainers."""
    return remote_eval(self.layout, self.remote_gens, self.transfer, params, version, tag,
                       heldout, wait_s=self.run.pipeline.generator_rejoin_s)

  def end(self, finished: bool) -> None:
    """Every process ends with the leader: it tells the generator processes and the other
    trainer processes, which wait for it once their own work is done (their exit would otherwise
    wait at jax.distributed's shutdown barrier for as long as the final evaluation takes). After
    an exception they do not wait: the coordination service stops the rest."""
    if self.leader:
      for g in self.remote_gens:
        g.close()
      for p in self.layout.trainer_processes[1:]:
        try:
          self.mailbox.send(f"trainer{p}/end", ("exit",))
        except Exception as e:
          log.warning("could not end trainer process %d: %s", p, e)
    elif finished:
      self.mailbox.receive(f"trainer{self.layout.process_id}/end", 7 * 24 * 3600,
                           what="the trainer leader's end of the run")

  def leave(self, finished: bool) -> None:
    if self.leader:   # the coordination service lives in this process
      multihost.wait_for_others_to_leave(60)
    elif finished:
      multihost.leave()
