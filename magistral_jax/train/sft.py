"""The SFT step for the cold start (Magistral Small, paper §4): next-token cross-entropy on the
response tokens of packed (prompt, response) pairs, on the same train-step machinery as GRPO.

    loss = −1/N · Σ_{response tokens t of the minibatch} log π_θ(y_t | y_<t)

N is the minibatch's response-token count (carried by the per-token weights, as in GRPO), so
microbatch gradients add up to the minibatch gradient exactly.

Every SFT here (launch/sft.py's, the RL run's warm start) turns (problem, completion) text pairs
into rows by one rule, `sft_pairs_to_tokens`; built datasets come packed by SftLoader, whose
batches `loader_batch_arrays` turns into the same microbatches.
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
from magistral_jax.tool_use.protocol import encode_transcript
from magistral_jax.parallel.multihost import to_host
from magistral_jax.train.step import make_train_step, shard_batch

log = logging.getLogger(__name__)


def sft_collate(examples: Sequence[tuple], row_len: int, rows_per_micro: int,
                min_microbatches: int = 0):
  """(prompt tokens, response tokens[, action mask]) examples -> packed microbatch stack (greedy
  collation). The prompt, and a tool's results in the response (the mask's False), are masked
  out of the loss. Returns (arrays, placement)."""
  comps = [Completion(e[0], e[1], action_mask=e[2] if len(e) > 2 else None) for e in examples]
  lengths = [c.num_actions for c in comps]
  if not comps:
    raise ValueError("sft_collate: no examples")
  weights = aggregation_weights(lengths, np.zeros(len(comps)), "token")
  return pack(comps, np.zeros(len(comps)), weights, row_len, rows_per_micro,
              min_microbatches=min_microbatches)


def sft_pairs_to_tokens(pairs: Iterable[tuple[str, str]], tokenizer, system_prompt: str | None,
                        row_len: int) -> tuple[list[tuple], int]:
  """(problem, completion) text pairs -> (prompt tokens, response tokens) pairs that fit a row,
  and how many were cut.

  The rule: the prompt is the tokenizer's chat template around the problem and the system prompt
  (masked out of the loss), the response the completion's tokens and EOS. A row of row_len
  positions holds a pair of up to row_len + 1 tokens (position j predicts token j + 1). A longer
  pair's response is cut to fit: the model learns its start and never its end (the tiny task's
  rambling traces, synthetic.ramble_trace, are made to be cut). A prompt of more than row_len
  tokens leaves its response nothing to learn: an error.
  A completion with tool calls (tool_use/protocol.py) is tokenized piece by piece, as the
  generator loop makes it (the policy's text, then each result block on its own), and its pairs
  carry a third element, the action mask: the result tokens are context, not targets."""
  out, cut = [], 0
  for problem, completion in pairs:
    prompt = tokenizer.apply_chat_template(problem, system_prompt)
    room = row_len + 1 - len(prompt)
    if room < 1:
      raise ValueError(f"sft: a prompt of {len(prompt)} tokens leaves no room for its response "
                       f"in a row of sft.row_len={row_len} tokens; raise sft.row_len")
    response, mask = encode_transcript(completion, tokenizer.encode)
    response.append(tokenizer.eos_id)
    mask.append(True)
    cut += len(response) > room
    out.append((prompt, response[:room]) + ((mask[:room],) if not all(mask) else ()))
  return out, cut


def sft_pair_arrays(pairs: Iterable[tuple[str, str]], tokenizer, system_prompt: str | None,
                    row_len: int, rows_per_micro: int) -> tuple[dict, int]:
  """The SFT step's packed microbatches of (problem, completion) text pairs (the rule of
  sft_pairs_to_tokens), and how many pairs were cut to their row."""
  examples, cut = sft_pairs_to_tokens(pairs, tokenizer, system_prompt, row_len)
  arrays, _ = sft_collate(examples, row_len, rows_per_micro)
  return arrays, cut


def loader_batch_arrays(batch: dict, rows_per_micro: int) -> dict:
  """An SftLoader batch ([B, L] packed rows of built SFT datasets) -> the SFT step's
  [n_micro, rows, L] microbatches, as sft_collate lays them out.

  Position j predicts token j+1 of the same segment; the loss counts it when that token is a
  response token. Weights are 1/N over the batch's N response tokens (the minibatch mean).
  """
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
  tokenizer's chat template and masked out of the loss; an over-long pair is cut to its row
  (sft_pairs_to_tokens)."""
  num_steps, batch_size, row_len = cfg.num_steps, cfg.batch_size, cfg.row_len
  rows_per_micro = cfg.rows_per_micro
  it = iter(examples)
  t0 = time.time()
  metrics = {}
  for step in range(num_steps):
    arrays, _ = sft_pair_arrays([next(it) for _ in range(batch_size)], tokenizer,
                                system_prompt, row_len, rows_per_micro)
    state, metrics = sft_step(state, shard_batch(arrays, mesh))
    if (step + 1) % log_every == 0 or step + 1 == num_steps:
      metrics = {k: float(v) for k, v in to_host(metrics).items()}
      rate = (step + 1) / (time.time() - t0)
      log.info("sft step %d/%d | %.2f steps/s | nll/token %.4f", step + 1, num_steps, rate,
               metrics.get("nll_per_token", float("nan")))
      if writer is not None:
        writer.write(step + 1, {f"sft/{k}": v for k, v in metrics.items()})
  return state, metrics
