"""Rollouts around scripted generators (no model): a failed verification drops its group, the
default off-policy bound is the paper's n_async, and a batch that cannot form says so early."""
import concurrent.futures
import dataclasses
import itertools
import logging
import os
import queue
import re
import signal
import threading
import time
import types

import numpy as np
import pytest

from magistral_jax.generate.counters import LoopCounters
from magistral_jax.generate.requests import Sample
from magistral_jax.model.char_tokenizer import char_tokenizer
from magistral_jax.pipeline.config import PipelineConfig
from magistral_jax.pipeline.errors import PipelineError
from magistral_jax.pipeline.rollouts import Rollouts
from magistral_jax.rewards.config import RewardConfig
from magistral_jax.rewards.reward import compute_reward
from magistral_jax.rl.advantages import VERIFIER_ERROR, ZERO_ADVANTAGE
from magistral_jax.rl.config import GRPOConfig
from magistral_jax.verify.pool import VerifierPool

GRPO = GRPOConfig(n_batch=8, n_mini=8, group_size=4)
REWARD = RewardConfig(language_bonus=0.0, test_timeout_s=10.0, math_timeout_s=2)
TOK = char_tokenizer()


def math_task(i):
  return {"id": f"m{i}", "kind": "math", "problem": f"{i} + 1?", "answer": str(i + 1)}


def right_or_wrong(task, index):
  """Samples 0 and 2 answer right, 1 and 3 wrong: every group carries a signal."""
  answer = int(task.get("answer", 0)) + index % 2
  return f"<think>\nadd one\n</think>\n\\boxed{{{answer}}}"


class ScriptedGenerator:
  """Stands in for a GeneratorLoop: answers each request's G samples with `respond(task, index)`,
  on its own thread, `delay_s` per request."""

  def __init__(self, respond, delay_s=0.0):
    self.respond, self.delay_s = respond, delay_s
    self.callback = None
    # Limits well inside a row of GRPO's microbatches (Rollouts checks them).
    self.engine = types.SimpleNamespace(max_concurrent_decodes=8, max_prefill_length=64,
                                        max_decode_length=64)
    self.counters = LoopCounters()
    self._requests, self._stop, self._thread = queue.Queue(), threading.Event(), None

  def start(self):
    self._thread = threading.Thread(target=self._run, daemon=True)
    self._thread.start()

  def submit(self, request):
    self._requests.put(request)

  def check(self):
    pass

  def stop(self, timeout=None):
    self._stop.set()
    self._thread.join(timeout)

  def _run(self):
    while not self._stop.is_set():
      try:
        r = self._requests.get(timeout=0.01)
      except queue.Empty:
        continue
      time.sleep(self.delay_s)
      self._answer(r)

  def _answer(self, r):
    for i in range(r.group_size):
      tokens = TOK.encode(self.respond(r.metadata, i))
      self.callback(Sample(r.id, i, list(r.prompt_tokens), tokens, np.zeros(len(tokens)),
                           np.zeros(len(tokens), np.int32), "eos", r.metadata))


class InlinePool:
  """Scores in the submitting thread (the reward is the real one, without math-verify's SIGALRM
  timeout, which works only on a main thread); `answer=False`: never answers."""

  def __init__(self, answer=True):
    self.answer = answer

  def submit(self, task, response, tokens, seed):
    fut = concurrent.futures.Future()
    if self.answer:
      fut.set_result(compute_reward(task, response, tokens,
                                    dataclasses.replace(REWARD, math_timeout_s=0), seed))
    return fut


def rollouts(respond, pool, prompts=None, delay_s=0.0, **pipeline):
  return Rollouts(generators=[ScriptedGenerator(respond, delay_s)], pool=pool, tokenizer=TOK,
                  prompts=prompts or map(math_task, itertools.count()), grpo_cfg=GRPO,
                  cfg=PipelineConfig(**pipeline))


