"""The trainer's optimizer: AdamW, linear warmup then constant or cosine, global-norm clipping.

The paper states none of these hyper-parameters (NOT STATED): the defaults are common choices for
RL fine-tuning of an instruct model and are config fields.
"""
from __future__ import annotations

import optax

from magistral_jax.train.config import OptimizerConfig


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
