r"""RL training: `python launch/train.py --config=configs/tiny.py --workdir=runs/tiny`.

Reads top to bottom like the run: devices and meshes, tokenizer and policy, (cold-start SFT),
held-out evaluation, then for each stage the RL loop (magistral_jax/train/rl_loop.py: batches of
scored groups from the Rollouts -> minibatches -> optimizer steps -> weight pushes to the
generators), checkpoints, and a final evaluation. Any config field can be overridden: `--config.rl.eps_high=0.3`. A run resumes from the
latest checkpoint in --workdir automatically.

Many hosts (TPU pods, GPU clusters): one process per host, all with `--distributed` and a config
that gives them roles (`devices.trainer_processes`): the trainer processes train (SPMD) and the
leader among them runs the pipeline; each other process serves one generator
(`run_generator_process`). On one machine: `python launch/local_cluster.py --num_processes=3 --
launch/train.py --config=configs/tiny.py:multihost --workdir=W`. See README.md ("Many hosts").
"""
from __future__ import annotations

import json
import logging
import os
import signal
import time

from magistral_jax import cli  # noqa: F401  (before jax: the CPU device count)

from absl import app

log = logging.getLogger("train")


def run_eval(engine_loop_factory, pool, tok, problems, config, system_prompt, params, tag):
  from magistral_jax.eval.evaluate import evaluate
  loop = engine_loop_factory(params)
  t = time.time()
  res = evaluate(loop, pool, tok, problems, k=config.eval.k, system_prompt=system_prompt,
                 seed=config.seed, tag=tag)
  log.info("[eval %s] pass@1=%.3f maj@%d=%.3f format=%.3f len=%.1f (%d problems, %.1fs)", tag,
           res["pass@1"], config.eval.k, res[f"maj@{config.eval.k}"], res["format_rate"],
           res["response_length_mean"], res["num_problems"], time.time() - t)
  return res


def write_eval(workdir, tag, batch, res, config):
  """WORKDIR/eval_<tag>.json (the whole result, per-problem rows included) and a line of
  WORKDIR/heldout_curve.jsonl (the learning curve: batch, pass@1, format rate, length)."""
  with open(os.path.join(workdir, f"eval_{tag}.json"), "w") as f:
    json.dump({"tag": tag, "batch": batch, "k": config.eval.k, **res}, f)
  keys = ("pass@1", "format_rate", "response_length_mean", "headroom", "num_problems")
  with open(os.path.join(workdir, "heldout_curve.jsonl"), "a") as f:
    f.write(json.dumps({"tag": tag, "batch": batch, **{k: res[k] for k in keys}}) + "\n")


def stage_list(config) -> list[dict]:
  return list(config.stages) or [{"name": "rl", "num_batches": config.num_batches,
                                  "overrides": {}}]


def stage_sampling(scfg, tok):
  from magistral_jax.generate.config import SamplingConfig
  return SamplingConfig(temperature=scfg.sampling.temperature, top_p=scfg.sampling.top_p,
                        top_k=scfg.sampling.top_k, max_new_tokens=scfg.sampling.max_new_tokens,
                        eos_id=tok.eos_id)


def generator_options(scfg, tok, system_prompt, alternate: bool = False) -> dict:
  """make_generators' keywords for a stage's config (on the leader and generator processes)."""
  from magistral_jax.pipeline.generators import shared_prefix_for
  return dict(mesh_shape=dict(scfg.devices.generator_mesh),
              max_concurrent_decodes=scfg.engine.max_concurrent_decodes,
              max_prefill_length=scfg.engine.max_prefill_length,
              max_decode_length=scfg.sampling.max_new_tokens,
              recompute_kv_on_update=scfg.engine.recompute_kv_on_update,
              tune=scfg.engine.tune, attention_windows=scfg.engine.attention_windows,
              background_prefill=scfg.engine.background_prefill and not alternate,
              loop_prefill_below=scfg.engine.loop_prefill_below,
              shared_prefix=shared_prefix_for(scfg.engine, tok, system_prompt),
              overlap_host=scfg.engine.overlap_host)


