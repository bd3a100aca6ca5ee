"""The generator loop: continuous batching over the engine's slots, with weights updated in flight.

One iteration (`step`):
  1. swap in pending weights at the step boundary, keeping the in-flight KV cache as the paper
     does, unless recompute_kv_on_update (loop_weights.py); samples whose tool calls are done go
     on after their results (tool_turns.py);
  2. refill free slots (refill.py): the prompts the free slots need, topped up with queued ones
     up to `prefill_ahead`, prefilled together (a `shared_prefix` once: prefix_cache.py; ahead of
     the loop in a worker thread with background_prefill: prefill_worker.py) and inserted with
     one `insert_many` per prefill batch;
  3. once no request waits and the active slots fit one of the engine's compact_sizes (the drain
     at the end of a batch), they decode on that smaller engine (compaction.Drain); on a paged
     KV cache (paging.py) samples parked for want of pages resume first, and each active slot
     reserves the page of its next token;
  4. one decode step for all slots and one device-to-host transfer of its results, then the
     bookkeeping in numpy (slots.py): finish on EOS, a stop string or max tokens, or park for a
     tool call; finished samples stream out as `Sample`s.
With overlap_host (the default) step 4 dispatches decode step n+1 before it records step n's
results, so the device computes while the host works (inflight.py says what that changes).

`start()` runs `step` in a thread; `update_params` and `submit` are safe from any thread. An
exception in the loop thread stops the loop and is re-raised (with the thread's traceback as the
cause) by `check()`, `get()` and `submit()`, so callers never hang on a dead generator.
"""
from __future__ import annotations

import collections
import logging
import queue
import threading
import time
import traceback
from typing import Callable, Sequence

import jax
import numpy as np

from magistral_jax.generate.carry import Carry
from magistral_jax.generate.compaction import Drain
from magistral_jax.generate.config import EngineConfig, SamplingConfig
from magistral_jax.generate.counters import LoopCounters
from magistral_jax.generate.engine import Engine
from magistral_jax.generate.inflight import DeviceLead
from magistral_jax.generate.loop_parts import LoopParts
from magistral_jax.generate.loop_weights import LoopWeights, recompute_caches
from magistral_jax.generate.paging import LoopPages
from magistral_jax.generate.prefill_worker import PrefillWorker, prefill_requests
from magistral_jax.generate.prefix_cache import SharedPrefixCache
from magistral_jax.generate.refill import Refill
from magistral_jax.generate.requests import (GeneratorError, Request, RequestSamples, Sample,
                                             request_key)
from magistral_jax.generate.slots import SlotTable
from magistral_jax.generate.tool_turns import ToolTurns
from magistral_jax.generate.weights import transfer_params

log = logging.getLogger(__name__)

# A bare GeneratorLoop prefills between its own steps, not in a worker thread: a caller that steps
# it (run_until_idle, a colocated phase, most tests) gets the same schedule on every run. A run's
# generators take the `engine` section (pipeline.generators.make_generators): in the background.
DIRECT = EngineConfig(background_prefill=False)


