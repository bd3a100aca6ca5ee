"""The RL run (launch/train.py): reads top to bottom like the run.

Devices and meshes, tokenizer and policy, (cold-start SFT), held-out evaluation, then for each
stage the RL loop (train/rl_loop.py: batches of scored groups from a RolloutSource ->
minibatches -> optimizer steps -> weight pushes to the generators), checkpoints, and a final
evaluation. A run resumes from the latest checkpoint in its workdir.

Where the parts live, one process or many (leader and followers), is the run's topology
(run/topology.py): it gives the loop its generators, rollouts, evaluation and shutdown. See
README.md ("Many hosts").
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
from magistral_jax.eval.in_run import write_eval
from magistral_jax.model.loading import load_policy
from magistral_jax.parallel.sharding import make_mesh
from magistral_jax.pipeline.generators import shared_prefix_for
from magistral_jax.run.generator_process import run_generator_process
from magistral_jax.run.stages import Stage, stages as stage_list, training_sampling
from magistral_jax.run.topology import topology_for
from magistral_jax.train.checkpointing import RunCheckpointer, abstract_like
from magistral_jax.train.metrics_writer import MetricsWriter, Progress
from magistral_jax.train.optimizer import learning_rate_schedule, make_optimizer
from magistral_jax.train.rl_loop import Trainer, train
from magistral_jax.train.sft import make_sft_step, sft_warm_start
from magistral_jax.train.step import init_state, make_grpo_step
from magistral_jax.verify.pool import VerifierPool

log = logging.getLogger("train")


def main(config: mlc.ConfigDict, workdir: str) -> None:
  """The whole run, in this process's role: a generator process serves until the leader ends
  the run; a trainer process trains (the leader also runs the pipeline and writes the files)."""
  run = config_lib.validate(config)
  topology = topology_for(run)   # every config error before any work, device counts included
  stages = stage_list(config, run)
  if topology.leader:
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "config.json"), "w") as f:
      f.write(config.to_json(indent=1))
  # A trainer's params load straight onto its mesh (generator processes load none).
  mesh = make_mesh(run.devices.trainer_mesh, topology.tdev) if topology.is_trainer else None
  tok, model_cfg, init_params = load_policy(
      run.model, run.init, run.tokenizer, load_weights=mesh is not None, mesh=mesh,
      rules=run.sharding.trainer_rules)
  system_prompt = system_prompt_for(run.system_prompt, run.tools.enabled)
  shared_prefix = shared_prefix_for(run.engine, tok, system_prompt)
  if not topology.is_trainer:
    return run_generator_process(run, stages, topology.layout, tok, model_cfg, system_prompt,
                                 shared_prefix)
  rl = RLRun(run, stages, topology, workdir, mesh, tok, model_cfg, init_params, system_prompt,
             shared_prefix)
  del init_params   # the train state holds the weights now; no second copy for the whole run
  try:
    rl.train()
  finally:
    rl.close()


class RLRun:
  """A trainer process's run: the train state and its checkpoints, the verifier pool, the
  evaluation, and (on the leader) the metrics and summary files. See the module docstring."""

  def __init__(self, run, stages: list[Stage], topology, workdir, tmesh, tok, model_cfg,
               init_params, system_prompt, shared_prefix):
    self.run, self.stages, self.topology, self.workdir = run, stages, topology, workdir
    self.tok, self.model_cfg, self.system_prompt = tok, model_cfg, system_prompt
    self.t_start = time.time()
    self.leader = topology.leader   # writes the run's files, runs the pipeline
    self.writer = MetricsWriter(workdir) if self.leader else None
    log.info("shared prompt prefix: %s", f"{len(shared_prefix)} tokens, prefilled once per "
             "weights version" if shared_prefix else "off")
    self.tmesh = tmesh   # the trainer's mesh (its params are on it already)
    log.info("model %.2fM params | trainer %s | generators %s", model_cfg.num_params() / 1e6,
             dict(tmesh.shape), f"colocated on the trainer's {tmesh.devices.size} device(s), "
             f"{'taking turns' if run.pipeline.mode == 'sync' else 'one batch ahead'}"
             if run.colocated else [len(g) for g in topology.gdevs])
    self.rl_tx = make_optimizer(run.optimizer)
    self.state = init_state(model_cfg, self.rl_tx, jax.random.PRNGKey(run.seed), self.tmesh,
                            run.sharding.trainer_rules, params=init_params)
    ck = run.checkpoint
    self.ckpt = RunCheckpointer(os.path.join(workdir, "checkpoints"), keep=ck.keep,
                                keep_every=ck.keep_every, async_save=ck.async_save,
                                processes=topology.trainer_processes)
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
    topology.start(tmesh, model_cfg, tok, system_prompt, shared_prefix)
    # The leader's pool scores the completions, unless the generator processes do.
    self.pool = (VerifierPool.from_config(run.verifier, run.reward)
                 if self.leader and topology.scores_on_leader else None)
    if self.pool is not None:
      topology.guard(self.pool)
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
    res = self.topology.evaluate(params, tag, self.meta["version"], self.heldout, self.pool)
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
      self.meta.update(stage=stage.index + 1, batch_in_stage=0, rng=None)   # a stage's own seeds
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
    engine_cfg = srun.engine
    if srun.colocated and (srun.pipeline.mode == "sync" or srun.pipeline.carry_over):
      # Colocated and taking turns: the generator is stepped in this thread between train
      # phases, with no background prefill thread.
      engine_cfg = dataclasses.replace(engine_cfg, background_prefill=False)
    gens = self.topology.generators(stage, sampling, engine_cfg, self.state.params,
                                    meta["version"])
    trainer = Trainer(step_fn, self.state, self.tmesh, rules, version=meta["version"],
                      opt_steps=meta["opt_steps"], batches=meta["batches"])
    prompts = train_prompts(self.run, self.heldout, meta["data"], self.workdir,
                            trained=self.trained) if self.leader else None
    rollouts = self.topology.rollouts(
        stage, prompts, self.tmesh, generators=gens, pool=self.pool, tokenizer=self.tok,
        grpo_cfg=srun.rl, cfg=srun.pipeline, system_prompt=self.system_prompt,
        seed=self.run.seed + si, seeds_drawn=(meta["rng"] or {}).get("seeds_drawn", 0))
    every = self.run.eval.every   # 0: no held-out evaluation between before and after

    def on_batch(trainer, m):
      data, rng = (rollouts.stream_state() if prompts is not None
                   else (meta["data"], meta["rng"]))
      meta.update(stage=si, batch_in_stage=meta["batch_in_stage"] + 1, batches=trainer.batches,
                  version=trainer.version, opt_steps=trainer.opt_steps, data=data, rng=rng)
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
    """The topology's end of the run (many processes end with the leader), then this process's
    checkpointer, pool and metrics."""
    self.topology.end(self.finished)
    self.ckpt.close()
    if self.pool is not None:
      self.pool.close()
    if self.writer is not None:
      self.writer.close()
    self.topology.leave(self.finished)
