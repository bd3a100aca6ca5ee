r"""Cold-start SFT: `python launch/sft.py --config=configs/sft_small.py --workdir=runs/sft_small`.

Next-token loss on the response tokens of (prompt, reasoning trace) pairs, the prompt built with
the tokenizer's chat template and the run's system prompt (paper §4: Magistral Small is fine-tuned
on Medium's traces before RL). The traces come from

  * data.source = "synthetic": worked traces of the synthetic arithmetic task (configs/tiny.py);
    an endless stream, so sft.num_steps must be set;
  * otherwise data.source names built SFT datasets (comma-separated) under data.data_dir (build
    them with magistral_jax.data.tfds_builders.build_dataset("sft", ...)); read packed and
    shuffled by SftLoader for sft.epochs epochs, or sft.num_steps steps if that is > 0.

Writes the final params as an orbax checkpoint at WORKDIR/params (+ the model's WORKDIR/config.json;
the run configuration is WORKDIR/sft_config.json), which `init.source="orbax",
init.path=WORKDIR/params` (configs/small.py) loads for RL; metrics.jsonl, tb/, sft_summary.json;
resumable checkpoints in WORKDIR/checkpoints (a rerun continues from the latest one).
"""
from __future__ import annotations

import json
import logging
import os
import time

from magistral_jax import cli  # noqa: F401  (the shared flags; before jax: the CPU device count)

from absl import app  # noqa: E402

log = logging.getLogger("sft")


def synthetic_pairs(config, skip: int = 0):
  """(problem, worked trace) pairs of the synthetic task, from position `skip` on."""
  from magistral_jax.data import synthetic
  for i, pair in enumerate(synthetic.sft_pairs_for(config.data, config.seed)):
    if i >= skip:
      yield pair


def collate_pairs(pairs, tok, system_prompt, row_len, rows_per_micro):
  from magistral_jax.train.sft import sft_collate
  examples = []
  for problem, completion in pairs:
    prompt = tok.apply_chat_template(problem, system_prompt)
    examples.append((prompt, tok.encode(completion) + [tok.eos_id]))
  too_long = [len(p) + len(c) - 1 for p, c in examples if len(p) + len(c) - 1 > row_len]
  if too_long:
    raise ValueError(f"{len(too_long)} SFT example(s) of up to {max(too_long)} tokens do not fit "
                     f"sft.row_len={row_len}; raise sft.row_len")
  arrays, _ = sft_collate(examples, row_len, rows_per_micro)
  return arrays


