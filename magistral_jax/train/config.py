"""The training sections of the run config: `optimizer` (the RL optimizer), `sft` (the cold
start) and `checkpoint`. The paper states none of the optimizer's hyper-parameters (NOT STATED):
the defaults are common choices for RL fine-tuning of an instruct model."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

SCHEDULES = ("constant", "cosine")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  learning_rate: float = 1e-6       # NOT STATED
  warmup_steps: int = 0             # NOT STATED
  schedule: str = "constant"        # constant | cosine (after warmup)
  decay_steps: int = 1000           # cosine: steps from the end of warmup to the final value
  final_lr_frac: float = 0.1        # cosine: final lr = learning_rate · final_lr_frac
  b1: float = 0.9
  b2: float = 0.95
  eps: float = 1e-8
  weight_decay: float = 0.0         # NOT STATED (0: RL updates should not shrink the policy)
  grad_clip_norm: float | None = 1.0

  def __post_init__(self):
    if self.schedule not in SCHEDULES:
      raise ValueError(f"OptimizerConfig.schedule={self.schedule!r}; expected one of {SCHEDULES}")
    if self.learning_rate < 0 or self.warmup_steps < 0:
      raise ValueError(f"OptimizerConfig: negative learning_rate/warmup_steps: {self}")

  def replace(self, **kw) -> "OptimizerConfig":
    return dataclasses.replace(self, **kw)


# The scale of a typical weight of a transformer (init std 0.02; trained weights stay near it).
TYPICAL_WEIGHT = 0.02


def update_rounding_warning(param_dtype, learning_rate: float, what: str = "optimizer",
                            typical_weight: float = TYPICAL_WEIGHT) -> str | None:
  """A message when Adam updates (about learning_rate per element) are below one unit in the
  last place of a typical weight stored in `param_dtype`, so most of them round away and the
  weights barely move; None otherwise. E.g. bf16 (8 significant bits) at |w| = 0.02 has an ulp
  of 1.2e-4, and lr 1e-6 updates change ~2% of such weights per step (fp32: all of them)."""
  dt = jnp.dtype(param_dtype)
  if not jnp.issubdtype(dt, jnp.floating) or learning_rate <= 0:
    return None
  # ulp(w) = 2^floor(log2 |w|) · eps (numpy's spacing does not know bfloat16).
  ulp = float(2.0 ** np.floor(np.log2(typical_weight)) * jnp.finfo(dt).eps)
  if learning_rate >= ulp:
    return None
  return (f"{what} learning_rate={learning_rate:g} is below one ulp ({ulp:.2g}) of a typical "
          f"weight ({typical_weight}) stored in param_dtype={dt.name}: most updates round away. "
          f"Keep fp32 master weights (model.param_dtype='float32') and compute in bf16 "
          f"(model.dtype='bfloat16').")


@dataclasses.dataclass(frozen=True)
class SFTConfig:
  """The run config's `sft` section: cold-start SFT (Magistral Small, paper §6; also the tiny
  task's warm start). lr schedule: linear warmup, then constant or cosine down to final_lr_frac at
  the last step. A run with num_steps > 0 from random init starts with it (run/train.py);
  launch/sft.py runs it alone, by epochs when num_steps is 0."""
  num_steps: int = 0
  batch_size: int = 16
  learning_rate: float = 3e-3
  row_len: int = 512
  rows_per_micro: int = 4
  epochs: int = 4
  warmup_steps: int = 0
  schedule: str = "constant"
  final_lr_frac: float = 0.1

  def __post_init__(self):
    if self.schedule not in SCHEDULES:
      raise ValueError(f"sft.schedule={self.schedule!r}; expected one of {SCHEDULES}")
    if self.schedule == "cosine" and self.num_steps <= 0:
      raise ValueError("sft.schedule='cosine' needs sft.num_steps > 0 (the decay length); "
                       "epoch-based SFT (num_steps=0) takes schedule='constant'")
    if min(self.batch_size, self.row_len, self.rows_per_micro) < 1 or self.num_steps < 0:
      raise ValueError(f"sft: batch_size, row_len and rows_per_micro must be >= 1 and num_steps "
                       f">= 0, got {self}")

  def optimizer(self) -> OptimizerConfig:
    """AdamW at learning_rate, warmup_steps of linear warmup, then constant or cosine over the
    rest of num_steps."""
    return OptimizerConfig(learning_rate=self.learning_rate, warmup_steps=self.warmup_steps,
                           schedule=self.schedule,
                           decay_steps=max(1, self.num_steps - self.warmup_steps),
                           final_lr_frac=self.final_lr_frac)


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  """The run config's `checkpoint` section: a checkpoint every `every` RL batches, the last
  `keep` kept (and every `keep_every`-th step's for good, 0 = none), written in the background
  when async_save."""
  every: int = 5
  keep: int = 3
  keep_every: int = 0
  async_save: bool = True

  def __post_init__(self):
    for f, least in (("every", 1), ("keep", 1), ("keep_every", 0)):
      if getattr(self, f) < least:
        raise ValueError(f"checkpoint.{f}={getattr(self, f)} must be >= {least}")
