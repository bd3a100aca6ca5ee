"""The RL loop, as the paper's algorithm reads (paper §1, §5).

    repeat:
      take a batch of n_batch completions: G per prompt, each scored by the verifiers, with
        Â = r − mean(r) over its group; groups with no signal already dropped   (RolloutSource)
      split it into n_batch/n_mini minibatches of whole groups by a fixed permutation; normalise
        Â over each; pack it into microbatches by greedy collation            (RolloutSource.minibatches)
      for each minibatch: one optimizer step on the GRPO loss                  (Trainer.step)
                          then push θ to the generators, which continue their in-flight
                          sequences, KV cache and all, on the new weights  (RolloutSource.push)

Generation never waits for this loop in async mode: the generators (pipeline.rollouts.Rollouts,
train.rollout_source.RolloutSource) keep generating with the weights of the last push while the
trainer steps.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import jax
import numpy as np

from magistral_jax.parallel.memory import backend_peak_bytes, bytes_in_use, compiled_temp_bytes
from magistral_jax.parallel.multihost import local_devices, to_host
from magistral_jax.parallel.config import DEFAULT_RULES
from magistral_jax.rl.config import GRPOConfig
from magistral_jax.rl.minibatch import Minibatch
from magistral_jax.train.rollout_source import RolloutSource
from magistral_jax.train.step import TrainState, shard_batch


@dataclasses.dataclass
class Trainer:
  """The optimizer side: the sharded TrainState, its jitted GRPO step (train.step.make_grpo_step),
  the trainer mesh and its sharding rules (minibatch rows over the data axes), and the counters a
  resume needs. `version` is the policy version of `state.params`."""
  step_fn: Callable[[TrainState, dict], tuple[TrainState, dict]]
  state: TrainState
  mesh: Any = None
  rules: tuple = DEFAULT_RULES
  version: int = 0
  opt_steps: int = 0
  batches: int = 0
  # The compiled step's temporaries per minibatch shape (parallel.memory.compiled_temp_bytes):
  # looked up once per shape, not on every step.
  _temp_bytes: dict = dataclasses.field(default_factory=dict, repr=False)

  def step(self, minibatch: Minibatch) -> dict:
    """One optimizer step on one minibatch; returns its metrics (on the host), with the step's
    device memory: `memory/train_peak_bytes` = the bytes in use on the trainer's devices as it
    starts (GPU/TPU: everything there, e.g. a colocated generator's; CPU, which keeps no count:
    the state and the batch) + the compiled
    step's temporaries (parallel.memory); `memory/device_peak_bytes`, the backend's lifetime
    high-water mark, where it keeps one (GPU/TPU)."""
    batch = shard_batch(minibatch.arrays, self.mesh, self.rules)
    devices = self._devices()
    # Where the backend keeps no count (CPU): the step's own inputs (generator threads may be
    # creating and freeing arrays meanwhile).
    start = bytes_in_use(devices, arrays=(self.state, batch))
    self.state, metrics = self.step_fn(self.state, batch)
    self.opt_steps += 1
    self.version += 1
    out = {k: float(v) for k, v in to_host(metrics).items()}
    shape = tuple(sorted((k, v.shape) for k, v in batch.items()))
    if shape not in self._temp_bytes:
      self._temp_bytes[shape] = compiled_temp_bytes(self.step_fn, self.state, batch)
    temp = self._temp_bytes[shape]
    if temp is not None:
      out["memory/train_peak_bytes"] = float(start + temp)
    peak = backend_peak_bytes(devices)
    if peak is not None:
      out["memory/device_peak_bytes"] = float(peak)
    return out

  def _devices(self) -> list:
    """This process's trainer devices (with many processes, each reports its own)."""
    if self.mesh is not None:
      return local_devices(self.mesh.devices.flat)
    return local_devices(jax.tree.leaves(self.state.params)[0].sharding.device_set)


def train(trainer: Trainer, rollouts: RolloutSource, cfg: GRPOConfig, num_batches: int, *,
          seed: int = 0, writer=None, sample_every: int = 0,
          on_batch: Callable[[Trainer, dict], None] | None = None) -> list[dict]:
  """Runs `num_batches` batches (n_batch/n_mini optimizer steps each), or fewer if the prompts run
  out. Returns the per-batch metrics; `on_batch(trainer, metrics)` runs after each batch (progress,
  checkpoints)."""
  history = []
  for _ in range(num_batches):
    batch = rollouts.next_batch()
    if batch is None:
      break
    t_train, trained_version = time.time(), trainer.version
    permutation = np.random.default_rng([seed, trainer.batches])
    steps, push_s = [], 0.0
    for mb in rollouts.minibatches(batch, cfg, permutation):
      steps.append(dict(trainer.step(mb), padding_frac=mb.stats["padding_frac"],
                        microbatches=mb.stats["microbatches"]))
      push_s += rollouts.push(trainer.state.params, trainer.version)
    rollouts.done(batch)
    trainer.batches += 1
    train_s = time.time() - t_train

    # Per batch: the mean over its optimizer steps; a *_max / *_min / *peak* metric is the
    # batch's own.
    pool = lambda k: (np.max if k.endswith("_max") or "peak" in k else
                      np.min if k.endswith("_min") else np.mean)
    m = {k: float(pool(k)([s[k] for s in steps])) for k in steps[0]}
    m.update(rollouts.metrics(batch, trained_version))
    m.update(weight_push_s=push_s / len(steps), train_time_s=train_s, trainer_idle_s=batch.wait_s,
             trainer_idle_frac=batch.wait_s / max(1e-9, batch.wait_s + train_s),
             batch=trainer.batches, version=trainer.version)
    history.append(m)
    if writer is not None:
      writer.write(trainer.opt_steps, m)
      if sample_every and trainer.batches % sample_every == 0:
        writer.write_text(trainer.opt_steps, "sample", rollouts.sample_text(batch))
    if on_batch is not None:
      on_batch(trainer, m)
  return history