def loader_batch_to_arrays(batch: dict, rows_per_micro: int) -> dict:
  """An SftLoader batch ([B, L] packed rows) -> the SFT step's [n_micro, rows, L] microbatches.

  Position j predicts token j+1 of the same segment; the loss counts it when that token is a
  response token. Weights are 1/N over the batch's N response tokens (the minibatch mean).
  """
  import numpy as np
  tokens = np.asarray(batch["tokens"], np.int32)
  seg = np.asarray(batch["segment_ids"], np.int32)
  b, length = tokens.shape
  if b % rows_per_micro:
    raise ValueError(f"sft.batch_size={b} must be a multiple of sft.rows_per_micro="
                     f"{rows_per_micro}")
  targets = np.zeros_like(tokens)
  targets[:, :-1] = tokens[:, 1:]
  mask = np.zeros(tokens.shape, np.float32)
  same = (seg[:, 1:] == seg[:, :-1]) & (seg[:, :-1] > 0)
  mask[:, :-1] = same & (np.asarray(batch["loss_mask"])[:, 1:] > 0)
  weights = mask / max(float(mask.sum()), 1.0)
  out = {"tokens": tokens, "positions": np.asarray(batch["positions"], np.int32),
         "segment_ids": seg, "targets": targets, "loss_mask": mask, "weights": weights}
  return {k: v.reshape(b // rows_per_micro, rows_per_micro, length) for k, v in out.items()}


def main(argv):
  del argv
  config = cli.start_run()
  import jax
  import numpy as np
  from magistral_jax import config as config_lib
  from magistral_jax.model.orbax_params import save_params_orbax
  from magistral_jax.parallel import make_mesh
  from magistral_jax.data.prompts import dataset_problems
  from magistral_jax.pipeline.build import build_tokenizer_and_model, sft_optimizer_config
  from magistral_jax.parallel.layout import run_devices
  from magistral_jax.data.prompts import system_prompt_for
  from magistral_jax.train.checkpointing import RunCheckpointer, abstract_like
  from magistral_jax.train.metrics_writer import MetricsWriter, Progress
  from magistral_jax.train.optimizer import make_optimizer
  from magistral_jax.train.sft import make_sft_step
  from magistral_jax.train.step import init_state, shard_batch

  t_start = time.time()
  rules = config_lib.validate(config, jax.device_count()).sharding.trainer_rules
  synthetic = config.data.source == "synthetic"
  # ---- GSM8K cold-start traces (configs/smollm2.py:sft): built on first use ----------------
  # data.source "gsm8k_traces" = the worked solutions of GSM8K's train split in the Magistral
  # format. launch/train.py evaluates on data.heldout_source (GSM8K's test split): the traces are
  # checked against every problem of it, by id and question text, so no held-out set drawn from
  # it (any data.heldout, any seed) holds a problem the SFT trained on; an overlap stops here.
  from magistral_jax.data import gsm8k_traces
  if gsm8k_traces.NAME in config.data.source.split(","):
    config.data.data_dir = config.data.data_dir or os.path.join(cli.workdir(), "data")
    held = config.data.get("heldout_source", "") or gsm8k_traces.HELDOUT
    heldout = dataset_problems(config, held)
    log.info("GSM8K traces (from %s; none of the %d problems of %s): %s", gsm8k_traces.SHIPPED,
             len(heldout), held,
             gsm8k_traces.build_trace_dataset(config.data.data_dir, heldout=heldout,
                                              heldout_name=f"data.heldout_source={held!r}"))
  # ---- end of the GSM8K traces block ------------------------------------------------------
  num_steps = int(config.sft.num_steps)
  if synthetic and num_steps <= 0:
    raise ValueError("sft.num_steps must be > 0 with data.source='synthetic' (an endless stream)")
  if not synthetic and not config.data.data_dir:
    raise ValueError(f"data.source={config.data.source!r} names built SFT datasets: set "
                     "data.data_dir to the directory they were built in")
  workdir = cli.workdir()
  os.makedirs(workdir, exist_ok=True)
  # WORKDIR/config.json is the model's (written by save_params_orbax, read by init.source=orbax);
  # the run configuration goes beside it.
  with open(os.path.join(workdir, "sft_config.json"), "w") as f:
    f.write(config.to_json(indent=1))
  writer = MetricsWriter(workdir)
  tok, model_cfg, init_params = build_tokenizer_and_model(config)
  system_prompt = system_prompt_for(config.system_prompt)
  tdev, _ = run_devices(config)
  mesh = make_mesh(dict(config.devices.trainer_mesh), tdev)
  tx = make_optimizer(sft_optimizer_config(config))
  state = init_state(model_cfg, tx, jax.random.PRNGKey(config.seed), mesh, rules,
                     params=init_params)
  step_fn = make_sft_step(model_cfg, tx, mesh, rules)
  ckpt = RunCheckpointer(os.path.join(workdir, "checkpoints"), keep=config.checkpoint.keep,
                         async_save=config.checkpoint.async_save)
  restored = ckpt.restore_latest(abstract_like(state))
  meta = {"step": 0, "data": {}}
  if restored is not None:
    _, state, meta = restored
    log.info("resumed SFT from step %d", meta["step"])

  if synthetic:
    pairs = synthetic_pairs(config, skip=meta["step"] * config.sft.batch_size)
    loader = None

    def next_arrays():
      batch = [next(pairs) for _ in range(config.sft.batch_size)]
      return collate_pairs(batch, tok, system_prompt, config.sft.row_len,
                           config.sft.rows_per_micro)
  else:
    from magistral_jax.data.loader import SftLoader, chat_sft_tokenize_fn
    loader = SftLoader(config.data.data_dir, config.data.source.split(","),
                       chat_sft_tokenize_fn(tok, system_prompt), seq_len=config.sft.row_len,
                       batch_size=config.sft.batch_size, seed=config.seed,
                       num_epochs=None if num_steps > 0 else config.sft.epochs)
    if meta["data"]:
      loader.restore(meta["data"])

    def next_arrays():
      return loader_batch_to_arrays(next(loader), config.sft.rows_per_micro)

  total = num_steps if num_steps > 0 else None
  progress = Progress(total or 0, meta["step"])
  log.info("cold-start SFT: %.2fM params | %s | %s steps from step %d",
           model_cfg.num_params() / 1e6, config.data.source, total or "all epochs", meta["step"])
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
      if step % config.checkpoint.every == 0:
        ckpt.save(step, state, meta)
    ckpt.wait()
    if step not in ckpt.steps():
      ckpt.save(step, state, meta, force=True)
    ckpt.wait()
    metrics = {k: float(np.asarray(v)) for k, v in jax.device_get(metrics).items()}
    params_dir = os.path.join(workdir, "params")
    save_params_orbax(params_dir, state.params, model_cfg)
    summary = {"sft_steps": step, "final_nll_per_token": metrics.get("nll_per_token"),
               "params": params_dir, "wall_time_s": time.time() - t_start}
    json.dump(summary, open(os.path.join(workdir, "sft_summary.json"), "w"), indent=1)
    log.info("saved SFT params to %s; summary: %s", params_dir, json.dumps(summary))
  finally:
    ckpt.close()
    writer.close()


if __name__ == "__main__":
  app.run(main)
