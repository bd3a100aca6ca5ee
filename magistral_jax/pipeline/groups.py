"""Group assembly: a prompt's G scored samples become one group, scored once when its last sample
is (rl.advantages.score_group), then kept for a batch or dropped with its reason; a batch's
metrics; and what the run says while the trainer waits for a batch.

A run whose groups are all dropped can never form a batch. Two things say so long before the
batch timeout does: a progress line while the trainer waits (`GroupAssembler.progress`: groups
scored and dropped, mean reward, format rate), and a stop once the last `max_consecutive_dropped`
groups in a row were all dropped, naming the likely cause (`DropStreak.cause`).

Everything here runs on the trainer's thread (Rollouts.next_batch).
"""
from __future__ import annotations

import collections
import dataclasses
import logging
from typing import Callable, Sequence

import numpy as np

from magistral_jax.generate.requests import Sample
from magistral_jax.pipeline.errors import PipelineError
from magistral_jax.rewards.reward import BAD_TASK, RewardResult, reward_metrics
from magistral_jax.rl.advantages import DROP_REASONS, VERIFIER_ERROR, ScoredGroup, score_group
from magistral_jax.rl.collate import Completion
from magistral_jax.rl.config import GRPOConfig
from magistral_jax.tool_use.protocol import open_call, void_trajectory

log = logging.getLogger(__name__)

# Per batch, the share of trained tokens sampled 0, 1, .. versions behind the first optimizer step
# on them: version_lag_hist_0 .. _{N-1}, and version_lag_hist_{N}plus for the rest.
VERSION_LAG_BUCKETS = 3


@dataclasses.dataclass
class RolloutBatch:
  """n_batch completions for the trainer: kept groups in group-id order, plus the groups dropped
  since the previous batch (for metrics: every scored group is counted once), and how long the
  trainer waited for it."""
  groups: list[ScoredGroup]
  dropped: list[ScoredGroup]
  wait_s: float


def fault_kind(error: str) -> str:
  """'bad task' for a task the verifier could not read, else 'verifier fault'."""
  return "bad task" if error.startswith(BAD_TASK) else "verifier fault"


def _counts(counter: collections.Counter) -> str:
  return ", ".join(f"{k} {v}" for k, v in counter.most_common()) or "none"


def verified(groups: Sequence[ScoredGroup]) -> list[RewardResult]:
  """The groups' reward results whose verification succeeded: a failed one is no reward."""
  return [r for g in groups for r in g.results if not r.error]


def describe(sample: Sample, result: RewardResult, decode: Callable[[Sequence[int]], str],
             max_chars: int | None = None) -> str:
  """A completion, decoded, with its task and its reward (and why it got 0, if it did)."""
  task = sample.metadata or {}
  text = decode(sample.tokens)
  if max_chars is not None and len(text) > max_chars:
    text = f"{text[:max_chars]} [... {len(text) - max_chars} more characters]"
  why = (f" (verification failed: {result.error[:300]})" if result.error else
         f" (format failed: {result.parts['failed_condition']})"
         if result.parts.get("failed_condition") else "")
  return (f"problem: {task.get('problem', '?')}\nreference: {task.get('answer', '?')}\n"
          f"reward={result.reward:.3f}{why} policy versions {min(sample.versions, default=-1)}"
          f"..{max(sample.versions, default=-1)}"
          f"{f', tool calls {sample.num_tool_results}' if sample.num_tool_results else ''}\n{text}")


def last_turn(sample: Sample) -> list[int]:
  """A sample's tokens after its last tool result (all of them, with no result)."""
  if sample.tool_mask is None:
    return sample.tokens
  n = int(np.argmax(np.asarray(sample.tool_mask, bool)[::-1]))
  return sample.tokens[len(sample.tokens) - n:] if n else []


def shown(batch: RolloutBatch) -> tuple[Sample, RewardResult]:
  """The batch's completion samples.jsonl shows: its first that called a tool (the whole
  transcript, results included), else its first."""
  pairs = [(s, r) for g in batch.groups for s, r in zip(g.info, g.results)]
  return next((p for p in pairs if p[0].num_tool_results), pairs[0])


