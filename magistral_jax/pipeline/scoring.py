"""Scoring generated samples (Rollouts' collector thread): each sample a generator returns goes
to the verifier pool (CPU processes), unless its generator process scored it already
(verifier.placement="generators"), and its RewardResult lands in one queue, which the trainer's
thread drains into groups (pipeline.groups). A verification that fails, or a pool that refuses
a sample, gives a failed result: its group is dropped and the run goes on.
"""
from __future__ import annotations

import collections
import queue
import time
from concurrent.futures import Future

import numpy as np

from magistral_jax.generate.requests import Sample
from magistral_jax.rewards.reward import RewardResult, failed_result


def settled(future: Future) -> RewardResult:
  """A verification's result; a failed result if the future raised (the pool resolves failures
  itself: this is a last resort)."""
  try:
    return future.result()
  except Exception as e:
    return failed_result(f"verifier failed: {type(e).__name__}: {e}")


class Scoring:
  """The scored samples (`scored`: a queue of (Sample, RewardResult)) and the verifiers'
  latencies. pool: a VerifierPool (submit(task, response, tokens, seed) -> Future);
  tokenizer: its decode gives the response text the verifier reads."""

  def __init__(self, pool, tokenizer):
    self.pool, self.tokenizer = pool, tokenizer
    self.scored: queue.Queue[tuple[Sample, RewardResult]] = queue.Queue()
    self._latencies: collections.deque[float] = collections.deque(maxlen=1000)

  def submit(self, sample: Sample, result: RewardResult | None = None) -> None:
    """`sample` to the verifier pool, or with its `result` (scored by its generator process)
    straight to `scored`."""
    if result is not None:
      self.scored.put((sample, result))
      return
    response = sample.graded(self.tokenizer.decode)
    t_submit = time.time()
    try:
      # The length penalty counts the policy's tokens: a tool's results are not its length.
      fut = self.pool.submit(sample.metadata, response, sample.num_policy_tokens,
                             int(sample.request_id))
    except Exception as e:   # a closed or broken pool: its group is dropped, the run goes on
      self.scored.put((sample, failed_result(f"verifier submit failed: {e}")))
      return

    def done(f):
      res = settled(f)
      self._latencies.append(time.time() - t_submit)
      self.scored.put((sample, res))
    fut.add_done_callback(done)

  def latency_s(self) -> float:
    """The mean latency of the last verifications (submit to result), in seconds."""
    lat = list(self._latencies)
    return float(np.mean(lat)) if lat else 0.0