def eval_loop_factory(config, model_cfg, devices, rules, tok, shared_prefix, engines=None):
  """params -> a GeneratorLoop with the evaluation's sampling, on `devices`. Its engine is the
  generators' on those devices where they match (`engines`, build.engine_for: same lengths and
  compiled-in sampling; the evaluation's temperature is an input), so evaluating compiles
  nothing the run has not."""
  from magistral_jax.generate.loop import GeneratorLoop
  from magistral_jax.generate.config import SamplingConfig
  from magistral_jax.pipeline.generators import engine_for
  sampling = SamplingConfig(temperature=config.eval.temperature, top_p=config.eval.top_p,
                            greedy=config.eval.greedy, max_new_tokens=config.eval.max_new_tokens,
                            eos_id=tok.eos_id)
  engine = engine_for(model_cfg, devices, sampling, engines=engines,
                      mesh_shape=dict(config.devices.generator_mesh), rules=rules,
                      max_concurrent_decodes=config.engine.max_concurrent_decodes,
                      max_prefill_length=config.engine.max_prefill_length,
                      max_decode_length=config.eval.max_new_tokens,
                      attention_windows=config.engine.attention_windows)
  return lambda params: GeneratorLoop(engine, params, sampling=sampling, seed=config.seed,
                                      background_prefill=config.engine.background_prefill,
                                      loop_prefill_below=config.engine.loop_prefill_below,
                                      shared_prefix=shared_prefix)


def make_pool(config, run):
  from magistral_jax.verify import VerifierPool
  return VerifierPool(config.verifier.num_workers, run.reward,
                      task_timeout_s=config.verifier.task_timeout_s,
                      max_tasks_per_worker=config.verifier.max_tasks_per_worker)


def run_generator_process(config, run, layout, tok, model_cfg, system_prompt, shared_prefix):
  """A generator process of a many-host run: one generator on this process's devices, driven
  by the trainer leader (pipeline.remote.serve_generator), scoring evaluations with its own
  verifier pool. Its weights only ever come from the trainer, by device-to-device transfer."""
  from magistral_jax import config as config_lib
  from magistral_jax.parallel import make_mesh
  from magistral_jax.parallel.multihost import Mailbox
  from magistral_jax.pipeline.generators import make_generators
  from magistral_jax.pipeline.remote import serve_generator, weight_transfer
  rules = run.sharding.generator_rules
  devices = layout.generator_devices()[layout.generator_index]
  mesh = make_mesh(dict(config.devices.generator_mesh), devices)
  transfer = weight_transfer(model_cfg, mesh, rules, layout.trainer_devices())
  stages = stage_list(config)
  engines = {}   # build.engine_for: the evaluation and every stage share an engine where they can
  eval_loop = eval_loop_factory(config, model_cfg, devices, rules, tok, shared_prefix, engines)
  pool = make_pool(config, run)

  def make_loop(si, params, version):
    scfg = config_lib.apply_overrides(config, dict(stages[si].get("overrides", {})))
    [loop] = make_generators(model_cfg, params, [devices], stage_sampling(scfg, tok),
                             version=version, seed=config.seed + si, rules=rules, engines=engines,
                             **generator_options(scfg, tok, system_prompt))
    return loop

  def make_eval(tag, params, problems):
    return run_eval(eval_loop, pool, tok, problems, config, system_prompt, params, tag)

  log.info("process %d: %s on %d device(s)", layout.process_id, layout.role, len(devices))
  try:
    serve_generator(layout, Mailbox("run"), make_loop=make_loop, make_eval=make_eval,
                    transfer=transfer)
  finally:
    pool.close()


