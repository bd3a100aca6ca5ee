"""Assembling a run: device slices, generator engines, and the SFT warm start of the tiny task."""
from __future__ import annotations

import logging
import time
from typing import Iterable, Sequence

import jax
import numpy as np

from magistral_jax.generate.engine import Engine
from magistral_jax.generate.loop import GeneratorLoop
from magistral_jax.generate.sampling import SamplingConfig
from magistral_jax.model.config import ModelConfig
from magistral_jax.parallel.sharding import GENERATOR_RULES, make_mesh

log = logging.getLogger(__name__)


def split_devices(trainer_devices: int, generator_devices: Sequence[int],
                  devices: Sequence[jax.Device] | None = None):
  """Disjoint device slices: the first `trainer_devices` for the trainer, then one slice per
  generator. E.g. on 8 devices: split_devices(4, [2, 2]) -> 4 | 2 | 2."""
  devices = list(jax.devices() if devices is None else devices)
  need = trainer_devices + sum(generator_devices)
  if trainer_devices < 1 or any(n < 1 for n in generator_devices) or not generator_devices:
    raise ValueError(f"device layout needs >= 1 device for the trainer and each generator, got "
                     f"trainer={trainer_devices}, generators={list(generator_devices)}")
  if need > len(devices):
    raise ValueError(f"device layout trainer={trainer_devices} + generators="
                     f"{list(generator_devices)} needs {need} devices, but this machine has "
                     f"{len(devices)} ({jax.default_backend()})")
  trainer = devices[:trainer_devices]
  gens, i = [], trainer_devices
  for n in generator_devices:
    gens.append(devices[i:i + n])
    i += n
  return trainer, gens


def make_generators(model_cfg: ModelConfig, params, device_slices, sampling: SamplingConfig, *,
                    mesh_shape: dict | None = None, max_concurrent_decodes: int,
                    max_prefill_length: int, max_decode_length: int, version: int = 0,
                    detokenize=None, recompute_kv_on_update: bool = False, seed: int = 0,
                    rules=GENERATOR_RULES) -> list[GeneratorLoop]:
  """One engine + generator loop per device slice (tensor parallel over the slice by default)."""
  loops = []
  for i, devs in enumerate(device_slices):
    shape = dict(mesh_shape or {"tensor": len(devs)})
    mesh = make_mesh(shape, devs)
    engine = Engine(model_cfg, mesh, rules, max_concurrent_decodes=max_concurrent_decodes,
                    max_prefill_length=max_prefill_length, max_decode_length=max_decode_length,
                    sampling=sampling)
    loops.append(GeneratorLoop(engine, params, version, detokenize=detokenize,
                               recompute_kv_on_update=recompute_kv_on_update, seed=seed + i))
  return loops


def sft_warm_start(state, sft_step, tokenizer, examples: Iterable[tuple[str, str]], *,
                   num_steps: int, batch_size: int, row_len: int, rows_per_micro: int,
                   system_prompt: str | None, mesh=None, log_every: int = 10, writer=None):
  """Cold-start SFT: `num_steps` steps of next-token loss on (problem, completion) pairs, the
  prompt built with the tokenizer's chat template and masked out of the loss."""
  from magistral_jax.train.sft import sft_collate
  from magistral_jax.train.step import shard_batch
  it = iter(examples)
  t0 = time.time()
  metrics = {}
  for step in range(num_steps):
    pairs = []
    for _ in range(batch_size):
      problem, completion = next(it)
      prompt = tokenizer.apply_chat_template(problem, system_prompt)
      pairs.append((prompt, tokenizer.encode(completion) + [tokenizer.eos_id]))
    arrays, _ = sft_collate(pairs, row_len, rows_per_micro)
    state, metrics = sft_step(state, shard_batch(arrays, mesh))
    if (step + 1) % log_every == 0 or step + 1 == num_steps:
      metrics = {k: float(np.asarray(v)) for k, v in jax.device_get(metrics).items()}
      rate = (step + 1) / (time.time() - t0)
      log.info("sft step %d/%d | %.2f steps/s | nll/token %.4f", step + 1, num_steps, rate,
               metrics.get("nll_per_token", float("nan")))
      if writer is not None:
        writer.write(step + 1, {f"sft/{k}": v for k, v in metrics.items()})
  return state, metrics