class GeneratorLoop:
  """Continuous-batching generator over one Engine (module docstring); `loop.counters`."""

  def __init__(self, engine: Engine, params, version: int = 0, *,
               sampling: SamplingConfig, options: EngineConfig = DIRECT,
               detokenize: Callable[[Sequence[int]], str] | None = None,
               callback: Callable[[Sample], None] | None = None, seed: int = 0,
               shared_prefix: Sequence[int] | None = None, idle_wait_s: float = 0.005,
               truncate_prompts: bool | None = None, compact_drain: bool = True,
               prefill_ahead: int | None = None, tools: ToolTurns | None = None):
    self.engine = engine
    # The loop's knobs of the `engine` section (config.EngineConfig says what each does; its
    # shapes are the engine's own): overlap_host (inflight.py), background_prefill and
    # loop_prefill_below (prefill_worker.py), recompute_kv_on_update (loop_weights.py).
    self.options = options
    # Requests prefilled in one call when a free slot needs one (those the free slots need, then
    # queued ones, whose prefixes wait for the next free slots): a batched prefill costs less per
    # prompt. Default: the engine's largest prefill batch; 0 or 1: only what is needed now.
    self.prefill_ahead = (engine.prefill_batch_sizes[-1] if prefill_ahead is None
                          else int(prefill_ahead))
    # With compact_drain, once no request is waiting and the active slots fit in one of the
    # engine's compact_sizes, they are decoded on that smaller engine (compaction.Drain).
    self.compact_drain = compact_drain
    drain = Drain(engine)
    # The loop's own sampling (a caller wanting the engine's passes engine.sampling): stop
    # criteria are host-side and the temperature an input of the engine's programs (each slot
    # carries its own); what the programs compile in (top-p, top-k, greedy) must match.
    self.sampling = sampling
    for f in ("top_p", "top_k", "greedy"):
      if getattr(self.sampling, f) != getattr(engine.sampling, f):
        raise ValueError(f"sampling.{f}={getattr(self.sampling, f)!r} differs from the engine's "
                         f"{getattr(engine.sampling, f)!r} (it is compiled into the engine)")
    self.truncate_prompts = engine.truncate_prompts if truncate_prompts is None else truncate_prompts
    if self.sampling.stop_strings and detokenize is None:
      raise ValueError("SamplingConfig.stop_strings needs a detokenize callable")
    self.detokenize = detokenize
    self.callback = callback
    self.idle_wait_s = idle_wait_s
    self.counters = LoopCounters()
    self._lock = threading.Lock()
    self.weights = LoopWeights(engine, params, version, self._lock, self.counters,
                               options.recompute_kv_on_update)
    self._shared = None if shared_prefix is None else SharedPrefixCache(
        engine, shared_prefix, self._lock, lambda: self.version, self.counters,
        self.sampling.temperature)
    self.shared_prefix: list[int] | None = self._shared.tokens if self._shared else None
    self.state = engine.init_decode_state()
    self.completions: queue.Queue[Sample] = queue.Queue()
    requests: queue.Queue[RequestSamples] = queue.Queue()
    pages = None if engine.kv_pages is None else LoopPages(engine, drain.set_pages)
    self.tools = tools   # a sample may stop for a tool call, and go on after it (tool_turns.py)
    slots = SlotTable(engine.max_concurrent_decodes, engine.max_decode_length, self.sampling,
                      detokenize, self._emit, None if pages is None else pages.release,
                      None if tools is None else tools.maybe_call)
    self._stop = threading.Event()
    # What the loop's parts share (loop_parts.py names each field's owner).
    self.parts = LoopParts(
        engine, options, self.sampling, requests, collections.deque(), slots, drain,
        DeviceLead(slots, drain, self.counters),
        PrefillWorker(requests, self._lock, self._stop, self._prefill, self.weights.current,
                      engine.prefill_batch_sizes[-1], self.prefill_ahead, self.counters),
        pages)
    self._refill = Refill(self.parts, self._prefill, self.weights.stale, self.prefill_ahead)
    self.carry = Carry()   # samples carried over a release(carry=True)
    self._thread: threading.Thread | None = None
    self._error: BaseException | None = None
    self._error_tb = ""
    self._rng = np.random.default_rng(seed)
    if self._shared:   # the first weights' prefix, before any request needs it
      self._shared.get(self.params, self.version)

  # ---- public API ----------------------------------------------------------------------------
  def submit(self, request: Request) -> None:
    """Validates and enqueues a request (raises at once on bad input; nothing is queued)."""
    self.check()
    mx = (self.sampling.max_new_tokens if request.max_new_tokens is None
          else request.max_new_tokens)
    if not 1 <= mx <= self.engine.max_decode_length:
      raise ValueError(f"request {request.id!r}: max_new_tokens={mx} outside [1, "
                       f"max_decode_length={self.engine.max_decode_length}]")
    try:
      padded, n, truncated = self.engine.pad_prompt(request.prompt_tokens,
                                                      truncate=self.truncate_prompts)
    except ValueError as e:
      raise ValueError(f"request {request.id!r}: {e}") from None
    prompt = list(np.asarray(request.prompt_tokens).reshape(-1)[-n:].tolist())
    seed = request.seed if request.seed is not None else int(self._rng.integers(2**31))
    key = request_key(seed)
    rest = self._shared.rest_length(prompt) if self._shared else 0
    if rest:
      padded, _, _ = self.engine.pad_prompt(prompt[-rest:])
    self.parts.requests.put(RequestSamples(request, prompt, padded, n, truncated, key, mx,
                                           rest=rest))

  # ---- weights (loop_weights.py) ---------------------------------------------------------------
  @property
  def params(self):
    """The weights in use (engine.load_params' layout); None while released."""
    return self.weights.params

  @property
  def version(self) -> int:
    """The policy version of the weights in use."""
    return self.weights.version

  def update_params(self, params, version: int) -> None:
    """Thread-safe. Validates (tree, shapes, finiteness) and moves the new weights onto the
    engine's mesh in the caller's thread; the loop swaps them in at its next step boundary.
    Bad params raise here and the loop keeps generating with the old ones."""
    self.weights.update(params, version)

  def push(self, params, version: int, cast: dict | None = None) -> None:
    """A trainer's push (Generator.push): `params` cast to the engine's weight dtype on the
    trainer's devices (memoised per dtype in `cast`, a dict the generators of one push share),
    moved device to device onto the engine's mesh and waited for, then update_params."""
    new = transfer_params(params, self.engine, cast)
    jax.block_until_ready(new)
    self.update_params(new, version)

  def _recompute_kv(self) -> None:
    """recompute_kv_on_update: the caches are recomputed from the host's tokens, so the step in
    flight (old weights, its own version) is recorded first: the host then has every token the
    device state holds."""
    self._flush()
    if self.parts.drain.compacted is not None:
      self.state = self.parts.drain.expand(self.state, self.parts.slots.held())
    self.state = recompute_caches(self.engine, self.params, self.state, self.parts.slots,
                                  self.parts.groups)

  # ---- running it ------------------------------------------------------------------------------
  def start(self) -> "GeneratorLoop":
    if self._thread is not None:
      raise RuntimeError("generator loop already started")
    self._stop.clear()
    self._thread = threading.Thread(target=self._run, name="generator-loop", daemon=True)
    self._thread.start()
    return self

  def stop(self, timeout: float | None = 30.0) -> None:
    """Stops the loop thread (and the prefill worker) at the next step boundary. Raises
    TimeoutError, keeping the thread, when it is still running after `timeout` seconds (e.g.
    inside a long step): the loop must not be started again over state it still uses."""
    self._signal_stop()
    for thread in (self._thread, self.parts.prefiller.thread):
      if thread is not None:
        thread.join(timeout)
        if thread.is_alive():
          raise TimeoutError(f"generator {thread.name} thread still running {timeout} s after "
                             "stop(); call stop() again to wait longer")
    self._thread = None

  def _signal_stop(self) -> None:
    """Tells the loop thread and the prefill worker to stop (the worker may be waiting)."""
    self._stop.set()
    self.parts.prefiller.wake()

  def check(self) -> None:
    """Re-raises an exception from the loop thread."""
    if self._error is not None:
      raise GeneratorError(f"generator loop failed:\n{self._error_tb}") from self._error

  def get(self, timeout: float | None = None) -> Sample:
    """Next finished sample; raises GeneratorError if the loop died, queue.Empty on timeout."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
      self.check()
      try:
        return self.completions.get(timeout=0.05)
      except queue.Empty:
        if deadline is not None and time.monotonic() > deadline:
          raise
        if self._thread is None and self.idle():
          self.check()
          raise queue.Empty("generator loop is not running and has no work left")

  def idle(self) -> bool:
    """No request queued, no sample waiting for a slot or a prefill, no slot decoding. A request
    whose samples all went into slots stays queued until a free slot pops it: not work."""
    with self._lock:  # the worker takes requests and counts them in flight under this lock
      return not self._pending_work() and self.parts.slots.empty()

  def run_until_idle(self, max_steps: int | None = None) -> list[Sample]:
    """Steps in the calling thread until all submitted work is done; returns the samples."""
    n = 0
    while not self.idle():
      self.step()
      n += 1
      if max_steps is not None and n >= max_steps:
        break
    self._flush()   # the step in flight, if any: its tokens are recorded before returning
    return [self.completions.get() for _ in range(self.completions.qsize())]

  @property
  def num_active(self) -> int:
    return int(self.parts.slots.active.sum())

  def metrics(self) -> dict[str, float]:
    m = self.counters.metrics(self.engine.max_concurrent_decodes, self.engine.cache_length,
                              self.version)
    for part in (self.parts.pages, self.tools):
      m.update(part.metrics() if part is not None else {})
    return m

  def shared_prefix_cache(self):
    """The shared prefix's Prefix under the current weights (None without a shared_prefix): what
    Engine.precompile(existing_prefix=...) takes to compile the programs that continue it."""
    return self._shared.get(self.params, self.version) if self._shared else None

  # ---- colocated phases (pipeline.taking_turns: generation and training take turns) -----------
  def release(self, carry: bool = False) -> None:
    """Frees the device memory the loop holds between generation phases: its weights (the
    serving-dtype, decode-layout copy), its KV cache (the decode state) and the shared prefix's
    cache, so that a trainer on the same devices has them for its step. Only when the loop
    thread is not running, and every submitted request is done unless `carry`: then the samples
    in slots are carried to the next phase and the queued ones wait (carry.py). `reload` brings
    weights and an empty cache back."""
    if self._thread is not None:
      raise RuntimeError("release: the loop thread is running; release is for loops stepped by "
                         "their caller between phases (stop() it first)")
    self._flush()
    if self.tools is not None and self.tools.busy():   # their calls' results go in first
      self.state = self.tools.resume(self.parts, self.params, self.version, self.state, True)
    # All the phase launched ends first: the next train step runs alone (design_notes, "Hangs").
    held = jax.tree.leaves((self.state, [g.prefix for g in self.parts.groups]))
    jax.block_until_ready([x for x in held if isinstance(x, jax.Array) and not x.is_deleted()])
    if carry:
      self.carry.suspend(self.parts.slots, self.parts.pages)
    elif not self.idle():
      raise RuntimeError(f"release: the loop still has work ({self.num_active} active slots, "
                         f"{self.parts.requests.qsize()} queued requests); finish it first")
    with self._lock:
      self.weights.drop()
      for g in self.parts.groups:   # their prompts' KV goes: prefilled again when their turn comes
        g.prefix = None
      if not carry:
        self.parts.groups.clear()
      if self._shared:
        self._shared.clear()
    self.state = None
    if self.parts.pages is not None:
      self.parts.pages.reset()
    self.parts.drain.compacted = None
    self.parts.ahead.firsts.clear()

  @property
  def released(self) -> bool:
    return self.state is None

  def reload(self, params, version: int) -> None:
    """After `release`: the weights of policy `version` (validated, cast and laid out as
    update_params does: the engine's serving dtype on its mesh) and an empty KV cache."""
    if not self.released:
      raise RuntimeError("reload: the loop holds its weights and cache; use update_params")
    self.weights.reload(params, version)
    self.state = self.engine.init_decode_state()
    self.parts.slots.device_active = np.zeros_like(self.parts.slots.device_active)

  # ---- the loop ------------------------------------------------------------------------------
  def _run(self):
    try:
      while not self._stop.is_set():
        if not self.step():
          self._wait_for_work()
      self._flush()   # stopping: record the step in flight (no token is lost)
    except BaseException as e:  # surfaced to the caller by check()/get()
      self._error, self._error_tb = e, traceback.format_exc()
      log.error("generator loop failed: %s", self._error_tb)
      self._signal_stop()   # the prefill worker too: nothing would take what it prefills

  def _wait_for_work(self):
    t0 = time.perf_counter()
    try:
      group = self.parts.requests.get(timeout=self.idle_wait_s)
    except queue.Empty:
      return
    finally:
      self.counters.idle_time_s += time.perf_counter() - t0
    self.parts.groups.append(group)

  def step(self) -> bool:
    """One loop iteration; returns False when there was nothing to decode. With overlap_host it
    dispatches a decode step and then records the one dispatched by the previous call."""
    self.weights.apply_pending(self._recompute_kv)
    if self.tools is not None and self.tools.busy():   # samples back from their tool calls
      self.state = self.tools.resume(self.parts, self.params, self.version, self.state)
    pages, slots = self.parts.pages, self.parts.slots
    if self.carry:   # samples carried over a release go first (carry.py)
      self.state = self.carry.resume(self.engine, self.params, self.state, slots, pages,
                                     self.sampling.temperature)
    if pages is not None and pages.parked:   # parked for want of KV pages: they go first
      self.state = pages.resume_parked(self.state, slots, self.params, self.parts.drain)
    self.state = self._refill.fill(self.state)
    if pages is not None:   # the pages of every active slot's next write (paging.py)
      self.state = pages.make_room(self.state, slots, self.parts.ahead, self.parts.drain)
    active = slots.active
    if not active.any():
      # A step in flight only advanced samples that have finished since (nothing is active):
      # its results are dropped.
      self._flush()
      # Every compacted sequence has finished or is parked: the parked ones (and a paged
      # cache's pools) go back.
      if self.parts.drain.compacted is not None:
        self.state = self.parts.drain.expand(self.state, slots.held())
      return False
    if self.compact_drain and not self._pending_work():
      self.state = self.parts.drain.maybe_compact(self.state, active)
    self.state = self.parts.ahead.dispatch(self.params, self.state, self.version)
    if not self.options.overlap_host:
      self._flush()
    return True

  def _flush(self) -> None:
    """Records the step in flight, if any (and first tokens left unfetched)."""
    self.parts.ahead.flush()

  def _pending_work(self) -> bool:
    """Whether a request or a group sample is waiting for a slot, a parked one for pages or a
    carried one for its slot."""
    return (not self.parts.requests.empty() or self.parts.prefiller.holds_work()
            or any(g.waiting > 0 for g in self.parts.groups)
            or bool(self.parts.pages and self.parts.pages.parked) or bool(self.carry)
            or (self.tools is not None and self.tools.busy()))

  def _emit(self, sample: Sample) -> None:
    self.completions.put(sample)
    if self.callback is not None:
      self.callback(sample)

  # ---- refill --------------------------------------------------------------------------------
  def _prefill(self, groups: list[RequestSamples], params=None, version: int | None = None
               ) -> None:
    """prefill_requests under the loop's current weights unless `params` / `version` are given
    (the worker)."""
    if params is None:
      params, version = self.params, self.version
    prefill_requests(self.engine, groups, params, version, self._shared, self.counters,
                     self._lock)
