"""Group assembly: kept and dropped groups, the run of dropped groups and its likely cause, and
a batch's metrics (failed verifications out of the reward, the version-lag histogram)."""
import numpy as np
import pytest

from magistral_jax.generate.requests import Sample
from magistral_jax.pipeline.groups import GroupAssembler, batch_metrics
from magistral_jax.rewards.reward import RewardResult, empty_parts, failed_result
from magistral_jax.rl.advantages import ZERO_ADVANTAGE
from magistral_jax.rl.config import GRPOConfig


def _sample(gid, i, versions=(0, 0)):
  return Sample(gid, i, [1], [5] * len(versions), np.zeros(len(versions)), np.asarray(versions),
                "eos", {"problem": "p", "answer": "1"})


def _scored(reward, correct=None):
  parts = empty_parts(None if reward else "starts_with_think")
  if reward:
    parts.update(format=0.1, correct=0.9 if (correct if correct is not None else reward > 0.5)
                 else 0.0)
  return RewardResult(reward, parts)


def _assemble(groups, max_consecutive_dropped=0, versions=(0, 0)):
  """groups: one list of RewardResults per group; all added in order."""
  a = GroupAssembler(GRPOConfig(n_batch=4, n_mini=4, group_size=2), max_consecutive_dropped)
  for gid, results in enumerate(groups):
    a.open(gid, len(results))
    for i, r in reversed(list(enumerate(results))):   # arrival order is not sample order
      a.add(_sample(gid, i, versions), r)
  return a


def test_groups_are_kept_or_dropped_and_a_kept_group_ends_the_run_of_drops():
  a = _assemble([[_scored(0.0), _scored(0.0)], [_scored(1.0), _scored(0.1)],
                 [_scored(0.0), failed_result("verification timed out after 60s")],
                 [_scored(0.1), _scored(0.1)]])
  assert [g.group_id for g in a.ready] == [1]
  assert a.counters["groups_scored"] == 4 and a.counters["groups_dropped"] == 3
  assert a.counters["groups_verifier_error"] == 1 and a.counters["verifier_errors"] == 1
  assert a.streak.groups == 2 and not a.stalled()
  line = a.progress()
  assert line.startswith("4 groups scored since the last batch, 3 dropped (zero_advantage 2, "
                         "verifier_error 1), mean reward 0.186")   # 7 verified, 1.3 / 7
  batch = a.take(1, wait_s=0.0)
  assert [g.group_id for g in batch.groups] == [1] and len(batch.dropped) == 3
  assert a.window == [] and a.progress().startswith("0 groups scored since the last batch")


@pytest.mark.parametrize("groups, cause", [
    ([[_scored(0.0)] * 2] * 3,
     "no completion met the format in the last 3 groups (format rate 0; failed conditions: "
     "starts_with_think 6)"),
    ([[failed_result("verifier worker died (exit code -9)")] * 2] * 3,
     "every one of the last 3 groups had a failed verification (verifier fault: verifier worker "
     "died"),
    ([[failed_result("bad task or response: KeyError: 'answer'")] * 2] * 3,
     "every one of the last 3 groups had a failed verification (bad task: "),
    ([[_scored(0.1)] * 2] * 3, "no completion was correct in the last 3 groups (format rate 1.00)"),
    ([[_scored(1.0)] * 2] * 3, "every completion was correct in the last 3 groups"),
])
def test_a_run_of_dropped_groups_names_its_likely_cause(groups, cause):
  a = _assemble(groups, max_consecutive_dropped=3)
  assert a.stalled()
  assert a.streak.cause().startswith(cause)
  assert not _assemble(groups, max_consecutive_dropped=0).stalled()   # 0: the check is off


def test_batch_metrics_leave_failed_verifications_out_and_record_the_version_lag_histogram():
  # Trained at version 4: tokens sampled at 4, 3, 2, 1, 0 lag 0..4 versions.
  a = _assemble([[_scored(1.0), _scored(0.1)], [_scored(1.0), failed_result("worker died")]],
                versions=(4, 4, 3, 2, 1, 0, 0, 0))
  batch = a.take(1, wait_s=0.0)
  m = batch_metrics(batch, trained_version=4)
  assert m["reward"] == pytest.approx((1.0 + 0.1 + 1.0) / 3)   # not (.. + 0) / 4
  assert m["groups_verifier_error"] == 1 and m["groups_zero_advantage"] == 0
  assert m["groups_scored"] == 2 and m["filtered_group_frac"] == 0.5
  assert [m[f"version_lag_hist_{k}"] for k in ("0", "1", "2", "3plus")] == [0.25, 0.125, 0.125,
                                                                            0.5]
  assert m["version_lag_max"] == 4 and m["versions_in_batch"] == 5


def test_batch_metrics_count_every_drop_reason_per_batch():
  a = _assemble([[_scored(1.0), _scored(0.1)], [_scored(0.0), _scored(0.0)]])
  batch = a.take(1, wait_s=0.0)
  assert [g.dropped for g in batch.dropped] == [ZERO_ADVANTAGE]
  m = batch_metrics(batch, trained_version=0)
  # Every reason every batch, zeros included: stable JSONL columns.
  assert {k: m[k] for k in m if k.startswith("groups_")} == {
      "groups_scored": 2.0, "groups_zero_advantage": 1.0, "groups_length_only": 0.0,
      "groups_verifier_error": 0.0}
