"""The SFT step for the cold start (Magistral Small, paper §4): next-token cross-entropy on the
response tokens of packed (prompt, response) pairs, on the same train-step machinery as GRPO.

    loss = −1/N · Σ_{response tokens t of the minibatch} log π_θ(y_t | y_<t)

N is the minibatch's response-token count (carried by the per-token weights, as in GRPO), so
microbatch gradients add up to the minibatch gradient exactly.
"""
from __future__ import annotations

import logging
import time
from typing import Iterable, Sequence

import jax.numpy as jnp
import numpy as np

from magistral_jax.model import transformer as tfm
from magistral_jax.model.config import ModelConfig
from magistral_jax.parallel.sharding import ShardingCtx
from magistral_jax.parallel.config import DEFAULT_RULES
from magistral_jax.train.config import SFTConfig
from magistral_jax.rl.collate import Completion, aggregation_weights, pack
from magistral_jax.parallel.multihost import to_host
from magistral_jax.train.step import make_train_step, shard_batch

log = logging.getLogger(__name__)


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


def sft_warm_start(state, sft_step, tokenizer, examples: Iterable[tuple[str, str]],
                   cfg: SFTConfig, *, system_prompt: str | None, mesh=None, log_every: int = 10,
                   writer=None):
  """Cold-start SFT: cfg.num_steps steps of next-token loss on (problem, completion) pairs,
  cfg.batch_size a step, packed into rows of cfg.row_len tokens; the prompt built with the
  tokenizer's chat template and masked out of the loss."""
  num_steps, batch_size, row_len = cfg.num_steps, cfg.batch_size, cfg.row_len
  rows_per_micro = cfg.rows_per_micro
  it = iter(examples)
  t0 = time.time()
  metrics = {}
  for step in range(num_steps):
    pairs = []
    for _ in range(batch_size):
      problem, completion = next(it)
      prompt = tokenizer.apply_chat_template(problem, system_prompt)
      # A pair longer than the row is cut to it: the model learns its start and never its end
      # (synthetic.ramble_trace relies on it). A prompt alone over the row is an error.
      room = row_len - len(prompt)
      if room < 1:
        raise ValueError(f"sft: a prompt of {len(prompt)} tokens leaves no room in a row of "
                         f"{row_len} tokens; raise sft.row_len")
      pairs.append((prompt, (tokenizer.encode(completion) + [tokenizer.eos_id])[:room]))
    arrays, _ = sft_collate(pairs, row_len, rows_per_micro)
    state, metrics = sft_step(state, shard_batch(arrays, mesh))
    if (step + 1) % log_every == 0 or step + 1 == num_steps:
      metrics = {k: float(v) for k, v in to_host(metrics).items()}
      rate = (step + 1) / (time.time() - t0)
      log.info("sft step %d/%d | %.2f steps/s | nll/token %.4f", step + 1, num_steps, rate,
               metrics.get("nll_per_token", float("nan")))
      if writer is not None:
        writer.write(step + 1, {f"sft/{k}": v for k, v in metrics.items()})
  return state, metrics