def test_sync_mode_replaces_a_dropped_group_while_the_others_still_generate():
  # Group 0 is slow, group 1 is dropped at once (all four answers wrong: no advantage). Its
  # replacement, group 2, must be submitted while group 0 still generates, not after it: a
  # generator that answers each request on its own thread (like slots) holds group 0 back until
  # group 2 arrives, or 10 s.
  arrived = threading.Event()
  held = []

  class Slots(ScriptedGenerator):
    def start(self):
      pass

    def stop(self, timeout=None):
      pass

    def submit(self, r):
      if r.id == 2:
        arrived.set()
      threading.Thread(target=self._hold_then_answer, args=(r,), daemon=True).start()

    def _hold_then_answer(self, r):
      if r.id == 0:
        held.append(arrived.wait(10.0))
      self._answer(r)

  def respond(task, index):
    return right_or_wrong(task, 1 if task["id"] == "m1" else index)

  pipe = Rollouts(generators=[Slots(respond)], pool=InlinePool(), tokenizer=TOK,
                  prompts=map(math_task, itertools.count()), grpo_cfg=GRPO,
                  cfg=PipelineConfig(mode="sync"))
  with pipe:
    batch = pipe.next_batch()
  assert held == [True]
  assert sorted(g.group_id for g in batch.groups) == [0, 2]
  assert [(g.group_id, g.dropped) for g in batch.dropped] == [(1, ZERO_ADVANTAGE)]


def test_a_crashed_verifier_worker_drops_its_group_instead_of_scoring_it_zero(caplog):
  # Group 0 is a code task; its sample 0 is a correct program that takes 3 s, and the verifier
  # worker scoring it is killed meanwhile. Its 3 other samples score 1.0, 0.1, 0.1: scored 0, the
  # crashed one would have been trained on as a wrong answer.
  code = {"id": "c0", "kind": "code", "problem": "Double it.", "language": "python",
          "tests": [{"input": "1\n", "output": "2\n"}]}
  programs = ["import time\ntime.sleep(3)\nprint(2 * int(input()))", "print(2 * int(input()))",
              "print(3)", "print(3)"]

  def respond(task, index):
    if task["kind"] == "code":
      return f"<think>\nx\n</think>\n```python\n{programs[index]}\n```"
    return right_or_wrong(task, index)

  with VerifierPool(1, REWARD, task_timeout_s=30) as pool:
    pipe = rollouts(respond, pool, itertools.chain([code], map(math_task, itertools.count())))

    def crash_the_busy_worker():
      deadline = time.monotonic() + 60
      while time.monotonic() < deadline:
        busy = [w for w in pool._workers if w.tid is not None]
        if busy:
          os.kill(busy[0].proc.pid, signal.SIGKILL)
          return
        time.sleep(0.01)
    killer = threading.Thread(target=crash_the_busy_worker)
    killer.start()
    batches = []
    with caplog.at_level(logging.WARNING), pipe:
      # Group 0 is scored after the worker restarts, maybe after the first batch filled.
      while len(batches) < 4 and not any(g.group_id == 0 for b in batches for g in b.dropped):
        batches.append(pipe.next_batch())
        pipe.done(batches[-1])
    killer.join()
    assert pool.metrics()["crashes"] == 1
  assert 0 not in [g.group_id for b in batches for g in b.groups]
  batch = batches[-1]
  crashed = next(g for g in batch.dropped if g.group_id == 0)
  assert crashed.dropped == VERIFIER_ERROR and "died" in crashed.results[0].error
  m = pipe.metrics(batch, trained_version=0)
  assert m["groups_verifier_error"] == 1 and pipe.counters["groups_verifier_error"] == 1
  # Its completions scored by the verifiers still count in the reward; the crashed one does not.
  assert m["reward"] == pytest.approx(np.mean(
      [r.reward for g in batch.groups + batch.dropped for r in g.results if not r.error]))
  assert any("group 0 dropped, not trained on: 1 of 4 completions failed verification "
             "(verifier fault: verifier worker died" in r.getMessage() for r in caplog.records)


