"""A batch of scored groups -> one packed minibatch per optimizer step (paper §1, §5).

A batch of n_batch completions (whole groups) is split into n_batch/n_mini minibatches of whole
groups by a seeded permutation; each minibatch is one optimizer step. Inside a minibatch the
group-centred advantages are normalised,

    minibatch:  Â_norm = (Â − mean_mb(Â)) / std_mb(Â)   (the paper; statistics over sequences)
    group:      Â_norm = Â / std_group(r)                (classic GRPO; ablation)
    none:       Â_norm = Â

the per-token loss weights are computed over the whole minibatch, and its completions are packed
into fixed-shape microbatches (rl/collate.py).

Pure NumPy.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from magistral_jax.rl.advantages import ScoredGroup
from magistral_jax.rl.collate import Completion, aggregation_weights, pack
from magistral_jax.rl.config import GRPOConfig


def group_std(x, group_ids) -> np.ndarray:
  """Per-element population std of x over its group."""
  x = np.asarray(x, np.float64)
  _, inv = np.unique(np.asarray(group_ids), return_inverse=True)
  counts = np.bincount(inv)
  mean = np.bincount(inv, weights=x) / counts
  var = np.bincount(inv, weights=(x - mean[inv]) ** 2) / counts
  return np.sqrt(var)[inv]


def normalize_advantages(advantages, group_ids, mode: str = "minibatch",
                         eps: float = 1e-6) -> np.ndarray:
  """Normalises one minibatch's group-centred advantages (see the module docstring)."""
  adv = np.asarray(advantages, np.float64)
  if mode == "minibatch":
    return (adv - adv.mean()) / (adv.std() + eps)
  if mode == "group":
    # std of Â within a group is the std of r within it (Â is r shifted by the group mean).
    return adv / (group_std(adv, group_ids) + eps)
  if mode == "none":
    return adv
  raise ValueError(f"adv_norm must be minibatch|group|none, got {mode!r}")


def split_minibatches(group_ids, n_mini: int,
                      rng: np.random.Generator | None = None) -> list[np.ndarray]:
  """Splits a batch into minibatches of n_mini completions made of whole groups (shuffled by rng).
  Returns each minibatch's completion indices."""
  group_ids = np.asarray(group_ids)
  uniq = np.unique(group_ids)
  if rng is not None:
    uniq = rng.permutation(uniq)
  members = [np.flatnonzero(group_ids == g) for g in uniq]
  minibatches, cur = [], []
  for m in members:
    cur.extend(m.tolist())
    if len(cur) == n_mini:
      minibatches.append(np.asarray(cur))
      cur = []
    elif len(cur) > n_mini:
      raise ValueError(f"group {uniq[len(minibatches)]} straddles a minibatch boundary: "
                       f"n_mini={n_mini} must be a multiple of the group size")
  if cur:
    raise ValueError(f"{len(group_ids)} completions do not split into minibatches of "
                     f"n_mini={n_mini}")
  return minibatches


@dataclasses.dataclass
class Minibatch:
  """One optimizer step's data.

  arrays: the packed microbatch stack, each field [n_micro, rows, row_len] (collate.FIELDS).
  completions: its completions, advantages normalised. placement[i] = (micro, row, start) of
  completion i in `arrays` (collate.unpack_tokens maps per-token outputs back). stats: collation
  counts (microbatches, sequences, completion_tokens, padding_frac).
  """
  arrays: dict
  completions: list[Completion]
  placement: np.ndarray
  stats: dict


def collate_minibatch(completions: Sequence[Completion], cfg: GRPOConfig,
                      min_microbatches: int = 0) -> Minibatch:
  """One minibatch -> its packed microbatches: advantages normalised per cfg.adv_norm, weights per
  cfg.loss_agg, greedy collation into cfg.microbatch_rows × cfg.row_len microbatches."""
  group_ids = np.asarray([c.group_id for c in completions])
  adv = normalize_advantages([c.advantage for c in completions], group_ids, cfg.adv_norm,
                             cfg.adv_eps)
  # The normaliser counts the policy's own tokens (a tool's results are not actions) of the
  # completions trained on (not a void turn's: GRPOConfig.drop_void_turns).
  trained = np.asarray([c.trained for c in completions])
  lengths = np.asarray([c.trained_actions.sum() for c in completions])
  weights = np.zeros(len(completions))
  if trained.any():
    weights[trained] = aggregation_weights(lengths[trained], group_ids[trained], cfg.loss_agg)
  arrays, placement = pack(completions, adv, weights, cfg.row_len, cfg.microbatch_rows,
                           min_microbatches=min_microbatches)
  real = int(sum(c.num_tokens for c in completions))
  stats = {"microbatches": arrays["tokens"].shape[0], "sequences": len(completions),
           "completion_tokens": int(lengths.sum()),
           "padding_frac": 1.0 - real / arrays["tokens"].size}
  normalised = [dataclasses.replace(c, advantage=float(a)) for c, a in zip(completions, adv)]
  return Minibatch(arrays, normalised, placement, stats)


def make_minibatches(groups: Sequence[ScoredGroup], cfg: GRPOConfig,
                     rng: np.random.Generator | None = None,
                     min_microbatches: int = 0) -> list[Minibatch]:
  """A batch of kept groups (n_batch completions in all) -> one Minibatch per optimizer step.

  Groups are ordered by group id first, so the split depends only on `rng` and the groups, not on
  the order in which they finished."""
  if any(g.dropped for g in groups):
    raise ValueError(f"dropped groups in a training batch: "
                     f"{[g.group_id for g in groups if g.dropped][:10]}")
  groups = sorted(groups, key=lambda g: g.group_id)
  completions = [c for g in groups for c in g.completions]
  if len(completions) != cfg.n_batch:
    raise ValueError(f"batch has {len(completions)} completions, GRPOConfig.n_batch={cfg.n_batch}")
  return [collate_minibatch([completions[i] for i in idx], cfg, min_microbatches)
          for idx in split_minibatches([c.group_id for c in completions], cfg.n_mini, rng)]
