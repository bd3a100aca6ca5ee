"""Rollouts: the generation side of paper §5, which yields scored groups and takes weight pushes.

    prompts -> feeder thread -> generators (own device slices, continuous batching, KV kept
    across weight updates) -> collector thread -> verifier pool (CPU processes) -> a group is
    scored when its last completion is (pipeline.groups, rl.advantages.score_group:
    Â = r − mean(r); dropped when it carries no signal or a verification failed) -> `next_batch()`
    hands n_batch completions of kept groups to the trainer -> `push(params, version)`: the
    trainer's params resharded device-to-device onto every generator after each optimizer step.

The optimizer loop itself is train/rl_loop.py; this module owns the threads and the queues. A
generator that stops serving (a lost generator process) has its open groups generated again by
the others: pipeline/lost_generators.py.

Async (the paper): generators never wait for the trainer. The off-policy bound is the paper's:
completions generated but not yet trained on never exceed `n_async` (paper §4: n_async / n_batch
<= 2). The feeder (never the generators) enforces it, counting
- generating: submitted to a generator and not yet returned by it (running in a slot or queued
  for one), and
- queued: returned but not yet consumed (being scored, waiting for the rest of their group, ready
  for a batch, or in the batch being trained on);
a prompt is submitted only while generating + queued + G stays within n_async + max_queue. The
default max_queue = 0 is the paper's bound; max_queue > 0 loosens it, letting generation run up to
max_queue completions further ahead of the trainer (more off-policy lag, fewer idle slots while
the trainer steps); generating alone never exceeds n_async. When the trainer falls behind,
generation stops running ahead.

A batch that cannot form says so: a progress line every `wait_log_s` while the trainer waits, a
stop naming the likely cause once `max_consecutive_dropped` groups in a row were dropped, and an
error after `batch_timeout_s`.

Sync (for comparison and ablations): the same code path with a barrier. Exactly enough groups for
one batch are in flight under one policy version (a dropped group is replaced as soon as it is
scored), every generation finishes, then the trainer runs and pushes, then generation resumes.
Tokens in a batch therefore all carry one version.

Colocated (`colocated=True`, config devices.colocated): the generators run on the trainer's own
devices, for a run on one GPU or one TPU VM whose chips should not be split; in sync mode
generation and training take turns, in async mode generation runs one batch ahead, bounded by
n_async as across devices (pipeline.schedule says what each keeps in memory). The trainer
reports `memory/train_peak_bytes` in every layout (train.rl_loop.Trainer).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
import traceback
from typing import Iterator, Sequence

import numpy as np

from magistral_jax.generate.protocol import Generator
from magistral_jax.generate.requests import Request, Sample
from magistral_jax.pipeline.config import PipelineConfig
from magistral_jax.pipeline.errors import PipelineError
from magistral_jax.pipeline.generator_meter import GeneratorMeter
from magistral_jax.pipeline.groups import (GroupAssembler, RolloutBatch, batch_metrics, describe,
                                           shown)
from magistral_jax.pipeline.lost_generators import LostGenerators
from magistral_jax.pipeline.schedule import schedule_for
from magistral_jax.pipeline.scoring import Scoring
from magistral_jax.pipeline.seeded_prompts import SeededPrompts
from magistral_jax.rewards.reward import RewardResult
from magistral_jax.rl.config import GRPOConfig
from magistral_jax.rl.minibatch import Minibatch, make_minibatches

log = logging.getLogger(__name__)

# Set by a Ctrl-C handler (launch/train.py). Python raises KeyboardInterrupt at whatever bytecode
# the main thread is on, and one raised inside a finalizer (an array's __del__ during garbage
# collection) is printed and dropped; the batch wait checks this flag, so the run still stops.
INTERRUPTED = threading.Event()


class Rollouts(LostGenerators):
  """Generators + verifier pool + group scoring. See the module docstring.

  Args:
    generators: one Generator (generate.protocol) per generator slice: a GeneratorLoop (engine
      on its own mesh) or a pipeline.remote.RemoteGenerator.
    pool: a VerifierPool (or anything with submit(task, response, tokens, seed) -> Future).
    tokenizer: builds prompts (apply_chat_template) and detokenizes responses.
    prompts: iterator of task dicts ({"id", "kind", "problem", "answer", ...}).
    grpo_cfg: group size, n_batch and the group-drop rule. cfg: the pipeline's bounds and mode.
    system_prompt: the prompt template ({problem} placeholder); None = the bare problem.
    seed, seeds_drawn: each group's sampling seed, drawn with its prompt (SeededPrompts);
      seeds_drawn is a resumed run's `stream_state()`.
    colocated: the generators share the trainer's devices (see the module docstring).
  """

  def __init__(self, *, generators: Sequence[Generator], pool, tokenizer,
               prompts: Iterator[dict], grpo_cfg: GRPOConfig,
               cfg: PipelineConfig = PipelineConfig(), system_prompt: str | None = None,
               seed: int = 0, seeds_drawn: int = 0, colocated: bool = False):
    if not generators:
      raise ValueError("Rollouts needs at least one generator")
    self.grpo_cfg, self.cfg, self.group_size = grpo_cfg, cfg, grpo_cfg.group_size
    self.n_async, self.max_queue = cfg.bounds(grpo_cfg)
    self.generators = list(generators)
    # A generator cuts or refuses a prompt over its max_prefill_length and stops a completion at
    # its max_decode_length, so these limits bound every sample: checked here, collation never
    # meets a sequence longer than a row, whoever built the generators.
    for g in self.generators:
      grpo_cfg.check_row_fits(g.engine.max_prefill_length, g.engine.max_decode_length)
    self.pool, self.tokenizer, self.system_prompt = pool, tokenizer, system_prompt
    self.prompts = SeededPrompts(prompts, seed, seeds_drawn)
    self._scoring = Scoring(pool, tokenizer)
    self._generated: queue.Queue[tuple[int, Sample, RewardResult | None]] = queue.Queue()
    self._groups = GroupAssembler(grpo_cfg, cfg.max_consecutive_dropped,
                                  getattr(tokenizer, "decode", None))
    self.counters = self._groups.counters
    self._next_gid = 0
    self._stop = threading.Event()
    self._threads: list[threading.Thread] = []
    self._errors: list[tuple[str, BaseException, str]] = []
    self._lock = threading.Lock()
    self._room = threading.Condition(self._lock)   # the feeder waits on it for n_async/queue room
    self._generating = 0        # submitted to a generator, not yet returned: <= n_async
    self._queued = 0            # returned by a generator, not yet consumed or dropped
    self.max_generating = 0     # high-water marks: max_generating <= n_async and
    self.max_inflight = 0       # max_inflight (generating + queued) <= n_async + max_queue
    self._started = False
    self._gen_load = [0] * len(self.generators)   # samples submitted, not yet returned
    self._init_lost_generators()
    # Colocated sync: generation and training take turns on the same devices (module docstring).
    self.colocated = bool(colocated)
    self.schedule = schedule_for(self.generators, self.colocated, cfg.mode, cfg.carry_over)
    for i, g in enumerate(self.generators):
      g.callback = (lambda c, result=None, i=i: self._on_sample(i, c, result))

  # ---- what the trainer calls ----------------------------------------------------------------
  def start(self) -> "Rollouts":
    if self._started:
      return self
    self._started = True
    self._meter = GeneratorMeter(self.generators)
    self.schedule.start()
    threads = [("collector", self._collect)]
    if self.cfg.mode == "async":
      threads.append(("feeder", self._feed))
    for name, target in threads:
      t = threading.Thread(target=self._guard(name, target), name=f"pipeline-{name}", daemon=True)
      t.start()
      self._threads.append(t)
    return self

  def next_batch(self) -> RolloutBatch | None:
    """Blocks until n_batch/G kept groups are ready; None once the prompts are exhausted."""
    self.start()
    t0 = time.time()
    need = self.grpo_cfg.n_batch // self.group_size
    try:
      self._wait_for_groups(need)
    except StopIteration:
      return None
    return self._groups.take(need, time.time() - t0)

  def minibatches(self, batch: RolloutBatch, cfg: GRPOConfig, rng: np.random.Generator
                  ) -> list[Minibatch]:
    """One packed Minibatch per optimizer step (rl.minibatch.make_minibatches)."""
    return make_minibatches(batch.groups, cfg, rng)

  def push(self, params, version: int) -> float:
    """The trainer's params to every generator, which continue their in-flight sequences on
    them as policy `version` (schedule.Concurrent.push: device to device, cast once per dtype on
    the trainer's devices first). Colocated sync: the params are only noted; the next generation
    phase loads them (schedule.TakingTurns.push). Returns the seconds it took."""
    return self.schedule.push(params, version)

  def done(self, batch: RolloutBatch) -> None:
    """The trainer has consumed `batch`: its completions leave the off-policy bound."""
    self._release(sum(len(g.completions) for g in batch.groups))

  def check(self):
    """Raises PipelineError if any generator or pipeline thread died (with its traceback)."""
    for g in self.generators:
      try:
        g.check()
      except Exception as e:
        raise PipelineError(f"generator failed: {e}") from e
    if self._errors:
      name, e, tb = self._errors[0]
      raise PipelineError(f"pipeline {name} thread failed:\n{tb}") from e

  def close(self):
    """Stops threads and generators. Safe to call twice; never hangs on a dead component."""
    self._stop.set()
    with self._room:
      self._room.notify_all()   # unblock the feeder
    for t in self._threads:
      t.join(timeout=10)
    for g in self.generators:
      try:
        g.stop(timeout=30)
      except TimeoutError as e:   # a generator stuck in a step: the others still stop
        log.warning("closing the pipeline: %s", e)

  def __enter__(self) -> "Rollouts":
    return self.start()

  def __exit__(self, *exc):
    self.close()

  # ---- threads -------------------------------------------------------------------------------
  def _guard(self, name, fn):
    def run():
      try:
        fn()
      except BaseException as e:
        self._errors.append((name, e, traceback.format_exc()))
        log.error("pipeline %s failed: %s", name, traceback.format_exc())
    return run

  def _next_task(self) -> tuple[dict, int] | None:
    """The next prompt (a lost generator's first) and its group's sampling seed, drawn together
    under the lock `stream_state` reads both under."""
    with self._lock:
      task = self._retry.popleft() if self._retry else self.prompts.next()
      return None if task is None else (task, self.prompts.seed())

  def stream_state(self) -> tuple[dict, dict]:
    """SeededPrompts.state() (a checkpoint's), read under the lock the draws take."""
    with self._lock:
      return self.prompts.state()

  def _submit_group(self) -> bool:
    """Submits the next prompt as a group of G samples to the least-loaded generator."""
    with self._lock:
      if self._serving_generator() is None:   # all lost: wait for one to rejoin
        return False
    drawn = self._next_task()
    if drawn is None:
      return False
    task, seed = drawn
    prompt = self.tokenizer.apply_chat_template(task["problem"], self.system_prompt)
    with self._lock:
      gid = self._next_gid
      self._next_gid += 1
      self._groups.open(gid, self.group_size)
      self._generating += self.group_size
      self.max_generating = max(self.max_generating, self._generating)
      self.max_inflight = max(self.max_inflight, self._generating + self._queued)
      i = self._serving_generator()
      if i is None:   # lost since the check above: the task goes first next time
        self._groups.pending.pop(gid, None)
        self._generating -= self.group_size
        self._retry.appendleft(task)
        return False
      self._gen_load[i] += self.group_size
      self._assigned[gid] = (i, task)
    try:
      self.generators[i].submit(Request(id=gid, prompt_tokens=prompt, seed=seed,
                                        group_size=self.group_size, metadata=task))
    except ValueError as e:
      # A prompt no generator can take (longer than engine.max_prefill_length with truncation
      # off): one bad problem, not a reason to stop feeding. Skipped, counted, logged.
      with self._lock:
        self._groups.pending.pop(gid, None)
        self._assigned.pop(gid, None)
        self._generating -= self.group_size
        self._gen_load[i] -= self.group_size
        self._groups.counters["prompts_skipped"] += 1
      log.warning("skipping a problem the generators refuse (%d prompt tokens): %s; task %s",
                  len(prompt), e, str(task)[:200])
    return True

  def _has_room(self) -> bool:
    g = self.group_size
    return (self._generating + g <= self.n_async
            and self._generating + self._queued + g <= self.n_async + self.max_queue)

  def _feed(self):
    """Async mode: submits a group whenever the off-policy bound has room for G more."""
    while not self._stop.is_set():
      with self._room:
        while not (self._stop.is_set() or self._has_room()):
          self._room.wait(timeout=0.1)
      if self._stop.is_set():
        return
      if not self._submit_group():
        with self._lock:
          if self.prompts.exhausted and not self._retry:
            return
        time.sleep(0.1)   # no generator serves: one may rejoin

  def _collect(self):
    """Generated samples leave `generating` for `queued` and go to scoring (pipeline.scoring)."""
    while not self._stop.is_set():
      try:
        i, s, scored = self._generated.get(timeout=0.05)
      except queue.Empty:
        continue
      with self._room:
        self._gen_load[i] -= 1
        self._generating -= 1
        self._queued += 1
        self._room.notify_all()
      self._scoring.submit(s, scored)   # `scored`: by its generator process's pool

  # ---- group assembly ------------------------------------------------------------------------
  def _drain_scored(self, timeout: float) -> int:
    """Moves scored samples into their groups (pipeline.groups); a group is scored once its last
    sample is, and a dropped one leaves the off-policy bound at once."""
    n = 0
    deadline = time.time() + timeout
    while True:
      try:
        wait_s = max(0.0, deadline - time.time()) if n == 0 else 0.0
        s, res = self._scoring.scored.get(timeout=wait_s)
      except queue.Empty:
        return n
      n += 1
      if int(s.request_id) in self._abandoned:   # given up with a lost generator
        self._release(1)
        continue
      group = self._groups.add(s, res)
      if group is not None and group.dropped:
        self._release(len(group.completions))

  def _release(self, n: int):
    """n queued completions were consumed by the trainer or dropped with their group."""
    with self._room:
      self._queued -= n
      self._room.notify_all()

  def _progress(self, need: int) -> str:
    return (f"{len(self._groups.ready)}/{need} groups ready; {self._groups.progress()}; "
            f"{self._generating} completions generating, {self._queued} queued, "
            f"{self.counters['verifier_errors']} failed verifications in the run")

  def _wait_for_groups(self, need: int):
    t0 = last_log = time.time()

    def tick(wait_s=0.05):
      nonlocal last_log
      if INTERRUPTED.is_set():
        raise KeyboardInterrupt("interrupted (SIGINT) while waiting for a batch")
      self.check()
      self._watch_generators()
      self._drain_scored(wait_s)
      if self._groups.stalled():
        raise self._groups.stall_error(self.tokenizer.decode)
      now = time.time()
      if self.cfg.wait_log_s and now - last_log >= self.cfg.wait_log_s:
        last_log = now
        log.info("waiting %.0fs for a batch: %s", now - t0, self._progress(need))
      if now - t0 > self.cfg.batch_timeout_s:
        raise PipelineError(f"batch did not fill in {self.cfg.batch_timeout_s}s: "
                            f"{self._progress(need)}")

    ready, pending = self._groups.ready, self._groups.pending
    if self.cfg.mode == "sync":
      # Barrier: the missing groups, under the current version, stay in flight until enough are
      # kept. A dropped group is replaced as soon as it is scored, not once the whole round is:
      # rounds would wait on each one's longest completion while the slots empty
      # (docs/design_notes.md, "The RL pipeline").
      self.schedule.begin()
      while len(ready) < need:
        while len(ready) + len(pending) < need and self._submit_group():
          pass
        if not pending and self.prompts.exhausted and not self._retry:
          raise StopIteration
        # Taking turns, the generation phase runs in this thread, the scoring alongside.
        tick(0.0 if self.schedule.generate() else 0.05)
      self.schedule.end()
    else:   # (taking turns with carry-over, the generation phase runs in this thread)
      self.schedule.begin()
      while len(ready) < need:
        tick(0.0 if self.schedule.generate() else 0.05)
        if (self.prompts.exhausted and not self._retry and not pending
            and self._scoring.scored.empty() and len(ready) < need):
          raise StopIteration
      self.schedule.end()

  # ---- metrics -------------------------------------------------------------------------------
  def metrics(self, batch: RolloutBatch, trained_version: int) -> dict:
    """The batch's reward, drop and off-policy metrics (pipeline.groups.batch_metrics), and the
    generators' and verifiers' since the last call. `trained_version`: the policy version of the
    batch's first optimizer step."""
    return {**batch_metrics(batch, trained_version, self.tokenizer.decode),
            **self._system_metrics()}

  def sample_text(self, batch: RolloutBatch) -> str:
    """The batch's completion to show (groups.shown), decoded, with its task and reward."""
    return describe(*shown(batch), self.tokenizer.decode)

  def _system_metrics(self) -> dict:
    return {
        **self._meter.read(),
        "verifier_latency_s": self._scoring.latency_s(),
        "verifier_errors": float(self.counters["verifier_errors"]),
        # Problems skipped because no generator would take their prompt (over its prefill limit).
        "prompts_skipped": float(self.counters["prompts_skipped"]),
        # Groups given up with a lost generator and submitted again (pipeline/remote.py).
        "groups_reassigned": float(self.counters["groups_reassigned"]),
        "generating_completions": float(self._generating),
        "queued_completions": float(self._queued),
        **self.schedule.metrics,
    }
