"""Rehearsals of the paper's recipes (configs/medium.py:rehearsal, configs/small.py:rehearsal).

A rehearsal is the recipe run end to end on a CPU host in a few minutes: every knob of the recipe
that can be kept is kept (the stages and their schedule, eps_low/eps_high, adv_norm, loss_agg,
n_batch = n_mini, the n_async / n_batch ratio, the optimizer and its learning rate, the dtype
fields, remat, temperature, the length-penalty shape l_max / l_cache, one microbatch row per
trainer data-parallel device holding the longest sequence), and only sizes shrink:

- the model to tiny dimensions (the dtype/remat fields of the recipe's `model` are left as they
  are: a rehearsal has the recipe's precision);
- every length (prompt limit, max_new_tokens, l_max, l_cache, the microbatch row, evaluation
  max_new_tokens) divided by `length_divisor`;
- every batch size (n_batch, n_mini, n_async) divided by `batch_divisor` and the group size by
  `group_divisor`;
- each stage (or the unstaged run) to `batches_per_stage` batches;
- the device layout to 8 simulated CPU devices (trainer 4 with the recipe's FSDP mesh, two
  generators of 2).

Each division must be exact, so the rehearsal's numbers are the recipe's divided and a change to
the recipe flows into its rehearsal (e.g. a microbatch row one token too short for the longest
sequence stays one token too short, and `config.validate`'s row-fit check reports it).

Tokenizer and data: the recipes' are Mistral's Tekken tokenizer (131k vocabulary) with the
paper's system prompt (176 Tekken tokens) on filtered math/code sets. A rehearsal instead uses
the CPU default's model and task, read from configs/tiny.py (TINY_RECIPE): its model dimensions,
the character tokenizer (104 symbols), synthetic multi-step arithmetic through the real math
verifier, and its cold start's learning rate, with no system prompt and the full Magistral
reward. Why: the paper's system prompt alone is longer than the divided prompt limit (4096 / 128
= 32 tokens), a 131k-wide output layer would cost ~1000x the tiny model's logits on
every SFT, decode and train token, and a tiny random model on MATH problems never meets the
format, so every group would have zero advantage and be dropped and no batch would ever form.
The arithmetic task has a learnable cold start (`launch/train.py`'s SFT warm start on worked
traces, as configs/tiny.py does, standing in for Small's SFT and Medium's instruct checkpoint),
after which the policy meets the format part of the time, so groups have non-zero advantages
under the recipe's reward. A quarter of the cold-start traces ramble (data.sft_ramble_rate,
synthetic.ramble_trace: thoughts that never close, longer than the SFT row), so the policy
sometimes thinks until max_new_tokens cuts it off: sequences reach the longest length a stage
allows (prompt + max_new_tokens, the microbatch row's edge) and are trained on (a cut-off
completion fails the format, its group-mates mostly do not, so the group is kept).
"""
from __future__ import annotations

import pathlib

import ml_collections as mlc

from magistral_jax.run.recipes import load_recipe

# Stage override keys by how a rehearsal scales them; any other key is kept as the recipe has it
# only if it is not a number (a number the rehearsal does not know how to scale is an error).
LENGTH_KEYS = ("engine.max_prefill_length", "sampling.max_new_tokens", "reward.l_max",
               "reward.l_cache", "eval.max_new_tokens")
BATCH_KEYS = ("rl.n_batch", "rl.n_mini", "pipeline.n_async")
GROUP_KEYS = ("rl.group_size",)

# The rehearsal's device layout: 8 simulated CPU devices (launch/train.py asks for them).
TRAINER_DEVICES = 4
GENERATORS = (2, 2)

# The CPU default recipe, beside the package in the checkout a rehearsal runs from (the recipes
# are not installed), and what a rehearsal takes from it: the model's dimensions (not its dtype
# or remat fields: a rehearsal has the recipe's precision), the task, and the cold start's
# learning rate and rows per microbatch.
TINY_RECIPE = pathlib.Path(__file__).resolve().parents[2] / "configs" / "tiny.py"
TINY_MODEL = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
              "num_kv_heads", "head_dim", "bos_token_id", "eos_token_id")
TINY_TASK = ("source", "min_steps", "max_steps", "max_operand", "allow_negative", "sft_slip_rate")
TINY_SFT = ("learning_rate", "rows_per_micro")


def _div(value: int, divisor: int, what: str) -> int:
  if value % divisor:
    raise ValueError(f"rehearsal: {what}={value} is not divisible by {divisor}; the rehearsal "
                     "must keep the recipe's numbers exactly, divided")
  return value // divisor