def test_a_task_the_verifier_cannot_read_drops_its_group_with_its_own_message(caplog):
  tasks = itertools.chain([{"id": "bad", "kind": "math", "problem": "no answer"}],
                          map(math_task, itertools.count()))
  pipe = rollouts(right_or_wrong, InlinePool(), tasks)
  with caplog.at_level(logging.WARNING), pipe:
    batch = pipe.next_batch()
  assert [(g.group_id, g.dropped) for g in batch.dropped] == [(0, VERIFIER_ERROR)]
  assert any("group 0 dropped, not trained on: 4 of 4 completions failed verification (bad task"
             in r.getMessage() for r in caplog.records)


def test_a_closed_verifier_pool_drops_every_group_and_stops_the_run_naming_it():
  class ClosedPool:
    def submit(self, *args):
      raise RuntimeError("VerifierPool is closed")

  pipe = rollouts(right_or_wrong, ClosedPool(), max_consecutive_dropped=8)
  # Several groups may be scored in one drain, so the streak can pass 8 before the check sees it.
  with pipe, pytest.raises(PipelineError, match=r"every one of the last \d+ groups had a failed "
                           r"verification \(verifier fault: verifier submit failed: VerifierPool "
                           r"is closed\)"):
    pipe.next_batch()
  assert pipe.counters["groups_verifier_error"] == pipe.counters["groups_scored"] >= 8


def test_untrained_completions_never_exceed_n_async_by_default():
  # The trainer holds its batch and takes no other: generation runs ahead only up to the bound.
  for max_queue, bound in [(0, 16), (8, 24)]:   # the paper's n_async; loosened by max_queue
    pipe = rollouts(right_or_wrong, InlinePool(), n_async=16, max_queue=max_queue)
    with pipe:
      batch = pipe.next_batch()
      deadline = time.time() + 10
      while pipe._generating + pipe._queued < bound and time.time() < deadline:
        time.sleep(0.01)
      time.sleep(0.3)   # room for the feeder to overshoot, were it allowed to
      assert pipe._generating + pipe._queued == pipe.max_inflight == bound
      pipe.done(batch)
      pipe.next_batch()
    assert pipe.max_inflight == bound and pipe.max_generating <= 16


def test_a_policy_that_never_meets_the_format_stops_the_run_early_and_says_why(caplog):
  # The reported stall: a random-init policy never writes the format, every reward is 0 and every
  # group is dropped. The run logs its progress while it waits and stops after 24 such groups,
  # long before the batch timeout, naming the cause and showing a completion.
  pipe = rollouts(lambda task, i: f"no think tags here {i}", InlinePool(), delay_s=0.03,
                  max_consecutive_dropped=24, wait_log_s=0.1, batch_timeout_s=60)
  t = time.time()
  with caplog.at_level(logging.INFO), pipe, pytest.raises(PipelineError) as e:
    pipe.next_batch()
  assert time.time() - t < 30
  msg = str(e.value)
  # At least 24: several groups may be scored in one drain before the check sees the streak.
  m = re.search(r"no completion met the format in the last (\d+) groups \(format rate 0; failed "
                r"conditions: starts_with_think (\d+)\)", msg)
  assert m and int(m[1]) >= 24 and int(m[2]) == 4 * int(m[1]), msg
  assert "max_consecutive_dropped=24" in msg and "no think tags here" in msg
  waiting = [r.getMessage() for r in caplog.records if r.getMessage().startswith("waiting")]
  assert waiting, "no progress line while the batch waited"
  assert ("dropped (zero_advantage" in waiting[-1] and "mean reward 0.000, format rate 0.00"
          in waiting[-1])
  assert any("reward=0.000 (format failed: starts_with_think)" in r.getMessage()
             for r in caplog.records)


def test_batch_timeout_fires_when_the_verifiers_never_answer():
  pipe = rollouts(right_or_wrong, InlinePool(answer=False), batch_timeout_s=1.0)
  t = time.time()
  with pytest.raises(PipelineError, match=r"batch did not fill in 1.0s: 0/2 groups ready"):
    with pipe:
      pipe.next_batch()
  assert time.time() - t < 15   # the timeout and a clean close, no hang
  assert not any(th.is_alive() for th in pipe._threads)


