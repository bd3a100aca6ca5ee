"""Prefilling the generator loop's requests (prefill_requests), and background prefill: a worker
thread that prefills queued requests while the loop decodes.

On a CPU host a prefill and decode steps running at the same time get more work done than the two
one after the other (the decode step alone leaves part of the cores idle; docs/design_notes.md).
The worker takes requests from the loop's queue in order, one prefill batch at a time, under the
weights current when it takes them, and hands them over prefilled (`ready`); it exits when the
queue is empty (the loop starts a new one when work arrives, `after_refill`). It keeps about
`ahead` prefilled samples waiting for the next free slots. The loop's own share of prefilling in
this mode is `top_up`.
"""
from __future__ import annotations

import collections
import queue
import threading
import time
import traceback
from typing import Any, Callable

import jax
import numpy as np

from magistral_jax.generate.counters import LoopCounters
from magistral_jax.generate.prefix_cache import SharedPrefixCache
from magistral_jax.generate.requests import GeneratorError, RequestSamples


def prefill_requests(engine, groups: list[RequestSamples], params, version: int,
                     shared: SharedPrefixCache | None, counters: LoopCounters,
                     lock: threading.Lock) -> None:
  """Prefills `groups` under weights `version` (`params`): one engine.prefill_many call per
  bucket and batch size (engine.split_batch), so every request is prefilled once, together with
  the others (those that start with the shared prefix as its continuation, apart from the
  rest). Called by the loop thread and the worker (`lock`: the loop's, for the counters)."""
  by_bucket: dict[tuple[bool, int], list[RequestSamples]] = {}
  for g in groups:
    by_bucket.setdefault((g.rest > 0, len(g.padded)), []).append(g)
  for (cont, _), gs in by_bucket.items():
    start = 0
    for n in engine.split_batch(len(gs)):
      chunk = gs[start:start + n]
      start += n
      tokens = np.stack([g.padded for g in chunk])
      if cont:
        prefixes = engine.prefill_many(params, tokens, [g.rest for g in chunk],
                                       existing_prefix=shared.get(params, version))
      else:
        prefixes = engine.prefill_many(params, tokens, [g.true_length for g in chunk])
      for row, g in enumerate(chunk):
        g.prefix, g.prefix_version = (prefixes, row), version
      if cont:
        with lock:
          counters.shared_prefix_hits += n
          counters.shared_prefix_tokens_skipped += n * len(shared.tokens)


class PrefillWorker:
  """requests: the loop's queue of submitted RequestSamples; lock: the loop's lock (the worker
  reads the loop's weights under it, through `weights`); prefill(groups, params, version):
  the loop's prefill; batch: requests per prefill call."""

  def __init__(self, requests: queue.Queue, lock: threading.Lock, stop: threading.Event,
               prefill: Callable[[list, Any, int], None], weights: Callable[[], tuple[Any, int]],
               batch: int, ahead: int, counters: LoopCounters):
    self._requests, self._stop, self._prefill, self._weights = requests, stop, prefill, weights
    self._batch, self._ahead, self._counters = batch, ahead, counters
    self.cv = threading.Condition(lock)
    self.ready: list[RequestSamples] = []   # prefilled, for the loop to take (under cv)
    self.in_flight = 0   # requests the worker holds while prefilling them
    self.thread: threading.Thread | None = None
    self.error: tuple[BaseException, str] | None = None
    self.loop_backlog = 0  # prefilled samples waiting in the loop's own queue

  def holds_work(self) -> bool:
    """Whether requests are prefilled and not yet taken, or being prefilled. Under the lock."""
    return bool(self.ready) or bool(self.in_flight)

  def wake(self) -> None:
    with self.cv:
      self.cv.notify_all()

  def _run(self):
    groups: list[RequestSamples] = []
    try:
      while True:
        with self.cv:
          while True:
            if self._stop.is_set():
              self.thread = None
              return
            backlog = self.loop_backlog + sum(g.request.group_size for g in self.ready)
            if backlog < max(1, self._ahead):
              break
            self.cv.wait(0.05)
          groups = []
          while len(groups) < self._batch:
            try:
              groups.append(self._requests.get_nowait())
            except queue.Empty:
              break
          if not groups:
            self.thread = None
            return
          self.in_flight = len(groups)
          params, version = self._weights()
        self._prefill(groups, params, version)
        jax.block_until_ready([g.prefix[0] for g in groups])
        with self.cv:
          self.ready.extend(groups)
          self.in_flight = 0
          self._counters.background_prefilled += len(groups)
          groups = []
          self.cv.notify_all()
    except BaseException as e:  # re-raised in the loop thread; the requests are kept, unprefilled
      with self.cv:
        for g in groups:
          g.prefix = None
        self.ready.extend(groups)
        self.error = (e, traceback.format_exc())
        self.in_flight = 0
        self.thread = None
        self.cv.notify_all()

  def raise_error(self):
    if self.error is not None:
      e, tb = self.error
      raise GeneratorError(f"background prefill failed:\n{tb}") from e

  def collect(self, groups: collections.deque, decoding: bool) -> None:
    """Moves the prefilled requests into the loop's `groups` (queue order). With nothing
    `decoding` and nothing in `groups` to insert, waits for the batch in flight instead of
    spinning."""
    with self.cv:
      self.raise_error()
      if (not self.ready and self.thread is not None and not decoding
          and not any(g.waiting > 0 for g in groups)):
        t0 = time.perf_counter()
        self.loop_backlog = 0
        self.cv.notify_all()
        while (not self.ready and self.thread is not None and self.error is None
               and not self._stop.is_set()):
          self.cv.wait(0.05)
        self._counters.prefill_wait_s += time.perf_counter() - t0
        self.raise_error()
      groups.extend(self.ready)
      self.ready.clear()

  def top_up(self, groups: collections.deque, active: int, n_slots: int, below: float) -> None:
    """Takes queued requests into the loop's `groups` for the loop's own prefill when fewer than
    `below` of the n_slots slots would decode (enough to fill every free slot), or one prefill
    batch when nothing decodes and no worker runs (the start, after an idle spell).
    Counting active plus prefilled-and-waiting samples, the loop does not step a mostly empty
    batch while the worker catches up: on a prefill-bound workload (long prompts, short
    completions) the worker alone cannot keep the slots busy, and a step costs the same with few
    slots active as with all (with below > 0 the slots stay far busier and the run is faster;
    no loss on a decode-bound workload; docs/design_notes.md)."""
    with self.cv:
      waiting = sum(g.waiting for g in groups)
      if active + waiting < below * n_slots:
        while waiting < n_slots - active:
          try:
            g = self._requests.get_nowait()
          except queue.Empty:
            break
          groups.append(g)
          waiting += g.request.group_size
      elif self.thread is None and not active:
        while sum(g.prefix is None for g in groups) < self._batch:
          try:
            groups.append(self._requests.get_nowait())
          except queue.Empty:
            break

  def after_refill(self, groups: collections.deque) -> None:
    """Notes the prefilled samples waiting in `groups` and starts a worker when requests are
    queued and none runs."""
    with self.cv:
      self.loop_backlog = sum(g.waiting for g in groups if g.prefix is not None)
      if self.thread is None and not self._requests.empty() and not self._stop.is_set():
        self.thread = threading.Thread(target=self._run, name="generator-prefill", daemon=True)
        self.thread.start()
      self.cv.notify_all()
