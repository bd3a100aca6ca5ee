"""The SFT step for the cold start (Magistral Small, paper §4): next-token cross-entropy on the
response tokens of packed (prompt, response) pairs, on the same train-step machinery as GRPO.

    loss = −1/N · Σ_{response tokens t of the minibatch} log π_θ(y_t | y_<t)

N is the minibatch's response-token count (carried by the per-token weights, as in GRPO), so
microbatch gradients add up to the minibatch gradient exactly.
"""
from __future__ import annotations

from typing import Sequence

import jax.numpy as jnp
import numpy as np

from magistral_jax.model import transformer as tfm
from magistral_jax.model.config import ModelConfig
from magistral_jax.parallel.sharding import DEFAULT_RULES, ShardingCtx
from magistral_jax.rl.collate import Completion, aggregation_weights, pack
from magistral_jax.train.step import make_train_step


def sft_collate(examples: Sequence[tuple[Sequence[int], Sequence[int]]], row_len: int,
                rows_per_micro: int, min_microbatches: int = 0):
  """(prompt tokens, response tokens) pairs -> packed microbatch stack (greedy collation).
  The prompt is masked out of the loss. Returns (arrays, placement)."""
  comps = [Completion(p, r) for p, r in examples]
  lengths = [len(c.completion_tokens) for c in comps]
  if not comps:
    raise ValueError("sft_collate: no examples")
  weights = aggregation_weights(lengths, np.zeros(len(comps)), "token")
  return pack(comps, np.zeros(len(comps)), weights, row_len, rows_per_micro,
              min_microbatches=min_microbatches)


def sft_loss_fn(model_cfg: ModelConfig, mesh=None, rules=DEFAULT_RULES):
  shard = None if mesh is None else ShardingCtx(mesh, tuple(rules))

  def loss_fn(params, m, ref_params=None):
    del ref_params
    h = tfm.hidden_states(params, model_cfg, m["tokens"], m["positions"], m["segment_ids"], shard)
    lp = tfm.token_logprobs(params, model_cfg, h, m["targets"])
    mask = m["loss_mask"].astype(jnp.float32)
    loss = -jnp.sum(m["weights"] * lp)
    return loss, {"loss": loss, "tokens": jnp.sum(mask), "nll_sum": -jnp.sum(mask * lp)}
  return loss_fn


def summarize_sft(sums: dict) -> dict:
  return {"loss": sums["loss"], "tokens": sums["tokens"],
          "nll_per_token": sums["nll_sum"] / jnp.maximum(sums["tokens"], 1.0)}


def make_sft_step(model_cfg: ModelConfig, tx, mesh=None, rules=DEFAULT_RULES, donate: bool = True,
                  lr_schedule=None):
  """step(state, batch) -> (state, metrics) for the SFT cold start."""
  return make_train_step(model_cfg, tx, sft_loss_fn(model_cfg, mesh, rules), mesh, rules,
                         summarize_sft, donate=donate, lr_schedule=lr_schedule)