class RefusingGenerator(ScriptedGenerator):
  """Refuses prompts longer than its prefill limit at submit, as GeneratorLoop.submit does."""

  def submit(self, request):
    if len(request.prompt_tokens) > self.engine.max_prefill_length:
      raise ValueError(f"request {request.id!r}: prompt of {len(request.prompt_tokens)} tokens "
                       f"> max_prefill_length={self.engine.max_prefill_length}")
    super().submit(request)


def test_a_prompt_the_generators_refuse_is_skipped_and_the_run_goes_on(caplog):
  """One over-long problem (a malformed row, a prompt past max_prefill_length) is skipped and
  logged; the feeder keeps feeding and the batch forms from the others."""
  def tasks():
    for i in itertools.count():
      t = math_task(i)
      if i % 5 == 2:
        t["problem"] = "x" * 200   # past the generator's 64-token prefill limit
      yield t
  pipe = Rollouts(generators=[RefusingGenerator(right_or_wrong)], pool=InlinePool(),
                  tokenizer=TOK, prompts=tasks(), grpo_cfg=GRPO,
                  cfg=PipelineConfig(n_async=16))
  with caplog.at_level(logging.WARNING), pipe:
    batch = pipe.next_batch()
    pipe.done(batch)
    batch = pipe.next_batch()
  assert len(batch.groups) == GRPO.n_batch // GRPO.group_size
  assert all(len(g.info[0].metadata["problem"]) < 64 for g in batch.groups)
  assert pipe.counters["prompts_skipped"] >= 1
  assert "skipping a problem the generators refuse" in caplog.text
  assert not pipe._errors


class LosingGenerator(ScriptedGenerator):
  """A generator process that dies: it answers `answer_before_loss` samples of its first request,
  then stops serving (as a RemoteGenerator whose process died) and never answers again, until
  `rejoin()` (a relaunched process)."""

  def __init__(self, respond, answer_before_loss=2):
    super().__init__(respond)
    self.serving, self.lost_reason, self.name = True, None, "generator 1 (process 3)"
    self.answer_before_loss, self.requests = answer_before_loss, []

  def rejoin(self):
    self.serving, self.lost_reason = True, None

  def _answer(self, r):
    self.requests.append(r)
    if not self.serving:
      return
    if len(self.requests) == 1:
      for i in range(self.answer_before_loss):
        tokens = TOK.encode(self.respond(r.metadata, i))
        self.callback(Sample(r.id, i, list(r.prompt_tokens), tokens, np.zeros(len(tokens)),
                             np.zeros(len(tokens), np.int32), "eos", r.metadata))
      self.serving, self.lost_reason = False, "stopped sending heartbeats 10s ago"
      return
    super()._answer(r)


def _two_generators(lost, **pipeline):
  return Rollouts(generators=[ScriptedGenerator(right_or_wrong, 0.01), lost], pool=InlinePool(),
                  tokenizer=TOK, prompts=map(math_task, itertools.count()), grpo_cfg=GRPO,
                  cfg=PipelineConfig(**pipeline))


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_lost_generators_groups_go_to_the_others_none_lost_none_twice(mode, caplog):
  lost = LosingGenerator(right_or_wrong)
  with caplog.at_level(logging.WARNING), _two_generators(lost, mode=mode) as r:
    tasks = []
    for _ in range(4):
      batch = r.next_batch()
      tasks += [g.info[0].metadata["id"] for g in batch.groups]
      # Every group of a batch is whole, and from one generator's G samples.
      assert all(len(g.completions) == GRPO.group_size for g in batch.groups)
      r.done(batch)
    first = lost.requests[0].metadata["id"]
    assert first in tasks   # its prompt was generated again, by the other generator
    assert len(tasks) == len(set(tasks))   # and no prompt was trained on twice
    assert r.counters["groups_reassigned"] >= 1
    assert len(lost.requests) == 1 or not lost.serving   # no request once lost
    # The in-flight accounting is whole again: what the lost generator had returned is released.
    assert r._generating >= 0 and r._queued >= 0
    assert r._generating + r._queued <= r.n_async + r.max_queue
  assert "generator 1 lost (stopped sending heartbeats 10s ago)" in caplog.text


