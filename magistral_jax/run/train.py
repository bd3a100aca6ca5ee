"""The RL run (launch/train.py): reads top to bottom like the run.

Devices and meshes, tokenizer and policy, (cold-start SFT), held-out evaluation, then for each
stage the RL loop (train/rl_loop.py: batches of scored groups from a RolloutSource ->
minibatches -> optimizer steps -> weight pushes to the generators), checkpoints, and a final
evaluation. A run resumes from the latest checkpoint in its workdir.

Many hosts (TPU pods, GPU clusters): one process per host, with a config that gives them roles
(`devices.trainer_processes`): the trainer processes train (SPMD) and the leader among them runs
the pipeline; each other process serves one generator (run/generator_process.py). See README.md
("Many hosts").
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import time

import jax
import ml_collections as mlc

from magistral_jax import config as config_lib
from magistral_jax.data import synthetic
from magistral_jax.data.prompts import (check_heldout_unseen, heldout_problems,
                                        system_prompt_for, train_prompts)
from magistral_jax.data.splits import HeldOutOverlapError, normalise_text, problem_key
from magistral_jax.data.trained_on import trained_on_for
from magistral_jax.model.loading import load_policy
from magistral_jax.parallel import multihost
from magistral_jax.parallel.layout import run_devices
from magistral_jax.parallel.sharding import make_mesh
from magistral_jax.pipeline.generators import make_generators, shared_prefix_for
from magistral_jax.pipeline.rollouts import Rollouts
from magistral_jax.eval.in_run import eval_loop_factory, run_eval, write_eval
from magistral_jax.run.generator_process import run_generator_process
from magistral_jax.run.stages import Stage, stages as stage_list, training_sampling
from magistral_jax.train.checkpointing import RunCheckpointer, abstract_like
from magistral_jax.train.metrics_writer import MetricsWriter, Progress
from magistral_jax.train.optimizer import learning_rate_schedule, make_optimizer
from magistral_jax.train.rl_loop import Trainer, train
from magistral_jax.train.sft import make_sft_step, sft_warm_start
from magistral_jax.train.step import batch_sharding, init_state, make_grpo_step
from magistral_jax.verify.pool import VerifierPool

log = logging.getLogger("train")


def main(config: mlc.ConfigDict, workdir: str) -> None:
  """The whole run, in this process's role: a generator process serves until the leader ends
  the run; a trainer process trains (the leader also runs the pipeline and writes the files)."""
  run = config_lib.validate(config)
  layout = multihost.process_layout(run.devices)   # None: one process
  if layout is None:   # every config error before any work, device counts included
    run.devices.check_layout(jax.device_count())
    if run.verifier.placement != "leader":
      raise ValueError(f"verifier.placement={run.verifier.placement!r} scores on the generator "
                       "processes of a many-host run; this run is one process (use leader)")
  stages = stage_list(config, run)
  if layout is None or layout.is_leader:
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "config.json"), "w") as f:
      f.write(config.to_json(indent=1))
  mesh = None   # a trainer's params load straight onto its mesh (generator processes load none)
  if layout is None:
    tdev, gdevs = run_devices(run.devices)
  else:
    tdev, gdevs = layout.trainer_devices(), layout.generator_devices()
  if layout is None or layout.is_trainer:
    mesh = make_mesh(run.devices.trainer_mesh, tdev)
  tok, model_cfg, init_params = load_policy(
      run.model, run.init, run.tokenizer, load_weights=mesh is not None, mesh=mesh,
      rules=run.sharding.trainer_rules)
  system_prompt = system_prompt_for(run.system_prompt)
  shared_prefix = shared_prefix_for(run.engine, tok, system_prompt)
  if layout is not None and not layout.is_trainer:
    return run_generator_process(run, stages, layout, tok, model_cfg, system_prompt,
                                 shared_prefix)
  rl = RLRun(run, stages, layout, workdir, mesh, gdevs, tok, model_cfg, init_params,
             system_prompt, shared_prefix)
  del init_params   # the train state holds the weights now; no second copy for the whole run
  try:
    rl.train()
  finally:
    rl.close()


class RLRun:
  """A trainer process's run: the train state and its checkpoints, the verifier pool, the
  evaluation, and (on the leader) the metrics and summary files. See the module docstring."""

  def __init__(self, run, stages: list[Stage], layout, workdir, tmesh, gdevs, tok, model_cfg,
               init_params, system_prompt, shared_prefix):
    self.run, self.stages, self.layout, self.workdir = run, stages, layout, workdir
    self.tok, self.model_cfg = tok, model_cfg
    self.system_prompt, self.shared_prefix = system_prompt, shared_prefix
    self.t_start = time.time()
    self.leader = layout is None or layout.is_leader   # writes the run's files, runs the pipeline
    self.writer = MetricsWriter(workdir) if self.leader else None
    log.info("shared prompt prefix: %s", f"{len(shared_prefix)} tokens, prefilled once per "
             "weights version" if shared_prefix else "off")
    self.tmesh, self.gdevs = tmesh, gdevs   # the trainer's mesh (its params are on it already)
    self.tdev = list(tmesh.devices.flat)
    log.info("model %.2fM params | trainer %s | generators %s", model_cfg.num_params() / 1e6,
             dict(self.tmesh.shape), f"colocated on the trainer's {len(self.tdev)} device(s), "
             f"{'taking turns' if run.pipeline.mode == 'sync' else 'one batch ahead'}"
             if run.colocated else [len(g) for g in self.gdevs])
    if layout is not None:
      log.info("process %d of %d: %s | trainer processes %s | generator processes %s",
               layout.process_id, layout.num_processes, layout.role, layout.trainer_processes,
               layout.generator_processes)
    self.rl_tx = make_optimizer(run.optimizer)
    self.state = init_state(model_cfg, self.rl_tx, jax.random.PRNGKey(run.seed), self.tmesh,
                            run.sharding.trainer_rules, params=init_params)
    ck = run.checkpoint
    self.ckpt = RunCheckpointer(os.path.join(workdir, "checkpoints"), keep=ck.keep,
                                keep_every=ck.keep_every, async_save=ck.async_save,
                                processes=layout and layout.trainer_processes)
    self.restored = self.ckpt.restore_latest(abstract_like(self.state))
    self.meta = {"stage": 0, "batch_in_stage": 0, "batches": 0, "version": 0, "opt_steps": 0,
                 "data": {"consumed": 0}, "rng": None}
    if self.restored is not None:
      step, self.state, self.meta = self.restored
      log.info("resumed from checkpoint %d (stage %d, batch %d, policy version %d)", step,
               self.meta["stage"], self.meta["batch_in_stage"], self.meta["version"])
    # Wall time accumulates across resumes: each checkpoint records the run's time up to it
    # (work after the last checkpoint of an interrupted process is redone, and counted once).
    self.wall0 = float(self.meta.get("wall_time_s", 0.0))
    # Many processes: the generator processes get weights (stage starts, pushes, evaluations)
    # staged on every trainer process (one program) and offered by the leader, which drives each
    # generator process through a RemoteGenerator for the whole run (pipeline/remote.py).
    self.mailbox = self.transfer = None
    self.remote_gens: list = []
    if layout is not None:
      from magistral_jax.parallel import liveness
      from magistral_jax.pipeline.remote import RemoteGenerator, weight_transfer
      timeout = multihost.heartbeat_timeout_s()
      liveness.stop_on_dead_trainers(multihost.watch(), layout.trainer_processes,
                                     layout.process_id, timeout)
      self.mailbox = multihost.Mailbox("run")
      self.transfer = weight_transfer(model_cfg, make_mesh(run.devices.generator_mesh,
                                                           self.gdevs[0]),
                                      run.sharding.generator_rules, self.tdev)
      if self.leader:
        self.remote_gens = [RemoteGenerator(self.mailbox, g, p, self.transfer, multihost.watch(),
                                            timeout).connect()
                            for g, p in enumerate(layout.generator_processes)]
    # The leader's pool scores the completions, unless the generator processes do.
    scores_here = layout is None or run.verifier.placement == "leader"
    self.pool = (VerifierPool.from_config(run.verifier, run.reward)
                 if self.leader and scores_here else None)
    if self.pool is not None and layout is not None:   # a fatal stop closes it too
      from magistral_jax.parallel import liveness
      liveness.at_fatal_exit(self.pool.close)
    self.engines = {}   # generators.engine_for: the evaluation and every stage share an engine
    self.eval_loop = (eval_loop_factory(run, model_cfg, self.gdevs[0], tok, shared_prefix,
                                        self.engines) if layout is None else None)
    self.heldout = heldout_problems(run, workdir) if self.leader else []
    # What the run trains on, recorded as it is drawn (with its cold start's, when that ran on its
    # own): every evaluation counts its problems against it and must find none.
    self.trained = trained_on_for(run, workdir) if self.leader else None
    if self.leader:   # no evaluation may include a problem the RL stream trains on
      check_heldout_unseen(run, self.heldout, workdir)
      self.heldout_keys = [problem_key(p) for p in self.heldout]
      self.trained.watch(self.heldout_keys)
    self.summary_path = os.path.join(workdir, "summary.json")
    self.summary = (json.load(open(self.summary_path))
                    if self.leader and os.path.exists(self.summary_path) else {})
    self.finished = False   # the run's work ended without an exception (in this process)

  def elapsed(self) -> float:
    return self.wall0 + time.time() - self.t_start

  def save_checkpoint(self, step: int, train_state, force: bool = False) -> None:
    self.meta["wall_time_s"] = self.elapsed()
    if self.trained is not None:
      self.trained.save()
    self.ckpt.save(step, train_state, dict(self.meta), force=force)

  def write_summary(self, **values) -> None:
    self.summary.update(values)
    with open(self.summary_path, "w") as f:
      json.dump(self.summary, f, indent=1)

  def evaluate(self, params, tag: str, batch: int):
    """Held-out pass@1 etc. of `params` (None on trainer processes other than the leader),
    written by the leader (eval/in_run.py write_eval)."""
    if self.layout is None:
      res = run_eval(self.eval_loop, self.pool, self.tok, self.heldout, self.run,
                     self.system_prompt, jax.device_get(params), tag)
    else:
      from magistral_jax.pipeline.remote import remote_eval
      res = remote_eval(self.layout, self.remote_gens, self.transfer, params, self.meta["version"],
                        tag, self.heldout, wait_s=self.run.pipeline.generator_rejoin_s)
    if self.leader and res is not None:
      res["heldout_trained_on"] = self.trained.count(self.heldout_keys)
      write_eval(self.workdir, tag, batch, res, self.run.eval.k)
      self.trained.check(self.heldout_keys, f"the held-out set (evaluation {tag!r})")
    return res

  # ---- the run ----------------------------------------------------------------------------
  def train(self) -> None:
    if self.restored is None:
      self.cold_start()
    total = sum(s.num_batches for s in self.stages)
    progress = Progress(total, self.meta["batches"])
    stop_at = self.run.stop_after_batches
    stopped = False
    for stage in self.stages[self.meta["stage"]:]:
      n_batches = stage.num_batches - self.meta["batch_in_stage"]
      if stop_at and stop_at - self.meta["batches"] < n_batches:   # stop_after_batches
        n_batches, stopped = max(0, stop_at - self.meta["batches"]), True
        if n_batches == 0:
          break
      self.train_stage(stage, n_batches, progress, total)
      if stopped:
        break
      self.meta.update(stage=stage.index + 1, batch_in_stage=0)
    if stopped:
      log.info("stopping after %d batches (stop_after_batches=%d): checkpoint %d, stage %d, "
               "batch %d of it; relaunch on this workdir to resume", self.meta["batches"],
               stop_at, self.meta["opt_steps"], self.meta["stage"] + 1,
               self.meta["batch_in_stage"])
      self.finished = True
      return
    res = self.evaluate(self.state.params, "after", self.meta["batches"])
    self.finished = True
    if self.leader:
      self.report(res)

  def cold_start(self) -> None:
    """A fresh run: cold-start SFT from random init (sft.num_steps > 0), the evaluation of the
    initial weights (unless eval.before is False: a control run from the same weights as the
    run it controls) and checkpoint 0."""
    run, rules = self.run, self.run.sharding.trainer_rules
    if run.sft.num_steps > 0 and run.init.source == "random":
      log.info("cold-start SFT: %d steps", run.sft.num_steps)
      sft_tx = make_optimizer(run.sft.optimizer())
      sft_state = init_state(self.model_cfg, sft_tx, jax.random.PRNGKey(run.seed), self.tmesh,
                             rules, params=self.state.params)
      pairs = synthetic.sft_pairs_for(run.data, run.seed)
      if self.trained is not None:
        pairs = self.trained.tracked(pairs, lambda pair: ("", normalise_text(pair[0])))
      sft_state, _ = sft_warm_start(
          sft_state, make_sft_step(self.model_cfg, sft_tx, self.tmesh, rules), self.tok,
          pairs, run.sft,
          system_prompt=self.system_prompt, mesh=self.tmesh, writer=self.writer, log_every=25)
      self.state = init_state(self.model_cfg, self.rl_tx, jax.random.PRNGKey(run.seed),
                              self.tmesh, rules, params=sft_state.params)
      del sft_state
    if run.eval.before:
      res = self.evaluate(self.state.params, "before", 0)
      if self.leader:
        self.write_summary(heldout_accuracy_before=res["pass@1"],
                           format_rate_before=res["format_rate"],
                           heldout_problems=len(self.heldout),
                           heldout_trained_on=res["heldout_trained_on"])
    self.save_checkpoint(0, self.state, force=True)

  def train_stage(self, stage: Stage, n_batches: int, progress: Progress, total: int) -> None:
    srun, si, meta = stage.run, stage.index, self.meta
    log.info("stage %d/%d %r: %d batches, n_batch=%d n_mini=%d G=%d l_max=%d", si + 1,
             len(self.stages), stage.name, n_batches, srun.rl.n_batch, srun.rl.n_mini,
             srun.rl.group_size, srun.reward.l_max)
    sampling = training_sampling(srun, self.tok.eos_id)
    rules = srun.sharding.trainer_rules
    step_fn = make_grpo_step(self.model_cfg, srun.rl, self.rl_tx, self.tmesh, rules,
                             temperature=sampling.temperature,
                             lr_schedule=learning_rate_schedule(srun.optimizer))
    gens = self.stage_generators(stage, sampling)
    trainer = Trainer(step_fn, self.state, self.tmesh, rules, version=meta["version"],
                      opt_steps=meta["opt_steps"], batches=meta["batches"])
    prompts = train_prompts(self.run, self.heldout, meta["data"], self.workdir,
                            trained=self.trained) if self.leader else None
    rollouts = self.rollouts(stage, gens, prompts)
    every = self.run.eval.every   # 0: no held-out evaluation between before and after

    def on_batch(trainer, m):
      meta.update(stage=si, batch_in_stage=meta["batch_in_stage"] + 1, batches=trainer.batches,
                  version=trainer.version, opt_steps=trainer.opt_steps,
                  data=prompts.state() if prompts is not None else meta["data"])
      if self.leader:
        log.info(progress.line(meta["batches"], m))
        if self.trained.hits:   # the rule broken: stop at once, not after the whole run
          self.trained.save()
          raise HeldOutOverlapError(
              f"the RL stream drew {len(self.trained.hits)} held-out problem(s) "
              f"({', '.join(sorted(self.trained.hits)[:5])}) by batch {meta['batches']}; no "
              "evaluation may include a problem the run trained on")
      if meta["batches"] % self.run.checkpoint.every == 0:
        self.save_checkpoint(trainer.opt_steps, trainer.state)
      if every and meta["batches"] % every == 0 and meta["batches"] < total:
        self.evaluate(trainer.state.params, f"batch{meta['batches']}", meta["batches"])

    try:
      with rollouts:
        train(trainer, rollouts, srun.rl, n_batches, seed=self.run.seed + si, writer=self.writer,
              sample_every=srun.pipeline.sample_every, on_batch=on_batch)
    finally:
      self.state = trainer.state
      self.ckpt.wait()
      if meta["opt_steps"] not in self.ckpt.steps():
        self.save_checkpoint(meta["opt_steps"], self.state, force=True)
      self.ckpt.wait()

  def stage_generators(self, stage: Stage, sampling) -> list:
    """The stage's generators: local loops on this process's generator slices, or (many
    processes, on the leader) handles to the generator processes, which start the stage on the
    trainer's weights."""
    srun, si, version = stage.run, stage.index, self.meta["version"]
    rules, mesh_shape = srun.sharding.generator_rules, srun.devices.generator_mesh
    engine_cfg = srun.engine
    if srun.colocated and srun.pipeline.mode == "sync":
      # Colocated and taking turns: the generator is stepped in this thread between train
      # phases, with no background prefill thread.
      engine_cfg = dataclasses.replace(engine_cfg, background_prefill=False)
    if self.layout is None:
      # Colocated: the generator loads the trainer's params where they are (same devices, no
      # host round trip).
      params = self.state.params if srun.colocated else jax.device_get(self.state.params)
      return make_generators(self.model_cfg, params, self.gdevs, sampling, engine_cfg,
                             mesh_shape=mesh_shape, version=version, seed=self.run.seed + si,
                             rules=rules, shared_prefix=self.shared_prefix, engines=self.engines)
    from magistral_jax.pipeline.generators import engine_for
    from magistral_jax.pipeline.remote import GeneratorLost
    with self.transfer.lock:   # a generator rejoining meanwhile gets these weights
      self.transfer.stage(self.state.params, version)
      for g, devs in zip(self.remote_gens, self.gdevs):
        g.begin_stage(si, engine_for(self.model_cfg, devs, sampling, engine_cfg,
                                     mesh_shape=mesh_shape, rules=rules))
    for g in self.remote_gens:
      try:
        if g.serving:
          g.wait_for(("stage", si), f"the start of stage {si}")
      except GeneratorLost as e:
        log.warning("%s", e)
    return self.remote_gens

  def rollouts(self, stage: Stage, gens, prompts):
    """The stage's RolloutSource: local Rollouts, or (many processes) the leader's, which sends
    each batch on to the other trainer processes, and theirs, which receive it."""
    srun = stage.run
    kw = dict(generators=gens, pool=self.pool, tokenizer=self.tok, grpo_cfg=srun.rl,
              cfg=srun.pipeline, system_prompt=self.system_prompt, seed=self.run.seed + stage.index)
    if self.layout is None:
      return Rollouts(prompts=prompts, colocated=srun.colocated, **kw)
    from magistral_jax.pipeline.trainer_rollouts import FollowerRollouts, LeaderRollouts
    if self.leader:
      return LeaderRollouts(mailbox=self.mailbox, transfer=self.transfer,
                            follower_processes=self.layout.trainer_processes[1:],
                            batch_sharding=batch_sharding(self.tmesh, srun.sharding.trainer_rules),
                            stage=stage.index, prompts=prompts, **kw)
    me = self.layout.process_id
    return FollowerRollouts(mailbox=self.mailbox, process=me,
                            follower=self.layout.trainer_processes.index(me) - 1,
                            stage=stage.index, transfer=self.transfer,
                            batch_timeout_s=srun.pipeline.batch_timeout_s)

  def report(self, res: dict) -> None:
    """summary.json and the one line a user reads at the end."""
    self.trained.save()
    self.write_summary(heldout_accuracy_after=res["pass@1"], format_rate=res["format_rate"],
                       heldout_problems=len(self.heldout),
                       heldout_trained_on=res["heldout_trained_on"],
                       response_length_mean_after=res["response_length_mean"],
                       batches=self.meta["batches"], optimizer_steps=self.meta["opt_steps"],
                       wall_time_s=self.elapsed())
    log.info("summary: %s", json.dumps(self.summary))
    ev = self.run.eval
    before, after = self.summary.get("heldout_accuracy_before"), res["pass@1"]
    sampler = "greedy" if ev.greedy else f"T={ev.temperature:g}"
    change = (f"{before:.3f} -> {after:.3f} ({100 * (after - before):+.1f} points)"
              if before is not None else f"{after:.3f}")
    print(f"held-out pass@1 (k={ev.k}, {sampler}, {len(self.heldout)} problems, "
          f"{self.summary['heldout_trained_on']} trained on): {change} | "
          f"format rate {self.summary['format_rate']:.3f} | wall time "
          f"{self.summary['wall_time_s']:.0f}s | {self.summary_path}", flush=True)

  def close(self) -> None:
    """Every process ends with the leader: it tells the generator processes and the other
    trainer processes, which wait for it once their own work is done (their exit would otherwise
    wait at jax.distributed's shutdown barrier for as long as the final evaluation takes). After
    an exception they do not wait: the coordination service stops the rest."""
    layout = self.layout
    if layout is not None and self.leader:
      for g in self.remote_gens:
        g.close()
      for p in layout.trainer_processes[1:]:
        try:
          self.mailbox.send(f"trainer{p}/end", ("exit",))
        except Exception as e:
          log.warning("could not end trainer process %d: %s", p, e)
    elif layout is not None and self.finished:
      self.mailbox.receive(f"trainer{layout.process_id}/end", 7 * 24 * 3600,
                           what="the trainer leader's end of the run")
    self.ckpt.close()
    if self.pool is not None:
      self.pool.close()
    if self.writer is not None:
      self.writer.close()
    if layout is not None and self.leader:   # the service lives in this process
      multihost.wait_for_others_to_leave(60)
    elif layout is not None and self.finished:
      multihost.leave()
