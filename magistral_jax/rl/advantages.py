"""Group-relative advantages, zero-advantage group filtering and advantage normalisation (SPEC §1).

    Â_i = r_i − mean_{j ∈ group(i)} r_j                      (no division by the group std)
    minibatch:  Â_norm = (Â − mean_mb(Â)) / std_mb(Â)        (statistics over the minibatch's sequences)
    group:      Â_norm = Â / std_group(r)                    (classic GRPO; ablation)
    none:       Â_norm = Â

Pure NumPy: inputs are per-completion arrays, outputs are arrays plus plain-dict counts.
"""
from __future__ import annotations

import numpy as np


def _group_index(group_ids) -> tuple[np.ndarray, np.ndarray]:
  """Maps arbitrary group ids to 0..n_groups-1. Returns (unique ids, inverse index)."""
  group_ids = np.asarray(group_ids)
  if group_ids.ndim != 1:
    raise ValueError(f"group_ids must be 1-D, got shape {group_ids.shape}")
  return np.unique(group_ids, return_inverse=True)


def _check(rewards, group_ids):
  rewards = np.asarray(rewards, np.float64)
  if rewards.shape != np.shape(group_ids):
    raise ValueError(f"rewards shape {rewards.shape} != group_ids shape {np.shape(group_ids)}")
  if not np.all(np.isfinite(rewards)):
    bad = np.flatnonzero(~np.isfinite(rewards))
    raise ValueError(f"non-finite rewards at completion indices {bad[:10].tolist()}")
  return rewards


def group_mean(x, group_ids) -> np.ndarray:
  """Per-element mean of x over its group."""
  _, inv = _group_index(group_ids)
  x = np.asarray(x, np.float64)
  sums = np.bincount(inv, weights=x)
  counts = np.bincount(inv)
  return (sums / counts)[inv]


def group_std(x, group_ids) -> np.ndarray:
  """Per-element population std of x over its group."""
  x = np.asarray(x, np.float64)
  centred = x - group_mean(x, group_ids)
  return np.sqrt(group_mean(centred ** 2, group_ids))


def group_advantages(rewards, group_ids) -> np.ndarray:
  """Â_i = r_i − mean(r_group(i))."""
  rewards = _check(rewards, group_ids)
  return rewards - group_mean(rewards, group_ids)


def filter_groups(rewards, group_ids, length_penalty=None, length_only_groups: str = "keep",
                  atol: float = 1e-6) -> tuple[np.ndarray, dict]:
  """Which completions to keep: groups whose rewards are all equal carry zero advantage and are dropped.

  `length_penalty` (per completion, the continuous DAPO overlong term already included in
  `rewards`) lets us see groups whose rewards differ *only* through that term: with
  length_only_groups='drop' they are dropped too, with 'keep' they stay (see GRPOConfig).
  Returns (keep mask over completions, counts for logging).
  """
  rewards = _check(rewards, group_ids)
  if length_only_groups not in ("keep", "drop"):
    raise ValueError(f"length_only_groups must be keep|drop, got {length_only_groups!r}")
  uniq, inv = _group_index(group_ids)
  n_groups = len(uniq)

  def spread(x):
    lo = np.full(n_groups, np.inf)
    hi = np.full(n_groups, -np.inf)
    np.minimum.at(lo, inv, x)
    np.maximum.at(hi, inv, x)
    return hi - lo

  zero = spread(rewards) <= atol
  length_only = np.zeros(n_groups, bool)
  if length_penalty is not None:
    length_penalty = np.asarray(length_penalty, np.float64)
    if length_penalty.shape != rewards.shape:
      raise ValueError(f"length_penalty shape {length_penalty.shape} != rewards shape {rewards.shape}")
    length_only = ~zero & (spread(rewards - length_penalty) <= atol)
  drop = zero | (length_only if length_only_groups == "drop" else False)
  keep = ~drop[inv]
  stats = {
      "groups": int(n_groups),
      "groups_zero_advantage": int(zero.sum()),
      "groups_length_only": int(length_only.sum()),
      "groups_dropped": int(drop.sum()),
      "completions_dropped": int((~keep).sum()),
  }
  return keep, stats


def normalize_advantages(advantages, group_ids, mode: str = "minibatch", eps: float = 1e-6) -> np.ndarray:
  """Normalises group-centred advantages over one minibatch (call once per minibatch)."""
  adv = np.asarray(advantages, np.float64)
  if mode == "minibatch":
    return (adv - adv.mean()) / (adv.std() + eps)
  if mode == "group":
    # std of Â within a group is the std of r within it (Â is r shifted by the group mean).
    return adv / (group_std(adv, group_ids) + eps)
  if mode == "none":
    return adv
  raise ValueError(f"adv_norm must be minibatch|group|none, got {mode!r}")