def _on_sigint(signum, frame):
  """Ctrl-C: KeyboardInterrupt as usual, and a flag the batch wait checks in case the exception
  lands in a finalizer, where Python drops it (pipeline/rollouts.py INTERRUPTED)."""
  from magistral_jax.pipeline import rollouts
  rollouts.INTERRUPTED.set()
  raise KeyboardInterrupt


def main(argv):
  del argv
  config = cli.start_run()
  import jax
  from magistral_jax import config as config_lib
  from magistral_jax.data.prompts import check_heldout_unseen, heldout_problems, train_prompts
  from magistral_jax.parallel import make_mesh, multihost
  from magistral_jax.pipeline import Rollouts
  from magistral_jax.pipeline.build import (build_tokenizer_and_model, is_colocated,
                                            sft_optimizer_config)
  from magistral_jax.parallel.layout import run_devices
  from magistral_jax.train.sft import sft_warm_start
  from magistral_jax.pipeline.generators import engine_for, make_generators, shared_prefix_for
  from magistral_jax.data.prompts import system_prompt_for
  from magistral_jax.train.checkpointing import RunCheckpointer, abstract_like
  from magistral_jax.train.metrics_writer import MetricsWriter, Progress
  from magistral_jax.train.optimizer import make_optimizer, learning_rate_schedule
  from magistral_jax.train.rl_loop import Trainer, train
  from magistral_jax.train.sft import make_sft_step
  from magistral_jax.train.step import init_state, make_grpo_step
  # After the imports: the handler's own import of the pipeline is then a lookup, never an
  # import of jax inside a signal handler (a Ctrl-C before here is Python's default).
  signal.signal(signal.SIGINT, _on_sigint)

  t_start = time.time()
  layout = multihost.process_layout(config)   # None: one process
  # every config error, before any work
  run = config_lib.validate(config, None if layout else jax.device_count())
  trainer_rules, generator_rules = run.sharding.trainer_rules, run.sharding.generator_rules
  leader = layout is None or layout.is_leader   # writes the run's files, runs the pipeline
  workdir = cli.workdir()
  if leader:
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "config.json"), "w") as f:
      f.write(config.to_json(indent=1))
  tok, model_cfg, init_params = build_tokenizer_and_model(
      config, load_weights=layout is None or layout.is_trainer)
  system_prompt = system_prompt_for(config.system_prompt)
  shared_prefix = shared_prefix_for(config.engine, tok, system_prompt)
  if layout is not None and not layout.is_trainer:
    return run_generator_process(config, run, layout, tok, model_cfg, system_prompt,
                                 shared_prefix)
  writer = MetricsWriter(workdir) if leader else None
  log.info("shared prompt prefix: %s", f"{len(shared_prefix)} tokens, prefilled once per weights "
           "version" if shared_prefix else "off")
  colocated = is_colocated(config)
  if layout is None:
    tdev, gdevs = run_devices(config)
  else:
    tdev, gdevs = layout.trainer_devices(), layout.generator_devices()
  tmesh = make_mesh(dict(config.devices.trainer_mesh), tdev)
  log.info("model %.2fM params | trainer %s | generators %s", model_cfg.num_params() / 1e6,
           dict(tmesh.shape), f"colocated on the trainer's {len(tdev)} device(s), "
           f"{'taking turns' if config.pipeline.mode == 'sync' else 'one batch ahead'}"
           if colocated else [len(g) for g in gdevs])
  if layout is not None:
    log.info("process %d of %d: %s | trainer processes %s | generator processes %s",
             layout.process_id, layout.num_processes, layout.role, layout.trainer_processes,
             layout.generator_processes)
  rl_tx = make_optimizer(run.optimizer)
  state = init_state(model_cfg, rl_tx, jax.random.PRNGKey(config.seed), tmesh, trainer_rules,
                     params=init_params)
  ckpt = RunCheckpointer(os.path.join(workdir, "checkpoints"), keep=config.checkpoint.keep,
                         keep_every=config.checkpoint.keep_every,
                         async_save=config.checkpoint.async_save,
                         processes=layout and layout.trainer_processes)
  restored = ckpt.restore_latest(abstract_like(state))
  meta = {"stage": 0, "batch_in_stage": 0, "batches": 0, "version": 0, "opt_steps": 0,
          "data": {"consumed": 0}, "rng": None}
  if restored is not None:
    step, state, meta = restored
    log.info("resumed from checkpoint %d (stage %d, batch %d, policy version %d)", step,
             meta["stage"], meta["batch_in_stage"], meta["version"])
  # Wall time accumulates across resumes: each checkpoint records the run's time up to it (work
  # after the last checkpoint of an interrupted process is redone, and counted once).
  wall0 = float(meta.get("wall_time_s", 0.0))
  elapsed = lambda: wall0 + time.time() - t_start

  def save_checkpoint(step, train_state, force=False):
    meta["wall_time_s"] = elapsed()
    ckpt.save(step, train_state, dict(meta), force=force)

  # Many processes: the generator processes get weights (stage starts, pushes, evaluations) by
  # device-to-device transfers that every trainer process takes part in, one per generator.
  mailbox = transfers = None
  if layout is not None:
    from magistral_jax.pipeline.remote import (RemoteGenerator, remote_eval,
                                               wait_for_generators, weight_transfer)
    mailbox = multihost.Mailbox("run")
    if leader:
      wait_for_generators(layout, mailbox)
    transfers = [weight_transfer(model_cfg, make_mesh(dict(config.devices.generator_mesh), g),
                                 generator_rules, tdev) for g in gdevs]
  pool = make_pool(config, run) if leader else None
  engines = {}   # build.engine_for: the evaluation and every stage share an engine where they can
  eval_loop = (eval_loop_factory(config, model_cfg, gdevs[0], generator_rules, tok, shared_prefix,
                                 engines) if layout is None else None)
  heldout = heldout_problems(config, workdir) if leader else []
  if leader:   # no evaluation may include a problem the RL stream trains on (data/prompts.py)
    check_heldout_unseen(config, heldout, workdir)
  summary_path = os.path.join(workdir, "summary.json")
  summary = json.load(open(summary_path)) if leader and os.path.exists(summary_path) else {}

  def evaluate(params, tag, batch):
    """Held-out pass@1 etc. of `params` (None on trainer processes other than the leader). The
    leader writes WORKDIR/eval_<tag>.json (with each problem's sample and correct counts: the
    paired comparison of two checkpoints, eval/paired.py) and a line of heldout_curve.jsonl."""
    if layout is None:
      res = run_eval(eval_loop, pool, tok, heldout, config, system_prompt,
                     jax.device_get(params), tag)
    else:
      res = remote_eval(layout, mailbox, transfers[0], params, tag, heldout)
    if leader and res is not None:
      write_eval(workdir, tag, batch, res, config)
    return res

  finished = False   # the run's work ended without an exception (in this process)
  try:
    if restored is None:
      if config.sft.num_steps > 0 and config.init.source == "random":
        from magistral_jax.data import synthetic
        log.info("cold-start SFT: %d steps", config.sft.num_steps)
        sft_tx = make_optimizer(sft_optimizer_config(config))
        sft_state = init_state(model_cfg, sft_tx, jax.random.PRNGKey(config.seed), tmesh,
                               trainer_rules, params=state.params)
        examples = synthetic.sft_pairs_for(config.data, config.seed)
        sft_state, _ = sft_warm_start(
            sft_state, make_sft_step(model_cfg, sft_tx, tmesh, trainer_rules), tok,
            examples,
            num_steps=config.sft.num_steps, batch_size=config.sft.batch_size,
            row_len=config.sft.row_len, rows_per_micro=config.sft.rows_per_micro,
            system_prompt=system_prompt, mesh=tmesh, writer=writer, log_every=25)
        state = init_state(model_cfg, rl_tx, jax.random.PRNGKey(config.seed), tmesh,
                           trainer_rules, params=sft_state.params)
        del sft_state
      # eval.before=False skips it (a control run from the same weights as the run it controls).
      if config.eval.before:
        res = evaluate(state.params, "before", 0)
        if leader:
          summary.update(heldout_accuracy_before=res["pass@1"],
                         format_rate_before=res["format_rate"])
          json.dump(summary, open(summary_path, "w"), indent=1)
      save_checkpoint(0, state, force=True)

    stages = stage_list(config)
    eval_every = int(config.eval.every)   # 0: no held-out evaluation between before and after
    total_batches = sum(s.get("num_batches", config.num_batches) for s in stages)
    progress = Progress(total_batches, meta["batches"])
    stop_at = int(config.get("stop_after_batches", 0))
    stopped = False
    for si in range(meta["stage"], len(stages)):
      stage = stages[si]
      scfg = config_lib.apply_overrides(config, dict(stage.get("overrides", {})))
      srun = config_lib.validate(scfg)
      n_batches = stage.get("num_batches", config.num_batches) - meta["batch_in_stage"]
      if stop_at and stop_at - meta["batches"] < n_batches:   # stop_after_batches ends it here
        n_batches, stopped = max(0, stop_at - meta["batches"]), True
        if n_batches == 0:
          break
      log.info("stage %d/%d %r: %d batches, n_batch=%d n_mini=%d G=%d l_max=%d", si + 1,
               len(stages), stage.get("name", si), n_batches, srun.rl.n_batch, srun.rl.n_mini,
               srun.rl.group_size, srun.reward.l_max)
      sampling = stage_sampling(scfg, tok)
      step_fn = make_grpo_step(model_cfg, srun.rl, rl_tx, tmesh, trainer_rules,
                               temperature=sampling.temperature,
                               lr_schedule=learning_rate_schedule(srun.optimizer))
      # Colocated: the generator loads the trainer's params where they are (same devices, no
      # host round trip) and is stepped in this thread between train phases (no background
      # prefill thread) when the two take turns.
      alternate = colocated and scfg.pipeline.mode == "sync"
      options = generator_options(scfg, tok, system_prompt, alternate)
      if layout is None:
        gens = make_generators(
            model_cfg, state.params if colocated else jax.device_get(state.params), gdevs,
            sampling, version=meta["version"], seed=config.seed + si, rules=generator_rules,
            engines=engines, **options)
      else:   # the generator processes start the stage on the trainer's weights
        gens = []
        if leader:
          for g, devs in enumerate(gdevs):
            engine = engine_for(model_cfg, devs, sampling, mesh_shape=options["mesh_shape"],
                                rules=generator_rules,
                                max_concurrent_decodes=options["max_concurrent_decodes"],
                                max_prefill_length=options["max_prefill_length"],
                                max_decode_length=options["max_decode_length"])
            gens.append(RemoteGenerator(mailbox, g, layout.generator_processes[g], engine,
                                        transfers[g]).start())
            gens[-1].send(("stage", si, meta["version"]))
        for transfer in transfers:
          transfer.send(state.params)
        for g, transfer in zip(gens, transfers):
          g.wait_for(("stage", si), f"the start of stage {si}")
        for transfer in transfers:
          transfer.done()
      trainer = Trainer(step_fn, state, tmesh, trainer_rules, version=meta["version"],
                        opt_steps=meta["opt_steps"], batches=meta["batches"])
      rollouts_kw = dict(generators=gens, pool=pool, tokenizer=tok, grpo_cfg=srun.rl,
                         cfg=srun.pipeline, system_prompt=system_prompt, seed=config.seed + si)
      prompts = train_prompts(config, heldout, meta["data"], workdir) if leader else None
      if layout is None:
        rollouts = Rollouts(prompts=prompts, colocated=colocated, **rollouts_kw)
      elif leader:
        from magistral_jax.pipeline.remote import LeaderRollouts
        rollouts = LeaderRollouts(mailbox=mailbox, followers=len(layout.trainer_processes) - 1,
                                  stage=si, prompts=prompts, **rollouts_kw)
      else:
        from magistral_jax.pipeline.remote import FollowerRollouts
        rollouts = FollowerRollouts(mailbox=mailbox, follower=layout.process_id - 1, stage=si,
                                    transfers=transfers,
                                    batch_timeout_s=srun.pipeline.batch_timeout_s)

      def on_batch(trainer, m, si=si):
        meta.update(stage=si, batch_in_stage=meta["batch_in_stage"] + 1,
                    batches=trainer.batches, version=trainer.version,
                    opt_steps=trainer.opt_steps,
                    data=prompts.state() if prompts is not None else meta["data"])
        if leader:
          log.info(progress.line(meta["batches"], m))
        if meta["batches"] % config.checkpoint.every == 0:
          save_checkpoint(trainer.opt_steps, trainer.state)
        if eval_every and meta["batches"] % eval_every == 0 and meta["batches"] < total_batches:
          evaluate(trainer.state.params, f"batch{meta['batches']}", meta["batches"])

      try:
        with rollouts:
          train(trainer, rollouts, srun.rl, n_batches, seed=config.seed + si, writer=writer,
                sample_every=srun.pipeline.sample_every, on_batch=on_batch)
      finally:
        state = trainer.state
        ckpt.wait()
        if meta["opt_steps"] not in ckpt.steps():
          save_checkpoint(meta["opt_steps"], state, force=True)
        ckpt.wait()
      if stopped:
        break
      meta.update(stage=si + 1, batch_in_stage=0)

    if stopped:
      log.info("stopping after %d batches (stop_after_batches=%d): checkpoint %d, stage %d, "
               "batch %d of it; relaunch on this workdir to resume", meta["batches"], stop_at,
               meta["opt_steps"], meta["stage"] + 1, meta["batch_in_stage"])
      finished = True
      return
    res = evaluate(state.params, "after", meta["batches"])
    finished = True
    if not leader:
      return
    summary.update(heldout_accuracy_after=res["pass@1"], format_rate=res["format_rate"],
                   response_length_mean_after=res["response_length_mean"],
                   batches=meta["batches"], optimizer_steps=meta["opt_steps"],
                   wall_time_s=elapsed())
    json.dump(summary, open(summary_path, "w"), indent=1)
    log.info("summary: %s", json.dumps(summary))
    before, after = summary.get("heldout_accuracy_before"), summary["heldout_accuracy_after"]
    print(f"held-out pass@1 (k={config.eval.k}, {'greedy' if config.eval.greedy else 'T=%g' % config.eval.temperature}, "
          f"{len(heldout)} problems): "
          + (f"{before:.3f} -> {after:.3f} ({100 * (after - before):+.1f} points)"
             if before is not None else f"{after:.3f}")
          + f" | format rate {summary['format_rate']:.3f} | wall time {summary['wall_time_s']:.0f}s"
          f" | {summary_path}", flush=True)
  finally:
    # Every process ends with the leader: it tells the generator processes and the other
    # trainer processes, which wait for it once their own work is done (their exit would
    # otherwise wait at jax.distributed's shutdown barrier for as long as the final evaluation
    # takes). After an exception they do not wait: the coordination service stops the rest.
    if layout is not None and leader:
      ends = [f"gen{g}/in" for g in range(len(layout.generator_processes))]
      for stream in ends + [f"trainer{p}/end" for p in layout.trainer_processes[1:]]:
        try:
          mailbox.send(stream, ("exit",))
        except Exception as e:
          log.warning("could not end the run's %s: %s", stream, e)
    elif layout is not None and finished:
      mailbox.receive(f"trainer{layout.process_id}/end", 7 * 24 * 3600,
                      what="the trainer leader's end of the run")
    ckpt.close()
    if pool is not None:
      pool.close()
    if writer is not None:
      writer.close()


if __name__ == "__main__":
  app.run(main)