def test_a_rejoined_generator_takes_requests_again():
  lost = LosingGenerator(right_or_wrong)
  with _two_generators(lost) as r:
    r.done(r.next_batch())
    assert not lost.serving
    n = len(lost.requests)
    lost.rejoin()
    for _ in range(3):
      r.done(r.next_batch())
    assert len(lost.requests) > n


def test_with_every_generator_lost_the_run_waits_then_stops_naming_them():
  lost = LosingGenerator(right_or_wrong)
  r = Rollouts(generators=[lost], pool=InlinePool(), tokenizer=TOK,
               prompts=map(math_task, itertools.count()), grpo_cfg=GRPO,
               cfg=PipelineConfig(generator_rejoin_s=1.0))
  t = time.time()
  with r, pytest.raises(PipelineError, match=r"every generator was lost and none rejoined in 1s"
                        r".*generator 1 \(process 3\): stopped sending heartbeats"):
    r.next_batch()
  assert time.time() - t < 30


class ScoringGenerator(ScriptedGenerator):
  """A generator process that scores its own samples (verifier.placement="generators"): each
  comes back with its RewardResult, and the leader's pool is never asked."""

  def _answer(self, r):
    for i in range(r.group_size):
      text = self.respond(r.metadata, i)
      tokens = TOK.encode(text)
      result = compute_reward(r.metadata, text, len(tokens),
                              dataclasses.replace(REWARD, math_timeout_s=0), r.id)
      self.callback(Sample(r.id, i, list(r.prompt_tokens), tokens, np.zeros(len(tokens)),
                           np.zeros(len(tokens), np.int32), "eos", r.metadata), result)


def test_samples_scored_by_their_generator_process_skip_the_leaders_pool():
  class NoPool:
    def submit(self, *args):
      raise AssertionError("the leader's pool was asked")

  r = Rollouts(generators=[ScoringGenerator(right_or_wrong)], pool=NoPool(), tokenizer=TOK,
               prompts=map(math_task, itertools.count()), grpo_cfg=GRPO)
  with r:
    batch = r.next_batch()
  rewards = [res.reward for g in batch.groups for res in g.results]
  assert len(rewards) == GRPO.n_batch and set(rewards) == {0.1, 1.0}   # wrong, right answers


class CountedPrompts:
  """math_task(0), math_task(1), ... from `start`, with the state a checkpoint keeps."""

  def __init__(self, start=0):
    self.consumed = start

  def __iter__(self):
    return self

  def __next__(self):
    self.consumed += 1
    return math_task(self.consumed - 1)

  def state(self):
    return {"consumed": self.consumed}


def test_a_resumed_run_draws_the_prompts_and_seeds_after_its_checkpoints():
  def run(batches, start=0, seeds_drawn=0):
    drawn, gen = [], ScriptedGenerator(right_or_wrong)
    submit = gen.submit
    gen.submit = lambda r: (drawn.append((r.metadata["id"], r.seed)), submit(r))
    pipe = Rollouts(generators=[gen], pool=InlinePool(), tokenizer=TOK,
                    prompts=CountedPrompts(start), grpo_cfg=GRPO, seeds_drawn=seeds_drawn,
                    seed=7, cfg=PipelineConfig(mode="sync"))
    with pipe:
      states = []
      for _ in range(batches):
        pipe.next_batch()
        states.append(pipe.stream_state())
    return drawn, states

  whole, states = run(2)
  data, rng = states[0]   # what the checkpoint after batch 1 holds
  assert rng["seeds_drawn"] == data["consumed"] >= 2 and len(whole) > rng["seeds_drawn"]
  resumed, _ = run(1, data["consumed"], rng["seeds_drawn"])
  n = rng["seeds_drawn"]
  assert resumed == whole[n:n + len(resumed)]
  # Negative control: a stream started again from its seed gives the first batch's seeds again.
  restarted, _ = run(1, data["consumed"])
  assert [s for _, s in restarted] == [s for _, s in whole[:len(restarted)]]
  assert [s for _, s in restarted] != [s for _, s in resumed]
