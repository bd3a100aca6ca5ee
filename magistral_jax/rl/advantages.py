"""A group's advantages and whether it is trained on (paper §1), decided once, when it is scored.

    Â_i = r_i − mean_{j ∈ group} r_j        (no division by the group std)

A group whose rewards are all equal has Â = 0 everywhere: it carries no signal and is dropped.
A group with a completion whose verification failed (timeout, crashed worker, closed pool, a task
the verifier could not read) is dropped too: its 0 is an infrastructure fault, not the policy's
answer, and kept in the group it would give the other completions, correct ones included, an
advantage they did not earn. Minibatch normalisation of Â happens later, over a minibatch (rl/minibatch.py).

Pure NumPy over one group's arrays.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from magistral_jax.rl.collate import Completion
from magistral_jax.rl.config import GRPOConfig

if TYPE_CHECKING:   # the verifiers' modules are not needed to do arithmetic on their results
  from magistral_jax.rewards.reward import RewardResult

ZERO_ADVANTAGE = "zero_advantage"
LENGTH_ONLY = "length_only"
VERIFIER_ERROR = "verifier_error"
DROP_REASONS = (ZERO_ADVANTAGE, LENGTH_ONLY, VERIFIER_ERROR)


def _check(rewards) -> np.ndarray:
  rewards = np.asarray(rewards, np.float64)
  if rewards.ndim != 1 or rewards.size == 0:
    raise ValueError(f"a group's rewards must be a non-empty 1-D array, got shape {rewards.shape}")
  if not np.all(np.isfinite(rewards)):
    bad = np.flatnonzero(~np.isfinite(rewards))
    raise ValueError(f"non-finite rewards at completion indices {bad[:10].tolist()}")
  return rewards


def group_advantages(rewards) -> np.ndarray:
  """Â_i = r_i − mean(r) over one group's rewards."""
  rewards = _check(rewards)
  return rewards - rewards.mean()


def drop_reason(rewards, length_penalty=None, length_only_groups: str = "keep",
                atol: float = 1e-6) -> str | None:
  """Why a group is not trained on, or None if it is.

  ZERO_ADVANTAGE: all rewards equal (within atol). LENGTH_ONLY: the rewards differ only through
  the continuous overlong penalty (`length_penalty`, already included in `rewards`); such a group
  is dropped only with length_only_groups='drop' (GRPOConfig).
  """
  rewards = _check(rewards)
  if length_only_groups not in ("keep", "drop"):
    raise ValueError(f"length_only_groups must be keep|drop, got {length_only_groups!r}")
  spread = lambda x: float(x.max() - x.min())
  if spread(rewards) <= atol:
    return ZERO_ADVANTAGE
  if length_only_groups == "drop" and length_penalty is not None:
    length_penalty = np.asarray(length_penalty, np.float64)
    if length_penalty.shape != rewards.shape:
      raise ValueError(f"length_penalty shape {length_penalty.shape} != rewards shape "
                       f"{rewards.shape}")
    if spread(rewards - length_penalty) <= atol:
      return LENGTH_ONLY
  return None


@dataclasses.dataclass
class ScoredGroup:
  """One prompt's G completions after verification: each Completion carries its group-centred Â.

  `dropped` says why the group is not trained on (one of DROP_REASONS) or is None.
  `results` are the verifier's RewardResults (for metrics); `info` is whatever the caller carries
  along with the group (the pipeline: the generator's samples).
  """
  group_id: int
  completions: list[Completion]
  results: list["RewardResult"]
  dropped: str | None = None
  info: Any = None

  @property
  def rewards(self) -> np.ndarray:
    return np.asarray([r.reward for r in self.results])


def score_group(group_id: int, completions: Sequence[Completion], results: Sequence["RewardResult"],
                cfg: GRPOConfig, info: Any = None) -> ScoredGroup:
  """Scores one finished group: Â = r − mean(r) on each completion, and the drop decision
  (VERIFIER_ERROR if any result carries an error, else drop_reason's)."""
  if len(completions) != len(results):
    raise ValueError(f"group {group_id}: {len(completions)} completions but {len(results)} "
                     "reward results")
  rewards = [r.reward for r in results]
  length_penalty = [r.parts.get("length_penalty") or 0.0 for r in results]
  adv = group_advantages(rewards)
  dropped = (VERIFIER_ERROR if any(r.error for r in results)
             else drop_reason(rewards, length_penalty, cfg.length_only_groups, cfg.reward_atol))
  scored = [dataclasses.replace(c, advantage=float(a), group_id=group_id)
            for c, a in zip(completions, adv)]
  return ScoredGroup(group_id, scored, list(results), dropped, info)
