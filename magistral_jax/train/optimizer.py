"""The trainer's optimizer: AdamW, linear warmup then constant or cosine, global-norm clipping.

The paper states none of these hyper-parameters (NOT STATED): the defaults are common choices for
RL fine-tuning of an instruct model and are config fields.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax.numpy as jnp
import numpy as np
import optax

from magistral_jax.configurable import checked_fields

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

  @classmethod
  def from_config_dict(cls, cd: Mapping[str, Any]) -> "OptimizerConfig":
    return cls(**checked_fields(cls, cd, "optimizer"))


def learning_rate_schedule(cfg: OptimizerConfig) -> optax.Schedule:
  """0 -> learning_rate linearly over warmup_steps, then constant or cosine to final_lr_frac."""
  if cfg.schedule == "constant":
    after = optax.constant_schedule(cfg.learning_rate)
  else:
    after = optax.cosine_decay_schedule(cfg.learning_rate, max(cfg.decay_steps, 1), cfg.final_lr_frac)
  if cfg.warmup_steps == 0:
    return after
  warmup = optax.linear_schedule(0.0, cfg.learning_rate, cfg.warmup_steps)
  return optax.join_schedules([warmup, after], [cfg.warmup_steps])


def make_optimizer(cfg: OptimizerConfig) -> optax.GradientTransformation:
  parts = []
  if cfg.grad_clip_norm is not None:
    parts.append(optax.clip_by_global_norm(cfg.grad_clip_norm))
  parts.append(optax.adamw(learning_rate_schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                           weight_decay=cfg.weight_decay))
  return optax.chain(*parts)


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