@dataclasses.dataclass
class DropStreak:
  """The groups dropped in a row, in the order they were scored, summed up in constant memory:
  what the stop message needs to name a likely cause."""
  groups: int = 0
  completions: int = 0     # whose verification succeeded
  formatted: int = 0
  correct: int = 0
  reasons: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  failed_conditions: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  first_error: str | None = None
  example: tuple[Sample, RewardResult] | None = None   # the latest group's first completion

  def add(self, group: ScoredGroup):
    self.groups += 1
    self.reasons[group.dropped] += 1
    for r in group.results:
      if r.error:
        self.first_error = self.first_error or r.error
        continue
      self.completions += 1
      self.formatted += (r.parts.get("format") or 0.0) > 0
      self.correct += (r.parts.get("correct") or 0.0) > 0
      if r.parts.get("failed_condition"):
        self.failed_conditions[r.parts["failed_condition"]] += 1
    if group.info:
      self.example = (group.info[0], group.results[0])

  def cause(self) -> str:
    """The likely reason no group carries a signal, in the user's terms."""
    n = self.groups
    if self.completions == 0:
      return (f"every one of the last {n} groups had a failed verification "
              f"({fault_kind(self.first_error or '')}: {(self.first_error or '?')[:300]}): check "
              "the verifier pool (verifier.num_workers, verifier.task_timeout_s) and the tasks")
    if self.formatted == 0:
      return (f"no completion met the format in the last {n} groups (format rate 0; failed "
              f"conditions: {_counts(self.failed_conditions)}): the policy does not write the "
              "response format the reward asks for (paper §2: <think>...</think>, then a \\boxed{} "
              "answer or a code block). Check the system prompt and the tokenizer's chat "
              "template, or start from a model that follows the format (cold-start SFT)")
    if self.correct == self.completions:
      return (f"every completion was correct in the last {n} groups: the problems are too easy "
              "for the policy")
    if self.correct == 0:
      return (f"no completion was correct in the last {n} groups (format rate "
              f"{self.formatted / self.completions:.2f}): the problems are too hard for the "
              "policy, or its answers never match the references")
    return f"the last {n} groups were all dropped ({_counts(self.reasons)})"


class _Pending:
  """A submitted prompt whose G samples are coming back from the verifiers."""

  def __init__(self, gid: int, size: int):
    self.gid, self.size = gid, size
    self.scored: list[tuple[Sample, RewardResult]] = []


class GroupAssembler:
  """Scored samples -> scored groups -> `ready` (kept) or dropped; `take` hands out a batch.

  max_consecutive_dropped: `stalled()` once this many groups in a row were dropped (0: never).
  decode: a sample's tokens -> its text, to find multi-turn samples with a void turn
    (GRPOConfig.drop_void_turns); None: none is looked for.
  """

  def __init__(self, grpo_cfg: GRPOConfig, max_consecutive_dropped: int = 0,
               decode: Callable[[Sequence[int]], str] | None = None):
    self.grpo_cfg = grpo_cfg
    self.max_consecutive_dropped = max_consecutive_dropped
    self.decode = decode if grpo_cfg.drop_void_turns else None
    self.pending: dict[int, _Pending] = {}
    self.ready: collections.deque[ScoredGroup] = collections.deque()
    self.window: list[ScoredGroup] = []   # every group scored since the last batch
    self.counters = collections.Counter()
    self.streak = DropStreak()

  def open(self, gid: int, size: int):
    self.pending[gid] = _Pending(gid, size)

  def add(self, sample: Sample, result: RewardResult) -> ScoredGroup | None:
    """One scored sample; returns its group once the group's last sample is in (then scored)."""
    if result.error:
      self.counters["verifier_errors"] += 1
    p = self.pending[int(sample.request_id)]
    p.scored.append((sample, result))
    if len(p.scored) < p.size:
      return None
    del self.pending[p.gid]
    # Arrival order depends on thread timing; sample order does not.
    p.scored.sort(key=lambda m: m[0].sample_index)
    samples = [s for s, _ in p.scored]
    completions = [Completion(s.prompt_tokens, s.tokens, s.logprobs, action_mask=s.action_mask,
                              trained=not self._void(s)) for s in samples]
    group = score_group(p.gid, completions, [r for _, r in p.scored], self.grpo_cfg, info=samples)
    self.counters["groups_scored"] += 1
    self.window.append(group)
    if not group.dropped:
      self.ready.append(group)
      self.streak = DropStreak()
      return group
    self.counters["groups_dropped"] += 1
    self.counters[f"groups_{group.dropped}"] += 1
    self.streak.add(group)
    if group.dropped == VERIFIER_ERROR:
      errors = [r.error for r in group.results if r.error]
      log.warning("group %d dropped, not trained on: %d of %d completions failed verification "
                  "(%s: %s)", p.gid, len(errors), len(group.results), fault_kind(errors[0]),
                  errors[0][:300])
    return group

  def _void(self, sample: Sample) -> bool:
    """A multi-turn sample with a void turn, when those are looked for (counted)."""
    void = bool(self.decode and sample.num_tool_results
                and void_trajectory(sample.graded(self.decode)))
    self.counters["void_turn_samples"] += void
    return void

  def take(self, need: int, wait_s: float) -> RolloutBatch:
    """The first `need` ready groups, and the groups dropped since the last batch."""
    groups = [self.ready.popleft() for _ in range(need)]
    window, self.window = self.window, []
    return RolloutBatch(sorted(groups, key=lambda g: g.group_id),
                        [g for g in window if g.dropped], wait_s)

  def stalled(self) -> bool:
    return 0 < self.max_consecutive_dropped <= self.streak.groups

  def stall_error(self, decode: Callable[[Sequence[int]], str]) -> PipelineError:
    """Why the run stops once `stalled()`: the likely cause (DropStreak.cause) and a completion
    of the last dropped group (logged in full; `decode` gives its text)."""
    streak, sample = self.streak, ""
    if streak.example is not None:
      log.warning("a completion of the last dropped group:\n%s",
                  describe(*streak.example, decode))
      sample = ("\nA completion of the last dropped group (in full in the log above):\n"
                + describe(*streak.example, decode, max_chars=500))
    return PipelineError(f"{streak.cause()}.\nStopping: the last {streak.groups} scored groups "
                         f"were all dropped, so no batch can form (pipeline."
                         f"max_consecutive_dropped={self.max_consecutive_dropped}; 0 turns this "
                         f"check off).{sample}")

  def progress(self) -> str:
    """Since the last batch: groups scored and dropped (by reason), mean reward, format rate."""
    dropped = collections.Counter(g.dropped for g in self.window if g.dropped)
    m = reward_metrics(verified(self.window))
    rewards = (f", mean reward {m['reward']:.3f}, format rate {m['format_rate']:.2f}, accuracy "
               f"{m['accuracy']:.2f}" if m else "")
    return (f"{len(self.window)} groups scored since the last batch, {sum(dropped.values())} "
            f"dropped ({_counts(dropped)}){rewards}; {self.streak.groups} dropped in a row")


