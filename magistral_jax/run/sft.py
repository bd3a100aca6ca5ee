"""Cold-start SFT on its own (paper §4: Magistral Small is fine-tuned on Medium's traces before
RL): what launch/sft.py runs. Its docstring says where the traces come from and what the run
writes.

The pairs become rows by train/sft.py's one rule (sft_pairs_to_tokens: chat-template prompt
masked out of the loss, completion + EOS, an over-long pair cut to its row); built datasets come
packed by SftLoader (with the run's system prompt, "none" included) and go through
loader_batch_arrays. A rerun on the same workdir resumes from the latest checkpoint: the step,
and the position in the synthetic stream or the loader.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import time

import jax
import ml_collections as mlc
import numpy as np

from magistral_jax import config as config_lib
from magistral_jax.data import gsm8k_traces, jsonl, synthetic
from magistral_jax.data.prompts import dataset_problems, system_prompt_for
from magistral_jax.data.splits import normalise_text, sft_key
from magistral_jax.data.trained_on import TrainedOn
from magistral_jax.model.loading import load_policy
from magistral_jax.model.orbax_params import save_params_orbax
from magistral_jax.parallel.layout import run_devices
from magistral_jax.parallel.sharding import make_mesh
from magistral_jax.train.checkpointing import RunCheckpointer, abstract_like
from magistral_jax.train.metrics_writer import MetricsWriter, Progress
from magistral_jax.train.optimizer import make_optimizer
from magistral_jax.train.sft import loader_batch_arrays, make_sft_step, sft_pair_arrays
from magistral_jax.train.step import init_state, shard_batch

log = logging.getLogger("sft")


def synthetic_pairs(data_cfg, seed: int, skip: int = 0, trained: TrainedOn | None = None):
  """(problem, worked trace) pairs of the synthetic task, from position `skip` on; with
  `trained`, every pair is recorded in it (those before `skip` too: the resumed run's)."""
  for i, pair in enumerate(synthetic.sft_pairs_for(data_cfg, seed)):
    if trained is not None:
      trained.add(("", normalise_text(pair[0])))
    if i >= skip:
      yield pair


def record_sft_datasets(trained: TrainedOn, run: config_lib.RunConfig) -> None:
  """Records every row of the built SFT datasets of data.source (what a cold start of whole
  epochs trains on; their JSONL beside the build, e.g. gsm8k_traces.jsonl), by id and prompt."""
  for name in run.data.source.split(","):
    path = os.path.join(run.data.data_dir, f"{name}.jsonl")
    if not os.path.exists(path):
      log.warning("%s: not found, so the SFT dataset %r is not in %s (its problems are not "
                  "counted against later evaluations)", path, name, trained.path)
      continue
    for _, row in jsonl.iter_rows(path, jsonl.ReadReport()):
      if isinstance(row, dict) and "prompt" in row and "id" in row:
        trained.add(sft_key(row))


def build_gsm8k_traces(config: mlc.ConfigDict, workdir: str) -> None:
  """data.source "gsm8k_traces" (configs/smollm2.py:sft): the worked solutions of GSM8K's train
  split in the Magistral format, built into data.data_dir (default WORKDIR/data) on first use.
  launch/train.py evaluates on data.heldout_source (GSM8K's test split): the traces are checked
  against every problem of it, by id and question text, so no held-out set drawn from it (any
  data.heldout, any seed) holds a problem the SFT trained on; an overlap stops here."""
  config.data.data_dir = config.data.data_dir or os.path.join(workdir, "data")
  held = config.data.get("heldout_source", "") or gsm8k_traces.HELDOUT
  heldout = dataset_problems(config, held)
  log.info("GSM8K traces (from %s; none of the %d problems of %s): %s", gsm8k_traces.SHIPPED,
           len(heldout), held,
           gsm8k_traces.build_trace_dataset(config.data.data_dir, heldout=heldout,
                                            heldout_name=f"data.heldout_source={held!r}",
                                            tool_rate=config.data.sft_tool_rate))


def _batches(run: config_lib.RunConfig, tok, system_prompt, start_step: int, data_state: dict,
             trained: TrainedOn):
  """(next_arrays, loader or None): the SFT step's microbatches, from the step `start_step` on;
  what they hold is recorded in `trained`."""
  sft = run.sft
  if run.data.source == "synthetic":
    pairs = synthetic_pairs(run.data, run.seed, skip=start_step * sft.batch_size,
                            trained=trained)
    warned = []

    def next_arrays():
      arrays, cut = sft_pair_arrays([next(pairs) for _ in range(sft.batch_size)], tok,
                                    system_prompt, sft.row_len, sft.rows_per_micro)
      if cut and not warned:   # once a run: the tiny task's rambling traces are cut by design
        warned.append(cut)
        log.warning("%d SFT pair(s) of a batch are longer than sft.row_len=%d: cut to it, their "
                    "ends not learned (train/sft.py sft_pairs_to_tokens)", cut, sft.row_len)
      return arrays
    return next_arrays, None
  from magistral_jax.data.loader import SftLoader, sft_tokenize_fn
  # The synthetic path's prompt (system_prompt None: no system prompt, as the config says).
  tokenize = sft_tokenize_fn(lambda p: tok.apply_chat_template(p, system_prompt), tok.encode,
                             tok.eos_id)
  record_sft_datasets(trained, run)
  loader = SftLoader(run.data.data_dir, run.data.source.split(","), tokenize,
                     seq_len=sft.row_len, batch_size=sft.batch_size, seed=run.seed,
                     num_epochs=None if sft.num_steps > 0 else sft.epochs)
  if data_state:
    loader.restore(data_state)
  return lambda: loader_batch_arrays(next(loader), sft.rows_per_micro), loader


def run_sft(config: mlc.ConfigDict, workdir: str) -> dict:
  """Runs (or resumes) the cold-start SFT of `config` in `workdir`; returns its summary."""
  t_start = time.time()
  run = config_lib.validate(config, jax.device_count())   # every config error before any work
  if gsm8k_traces.NAME in config.data.source.split(","):
    build_gsm8k_traces(config, workdir)
    run = dataclasses.replace(run, data=dataclasses.replace(run.data,
                                                            data_dir=config.data.data_dir))
  synthetic_source = run.data.source == "synthetic"
  if synthetic_source and run.sft.num_steps <= 0:
    raise ValueError("sft.num_steps must be > 0 with data.source='synthetic' (an endless stream)")
  if not synthetic_source and not run.data.data_dir:
    raise ValueError(f"data.source={run.data.source!r} names built SFT datasets: set "
                     "data.data_dir to the directory they were built in")
  os.makedirs(workdir, exist_ok=True)
  # WORKDIR/config.json is the model's (written by save_params_orbax, read by init.source=orbax);
  # the run configuration goes beside it.
  with open(os.path.join(workdir, "sft_config.json"), "w") as f:
    f.write(config.to_json(indent=1))
  rules = run.sharding.trainer_rules
  writer = MetricsWriter(workdir)
  tok, model_cfg, init_params = load_policy(run.model, run.init, run.tokenizer)
  system_prompt = system_prompt_for(run.system_prompt, run.tools.enabled)
  tdev, _ = run_devices(run.devices)
  mesh = make_mesh(dict(run.devices.trainer_mesh), tdev)
  tx = make_optimizer(run.sft.optimizer())
  state = init_state(model_cfg, tx, jax.random.PRNGKey(run.seed), mesh, rules,
                     params=init_params)
  step_fn = make_sft_step(model_cfg, tx, mesh, rules)
  ckpt = RunCheckpointer(os.path.join(workdir, "checkpoints"), keep=run.checkpoint.keep,
                         async_save=run.checkpoint.async_save)
  restored = ckpt.restore_latest(abstract_like(state))
  meta = {"step": 0, "data": {}}
  if restored is not None:
    _, state, meta = restored
    log.info("resumed SFT from step %d", meta["step"])
  # What the cold start trains on, for the RL run from its weights (trained_on.trained_on_for).
  trained = TrainedOn(os.path.join(workdir, TrainedOn.FILE))
  next_arrays, loader = _batches(run, tok, system_prompt, meta["step"], meta["data"], trained)

  total = run.sft.num_steps if run.sft.num_steps > 0 else None
  progress = Progress(total or 0, meta["step"])
  log.info("cold-start SFT: %.2fM params | %s | %s steps from step %d",
           model_cfg.num_params() / 1e6, run.data.source, total or "all epochs", meta["step"])
  metrics = {}
  try:
    step = meta["step"]
    while total is None or step < total:
      try:
        arrays = next_arrays()
      except StopIteration:
        break
      state, metrics = step_fn(state, shard_batch(arrays, mesh, rules))
      step += 1
      meta = {"step": step, "data": loader.state() if loader is not None else {}}
      if step % 10 == 0 or step == total:
        metrics = {k: float(np.asarray(v)) for k, v in jax.device_get(metrics).items()}
        writer.write(step, {f"sft/{k}": v for k, v in metrics.items()})
        log.info(progress.line(step, metrics, keys=("nll_per_token",)) if total else
                 f"step {step} | nll_per_token={metrics.get('nll_per_token', float('nan')):.4g}")
      if step % run.checkpoint.every == 0:
        trained.save()
        ckpt.save(step, state, meta)
    trained.save()
    ckpt.wait()
    if step not in ckpt.steps():
      ckpt.save(step, state, meta, force=True)
    ckpt.wait()
    metrics = {k: float(np.asarray(v)) for k, v in jax.device_get(metrics).items()}
    params_dir = os.path.join(workdir, "params")
    save_params_orbax(params_dir, state.params, model_cfg)
    summary = {"sft_steps": step, "final_nll_per_token": metrics.get("nll_per_token"),
               "params": params_dir, "wall_time_s": time.time() - t_start}
    with open(os.path.join(workdir, "sft_summary.json"), "w") as f:
      json.dump(summary, f, indent=1)
    log.info("saved SFT params to %s; summary: %s", params_dir, json.dumps(summary))
  finally:
    ckpt.close()
    writer.close()
  return summary