def rehearsal_of(recipe: mlc.ConfigDict, *, length_divisor: int, batch_divisor: int,
                 group_divisor: int, batches_per_stage: int,
                 sft_steps: int = 50, ramble_rate: float = 0.25) -> mlc.ConfigDict:
  """The CPU rehearsal of `recipe` (a copy; see the module docstring for what is kept)."""
  c = mlc.ConfigDict(recipe.to_dict())
  tiny = load_recipe(str(TINY_RECIPE))
  L, B = length_divisor, batch_divisor

  # ---- the model: tiny's dims; dtype/remat fields stay the recipe's ----
  max_len = (_div(recipe.engine.max_prefill_length, L, "engine.max_prefill_length")
             + _div(recipe.sampling.max_new_tokens, L, "sampling.max_new_tokens"))
  c.model.update({k: tiny.model[k] for k in TINY_MODEL}, max_position_embeddings=max_len)
  c.init.update(source="random", path="")
  c.tokenizer = tiny.tokenizer
  # No system prompt: the paper's (and even the tiny task's one-line prompt) is longer than a
  # divided prompt limit ("Q: Compute 7+2-5+3.\nA: " is ~24 symbols); the cold start teaches the
  # format.
  c.system_prompt = "none"
  c.data.update({k: tiny.data[k] for k in TINY_TASK}, data_dir="", heldout=4,
                sft_ramble_rate=ramble_rate)
  # The cold start (launch/train.py runs it for init.source=random): tiny's lr and rows per
  # microbatch, few steps (see the module docstring).
  # The cold start's rows are the RL rows (prompt limit + max_new_tokens): a rambling trace fills
  # one, so the policy has rambled at every position a completion can reach and runs on to
  # max_new_tokens (with shorter rows it learned to stop soon past the row's end).
  c.sft.update({k: tiny.sft[k] for k in TINY_SFT}, num_steps=sft_steps, batch_size=16,
               row_len=max_len)

  # ---- lengths ----
  c.engine.max_prefill_length = _div(recipe.engine.max_prefill_length, L,
                                     "engine.max_prefill_length")
  c.sampling.max_new_tokens = _div(recipe.sampling.max_new_tokens, L, "sampling.max_new_tokens")
  c.reward.l_max = _div(recipe.reward.l_max, L, "reward.l_max")
  c.reward.l_cache = _div(recipe.reward.l_cache, L, "reward.l_cache")
  c.eval.max_new_tokens = _div(recipe.eval.max_new_tokens, L, "eval.max_new_tokens")
  # The recipe's microbatch: microbatch_rows rows per microbatch, `rows_per_device` for each of
  # its trainer's data-parallel devices, each row microbatch_tokens / microbatch_rows tokens.
  # The rehearsal keeps rows per device and divides the row length.
  rows_per_device = _div(recipe.rl.microbatch_rows, recipe.devices.trainer, "rl.microbatch_rows")
  row = _div(_div(recipe.rl.microbatch_tokens, recipe.rl.microbatch_rows, "rl.microbatch_tokens"),
             L, "row length (rl.microbatch_tokens / rl.microbatch_rows)")
  c.rl.microbatch_rows = rows_per_device * TRAINER_DEVICES
  c.rl.microbatch_tokens = c.rl.microbatch_rows * row

  # ---- batch sizes (n_batch = n_mini and n_async / n_batch kept by dividing all alike) ----
  c.rl.n_batch = _div(recipe.rl.n_batch, B, "rl.n_batch")
  c.rl.n_mini = _div(recipe.rl.n_mini, B, "rl.n_mini")
  c.rl.group_size = _div(recipe.rl.group_size, group_divisor, "rl.group_size")
  if recipe.pipeline.n_async:   # 0 = 2 x n_batch whatever the n_batch: nothing to divide
    c.pipeline.n_async = _div(recipe.pipeline.n_async, B, "pipeline.n_async")

  # ---- stages: the recipe's schedule, each overridden number scaled like its field ----
  def scale(key, value):
    if key in LENGTH_KEYS:
      return _div(value, L, key)
    if key in BATCH_KEYS:
      return _div(value, B, key)
    if key in GROUP_KEYS:
      return _div(value, group_divisor, key)
    if isinstance(value, (int, float)) and not isinstance(value, bool) and key not in (
        "rl.eps_low", "rl.eps_high", "optimizer.learning_rate", "sampling.temperature"):
      raise ValueError(f"rehearsal: stage override {key!r} has no rule for scaling; add it to "
                       "magistral_jax/run/rehearsal.py")
    return value

  c.stages = tuple(
      {"name": s.get("name", str(i)), "num_batches": batches_per_stage,
       "overrides": {k: scale(k, v) for k, v in dict(s.get("overrides", {})).items()}}
      for i, s in enumerate(recipe.stages))
  c.num_batches = batches_per_stage

  # ---- CPU sizes of what is not a recipe knob ----
  c.engine.max_concurrent_decodes = 16   # per generator
  c.devices.update(trainer=TRAINER_DEVICES, generators=GENERATORS)
  c.devices.generator_mesh = mlc.ConfigDict({"tensor": -1})   # replaces the recipe's axes
  c.verifier.update(num_workers=1, task_timeout_s=30.0)
  c.eval.update(k=1)
  c.pipeline.update(sample_every=1, batch_timeout_s=600.0)
  # Every checkpoint is kept (step 0, after the cold start, is the weights the RL started from).
  c.checkpoint.update(every=1, keep=1000, keep_every=0)
  return c
