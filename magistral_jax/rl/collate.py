"""Greedy collation: completions packed into fixed-shape microbatches (paper §5).

A minibatch is cut into microbatches of a fixed token budget by greedy collation: sort by length,
longest first, and put each sequence in the first row with room (first fit). A microbatch is
`microbatch_rows` rows of `row_len` tokens; many short sequences share a row, kept apart by
segment ids. Every loss normaliser is computed over the whole minibatch (one weight per token), so
a microbatch's loss is its exact share of the minibatch's.

Everything here is NumPy: the output feeds the jitted train step directly.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np


# The arrays of a packed microbatch stack, each [n_micro, rows, row_len].
FIELDS = ("tokens", "positions", "segment_ids", "targets", "loss_mask", "old_logprobs",
          "advantages", "weights")


@dataclasses.dataclass
class Completion:
  """One sampled completion as the generator and verifiers return it.

  old_logprobs: π_old of each completion token (one per token). advantage: the group-centred
  Â = r − mean(r_group) before minibatch normalisation (rl/minibatch.py normalises it).
  action_mask: which completion tokens are the policy's actions (None: all). A multi-turn
  completion also holds tokens the policy did not sample, a tool's results
  (tool_use/protocol.py): they are context the later tokens are conditioned on, not actions, so
  they carry no loss, no normaliser weight and no log-prob of their own (old_logprobs there are
  ignored).
  """
  prompt_tokens: np.ndarray
  completion_tokens: np.ndarray
  old_logprobs: np.ndarray | None = None
  advantage: float = 0.0
  group_id: int = 0
  action_mask: np.ndarray | None = None
  trained: bool = True     # False: packed, but no loss and no normaliser weight (a void turn)

  def __post_init__(self):
    self.prompt_tokens = np.asarray(self.prompt_tokens, np.int32).reshape(-1)
    self.completion_tokens = np.asarray(self.completion_tokens, np.int32).reshape(-1)
    if self.old_logprobs is not None:
      self.old_logprobs = np.asarray(self.old_logprobs, np.float32).reshape(-1)
    if self.action_mask is not None:
      self.action_mask = np.asarray(self.action_mask, bool).reshape(-1)

  @property
  def actions(self) -> np.ndarray:
    """[completion tokens] bool: the policy's own tokens."""
    if self.action_mask is None:
      return np.ones(len(self.completion_tokens), bool)
    return self.action_mask

  @property
  def trained_actions(self) -> np.ndarray:
    """[completion tokens] bool: the actions the loss and the normaliser count (none when the
    completion is not trained on)."""
    return self.actions if self.trained else np.zeros(len(self.completion_tokens), bool)

  @property
  def num_actions(self) -> int:
    """Completion tokens the policy sampled: what the token normaliser counts."""
    return int(self.actions.sum())

  @property
  def num_tokens(self) -> int:
    """Packed length: the model reads prompt + completion minus the last token."""
    return len(self.prompt_tokens) + len(self.completion_tokens) - 1


def _validate(completions: Sequence[Completion], need_logprobs: bool):
  for i, c in enumerate(completions):
    if len(c.prompt_tokens) == 0:
      raise ValueError(f"completion {i} (group {c.group_id}): empty prompt; the first completion "
                       "token needs at least one prompt token (e.g. BOS) to be predicted from")
    if len(c.completion_tokens) == 0:
      raise ValueError(f"completion {i} (group {c.group_id}): no completion tokens")
    if c.action_mask is not None and len(c.action_mask) != len(c.completion_tokens):
      raise ValueError(f"completion {i} (group {c.group_id}): action_mask of "
                       f"{len(c.action_mask)} for {len(c.completion_tokens)} completion tokens")
    if c.num_actions == 0:
      raise ValueError(f"completion {i} (group {c.group_id}): no token of the policy's own")
    if need_logprobs:
      if c.old_logprobs is None or len(c.old_logprobs) != len(c.completion_tokens):
        n = None if c.old_logprobs is None else len(c.old_logprobs)
        raise ValueError(f"completion {i} (group {c.group_id}): {n} old log-probs for "
                         f"{len(c.completion_tokens)} completion tokens")
      if not np.all(np.isfinite(c.old_logprobs[c.actions])):
        raise ValueError(f"completion {i} (group {c.group_id}): non-finite old log-probs")
    if not np.isfinite(c.advantage):
      raise ValueError(f"completion {i} (group {c.group_id}): non-finite advantage {c.advantage}")


# ---- greedy collation --------------------------------------------------------------------------

def first_fit(lengths: Sequence[int], capacity: int) -> list[list[int]]:
  """Greedy collation: longest first, each into the first bin with room. Returns bins of indices."""
  lengths = np.asarray(lengths, np.int64)
  too_long = np.flatnonzero(lengths > capacity)
  if too_long.size:
    i = int(too_long[0])
    raise ValueError(f"sequence {i} has {lengths[i]} tokens, more than the row length {capacity} "
                     f"({too_long.size} such sequences); raise microbatch_tokens/microbatch_rows")
  order = np.argsort(-lengths, kind="stable")
  bins: list[list[int]] = []
  room: list[int] = []
  for i in order:
    n = int(lengths[i])
    for b, r in enumerate(room):
      if n <= r:
        bins[b].append(int(i))
        room[b] -= n
        break
    else:
      bins.append([int(i)])
      room.append(capacity - n)
  return bins