def batch_metrics(batch: RolloutBatch, trained_version: int,
                  decode: Callable[[Sequence[int]], str] | None = None) -> dict:
  """The batch's reward, drop and off-policy metrics. `trained_version`: the policy version of the
  batch's first optimizer step. `decode` (tokens -> text): also the share of samples cut off by
  the token budget in the middle of a tool call (reported once any sample is multi-turn or cut
  there)."""
  window = batch.groups + batch.dropped
  out = reward_metrics(verified(window))
  out["filtered_group_frac"] = float(np.mean([bool(g.dropped) for g in window]))
  out["groups_scored"] = float(len(window))
  for reason in DROP_REASONS:
    out[f"groups_{reason}"] = float(sum(g.dropped == reason for g in window))
  samples = [s for g in window for s in g.info]
  lens = np.asarray([len(s.tokens) for s in samples])
  out.update(response_length_mean=float(lens.mean()), response_length_max=float(lens.max()))
  if any(s.tool_mask is not None for s in samples):   # tool calls (generate/tool_turns.py)
    out.update(tool_calls_per_sample=float(np.mean([s.num_tool_results for s in samples])),
               tool_result_tokens_mean=float(np.mean([len(s.tokens) - s.num_policy_tokens
                                                      for s in samples])),
               # Kept groups' samples with a void turn, trained on nothing (drop_void_turns).
               void_turn_frac=float(np.mean([not c.trained for g in batch.groups
                                             for c in g.completions])))
  if decode is not None:   # each cut-off sample's last turn (after its last result) decoded
    cut = np.mean([s.finish_reason == "length" and open_call(decode(last_turn(s)))
                   for s in samples])
    if cut or "tool_calls_per_sample" in out:
      out["tool_call_cut_frac"] = float(cut)
  # Off-policy accounting: lag of every trained token behind the version that trains on it (a
  # tool's result tokens are not trained on).
  versions = np.concatenate([np.asarray(s.versions)[s.action_mask] if s.tool_mask is not None
                             else np.asarray(s.versions) for g in batch.groups for s in g.info])
  lag = trained_version - versions
  out.update(version_lag_max=float(lag.max()), version_lag_mean=float(lag.mean()),
             versions_in_batch=float(len(np.unique(versions))))
  for k in range(VERSION_LAG_BUCKETS):
    out[f"version_lag_hist_{k}"] = float(np.mean(lag == k))
  out[f"version_lag_hist_{VERSION_LAG_BUCKETS}plus"] = float(np.mean(lag >= VERSION_LAG_BUCKETS))
  return out