def padding_tokens(lengths: Sequence[int], rows: list[list[int]], row_len: int, rows_per_micro: int) -> int:
  """Padding of a fixed-shape layout: allocated slots of whole microbatches minus real tokens."""
  n_micro = -(-len(rows) // rows_per_micro)
  return n_micro * rows_per_micro * row_len - int(np.sum(lengths))


# ---- normalisers -------------------------------------------------------------------------------

def aggregation_weights(lengths, group_ids, loss_agg: str) -> np.ndarray:
  """Per-token weight of each completion's tokens, over the whole minibatch (sums to 1).

      token:            1 / Σ_i |o_i|                      (DAPO; the paper)
      sequence:         1 / (|o_i| · N_seq)
      group_token_sum:  1 / (Σ_{j ∈ g(i)} |o_j| · N_groups)
  """
  lengths = np.asarray(lengths, np.float64)
  if np.any(lengths <= 0):
    raise ValueError(f"aggregation_weights: completions with no token of the policy's own at "
                     f"{np.flatnonzero(lengths <= 0)[:10].tolist()}")
  if loss_agg == "token":
    return np.full(lengths.shape, 1.0 / lengths.sum())
  if loss_agg == "sequence":
    return 1.0 / (lengths * len(lengths))
  if loss_agg == "group_token_sum":
    uniq, inv = np.unique(np.asarray(group_ids), return_inverse=True)
    group_tokens = np.bincount(inv, weights=lengths)
    return 1.0 / (group_tokens[inv] * len(uniq))
  raise ValueError(f"loss_agg must be token|sequence|group_token_sum, got {loss_agg!r}")


# ---- packing -----------------------------------------------------------------------------------

def pack(completions: Sequence[Completion], advantages, weights, row_len: int, rows_per_micro: int,
         bins: list[list[int]] | None = None, min_microbatches: int = 0) -> tuple[dict, np.ndarray]:
  """Packs completions into [n_micro, rows_per_micro, row_len] arrays (FIELDS).

  advantages/weights: one value per completion, broadcast over its completion tokens. `bins`
  defaults to greedy collation. Returns (arrays, placement) with placement[i] = (micro, row,
  start) of completion i, so per-token outputs can be mapped back.
  """
  need_lp = any(c.old_logprobs is not None for c in completions)
  _validate(completions, need_lp)
  lengths = [c.num_tokens for c in completions]
  if bins is None:
    bins = first_fit(lengths, row_len)
  n_micro = max(-(-len(bins) // rows_per_micro), min_microbatches, 1)
  shape = (n_micro * rows_per_micro, row_len)
  out = {
      "tokens": np.zeros(shape, np.int32), "positions": np.zeros(shape, np.int32),
      "segment_ids": np.zeros(shape, np.int32), "targets": np.zeros(shape, np.int32),
      "loss_mask": np.zeros(shape, np.float32), "old_logprobs": np.zeros(shape, np.float32),
      "advantages": np.zeros(shape, np.float32), "weights": np.zeros(shape, np.float32),
  }
  placement = np.full((len(completions), 3), -1, np.int64)
  for r, row in enumerate(bins):
    start = 0
    for seg, i in enumerate(row, start=1):
      c = completions[i]
      seq = np.concatenate([c.prompt_tokens, c.completion_tokens])
      n = len(seq) - 1
      if start + n > row_len:
        raise ValueError(f"bin {r} overflows row_len={row_len}")
      sl = slice(start, start + n)
      out["tokens"][r, sl] = seq[:-1]
      out["targets"][r, sl] = seq[1:]
      out["positions"][r, sl] = np.arange(n)
      out["segment_ids"][r, sl] = seg
      # Target j is seq[j+1]: completion tokens are targets j >= len(prompt) - 1.
      # Of those, only the policy's own (Completion.action_mask) are trained on.
      cs = slice(start + len(c.prompt_tokens) - 1, start + n)
      act = c.trained_actions
      out["loss_mask"][r, cs] = act
      if c.old_logprobs is not None:
        out["old_logprobs"][r, cs] = np.where(act, c.old_logprobs, 0.0)
      out["advantages"][r, cs] = np.where(act, advantages[i], 0.0)
      out["weights"][r, cs] = np.where(act, weights[i], 0.0)
      placement[i] = (r // rows_per_micro, r % rows_per_micro, start)
      start += n
  if np.any(placement[:, 0] < 0):
    raise ValueError(f"bins do not place completions {np.flatnonzero(placement[:, 0] < 0)[:10].tolist()}")
  out = {k: v.reshape(n_micro, rows_per_micro, row_len) for k, v in out.items()}
  return out, placement


def unpack_tokens(values: np.ndarray, completions: Sequence[Completion], placement: np.ndarray) -> list[np.ndarray]:
  """Per-completion slices of a per-token array laid out like `pack`'s output (e.g. log-probs)."""
  values = np.asarray(values)
  out = []
  for c, (m, r, s) in zip(completions, placement):
    p = len(c.prompt_tokens)
    out.append(values[m, r, s + p - 1: s + c.num_tokens])
  return out
