"""The generator loop: continuous batching over the engine's slots, with weights updated in flight.

One iteration (`step`):
  1. swap in pending weights, if any (a pointer swap at a decode-step boundary; the KV cache of
     in-flight sequences is kept, as in the paper, unless recompute_kv_on_update is set);
  2. refill free slots: the requests that the free slots need are prefilled together (one
     `prefill_many` call per length bucket and batch size, one prefill per request however many
     group samples it has), topped up with the next queued requests up to `prefill_ahead`
     prompts per refill; then all new samples go into their slots in one `insert_many` call;
     samples that do not fit wait for the next free slots, reusing the same prefix. With
     `shared_prefix` (e.g. the system prompt every RL prompt starts with) that prefix is
     prefilled once per weights version and a prompt starting with it is prefilled as its rest
     only, continuing the cached prefix. With
     background_prefill a worker thread does the prefilling ahead, while the loop decodes (on a
     CPU host the two overlap), and the loop inserts what is ready; it prefills itself only when
     nothing is decoding and the worker is idle;
  3. once no request is waiting and the active slots fit in one of the engine's compact_sizes
     (the drain at the end of a batch), they move onto that smaller engine (Engine.compact),
     whose step costs less, and move back when new work arrives (Engine.expand);
  4. one decode step for all slots and one device-to-host transfer of its results, then
     vectorised bookkeeping in numpy: each active slot's token, log-prob and policy version go
     into per-slot buffers; finish on EOS, a stop string or max tokens; stream finished
     sequences out as `Completion`s.

`start()` runs `step` in a thread; `update_params` and `submit` are safe from any thread. An
exception in the loop thread stops the loop and is re-raised (with the thread's traceback as the
cause) by `check()`, `get()` and `submit()`, so callers never hang on a dead generator.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import threading
import time
import traceback
from typing import Any, Callable, Sequence

import jax
import numpy as np

from magistral_jax.generate.engine import Engine, NonFiniteError, Prefixes
from magistral_jax.generate.sampling import SamplingConfig

log = logging.getLogger(__name__)


# A shared prompt prefix shorter than this is not worth its own prefill programs.
SHARED_PREFIX_MIN_TOKENS = 16


def common_prefix(prompts: Sequence[Sequence[int]]) -> list[int]:
  """The longest token prefix all `prompts` start with."""
  prompts = [list(p) for p in prompts]
  if not prompts:
    return []
  n = min(len(p) for p in prompts)
  for i in range(n):
    if any(p[i] != prompts[0][i] for p in prompts[1:]):
      return prompts[0][:i]
  return prompts[0][:n]


def useful_shared_prefix(prefix: Sequence[int], max_prefill_length: int) -> list[int] | None:
  """`prefix` as a GeneratorLoop shared_prefix when caching it pays: at least
  SHARED_PREFIX_MIN_TOKENS tokens, and room left for a prompt's own tokens; else None."""
  prefix = list(prefix)
  return prefix if SHARED_PREFIX_MIN_TOKENS <= len(prefix) < max_prefill_length else None


class GeneratorError(RuntimeError):
  """The loop thread died; the original exception is the __cause__."""


@dataclasses.dataclass
class Request:
  id: Any
  prompt_tokens: Sequence[int]
  group_size: int = 1
  max_new_tokens: int | None = None
  metadata: Any = None
  seed: int | None = None  # per-request sampling seed (default: drawn from the loop's seed)


@dataclasses.dataclass
class Completion:
  """One finished sample. logprobs[t] = log π_T(tokens[t]) under the policy version versions[t]
  that sampled it (see sampling.py). finish_reason: 'eos' | 'stop' | 'length'."""
  request_id: Any
  sample_index: int
  prompt_tokens: list[int]
  tokens: list[int]
  logprobs: np.ndarray
  versions: np.ndarray
  finish_reason: str
  metadata: Any = None
  prompt_truncated: bool = False


@dataclasses.dataclass
class _Group:
  request: Request
  prompt: list[int]        # after truncation, as prefilled
  padded: np.ndarray
  true_length: int
  truncated: bool
  key: np.ndarray          # request PRNG key; sample i uses fold_in(key, i)
  max_new: int
  next_index: int = 0
  prefix: tuple[Prefixes, int] | None = None  # (prefill batch, row)
  prefix_version: int = 0
  rest: int = 0            # > 0: the prompt is the loop's shared prefix + `padded`[:rest]


@dataclasses.dataclass
class _Slot:
  group: _Group
  index: int


class GeneratorLoop:
  """Continuous-batching generator over one Engine; see the module docstring."""

  def __init__(self, engine: Engine, params, version: int = 0, *,
               detokenize: Callable[[Sequence[int]], str] | None = None,
               callback: Callable[[Completion], None] | None = None,
               recompute_kv_on_update: bool = False, seed: int = 0, idle_wait_s: float = 0.005,
               sampling: SamplingConfig | None = None, truncate_prompts: bool | None = None,
               compact_drain: bool = True, prefill_ahead: int | None = None,
               background_prefill: bool = False, loop_prefill_below: float = 0.5,
               shared_prefix: Sequence[int] | None = None):
    self.engine = engine
    # With background_prefill, a worker thread prefills queued requests while the loop decodes
    # (see _prefill_worker), keeping about `prefill_ahead` prefilled samples ready for the next
    # free slots. The loop prefills itself when too few slots would decode (loop_prefill_below,
    # next), or when nothing is decoding and the worker is idle (one prefill batch).
    self.background_prefill = bool(background_prefill)
    # With background_prefill, when fewer than `loop_prefill_below` of the slots would decode
    # (active plus prefilled-and-waiting samples), the loop does not step a mostly empty batch
    # while the worker catches up: it prefills enough queued requests to fill every free slot
    # itself first. On a prefill-bound workload (long prompts, short completions) the worker
    # alone cannot keep the slots busy, and a step costs the same with few slots active as with
    # all (SmolLM2-135M, 2-core CPU: 0.3-0.5 slot use while queued at 0.0, 0.9 at 0.5, and the
    # run 1.1-1.3x faster; no loss on a decode-bound workload; BENCHMARKS.md). 0 = the worker
    # alone (the loop prefills only when nothing decodes and the worker is idle); 1 = the loop
    # prefills whenever a slot is free and no prefilled sample waits for it.
    if not 0.0 <= loop_prefill_below <= 1.0:
      raise ValueError(f"loop_prefill_below must lie in [0, 1], got {loop_prefill_below}")
    self.loop_prefill_below = float(loop_prefill_below)
    # When a free slot needs a prefill, up to this many requests in all (the ones the free slots
    # need first, then the next ones in the queue) are prefilled in the same call; the extra
    # prefixes wait for the next free slots. A batched prefill costs less per prompt than one
    # at a time. Default: the engine's largest prefill batch; 0 or 1: only what is needed now.
    self.prefill_ahead = (engine.prefill_batch_sizes[-1] if prefill_ahead is None
                          else int(prefill_ahead))
    # With compact_drain, once no request is waiting and the active slots fit in one of the
    # engine's compact_sizes, they are gathered into that smaller engine's state and decoded
    # there (Engine.compact); new work writes them back first (Engine.expand).
    self.compact_drain = compact_drain
    self._compact: tuple[np.ndarray, Any, Engine] | None = None  # (slots, small state, engine)
    # Stop criteria (eos_id, stop_strings, max_new_tokens) are host-side, so a loop may set its
    # own; what the compiled step uses (temperature, top-p, top-k, greedy) must match the engine.
    self.sampling = sampling or engine.sampling
    for f in ("temperature", "top_p", "top_k", "greedy"):
      if getattr(self.sampling, f) != getattr(engine.sampling, f):
        raise ValueError(f"sampling.{f}={getattr(self.sampling, f)!r} differs from the engine's "
                         f"{getattr(engine.sampling, f)!r} (it is compiled into the engine)")
    self.truncate_prompts = engine.truncate_prompts if truncate_prompts is None \
        else truncate_prompts
    if self.sampling.stop_strings and detokenize is None:
      raise ValueError("SamplingConfig.stop_strings needs a detokenize callable")
    self.detokenize = detokenize
    self.callback = callback
    self.recompute_kv_on_update = recompute_kv_on_update
    self.idle_wait_s = idle_wait_s
    self.params = engine.load_params(params)
    self.version = int(version)
    # Shared-prefix caching: with `shared_prefix` (token ids every prompt is expected to start
    # with, e.g. the rendered system prompt of an RL run), that prefix is prefilled once per
    # weights version (here for the first weights; after a swap, by the first prefill that
    # needs it) and a prompt that starts with it and goes on is prefilled as its rest only,
    # continuing the cached prefix (Engine.prefill_many existing_prefix). Other prompts are
    # prefilled whole. The cache, the first token and the log-probs equal the whole prompt's
    # prefill up to float rounding, and sampling draws the same stream (tests/test_generate.py).
    self.shared_prefix: list[int] | None = None
    self._shared = None   # (version, the prefix's Prefix under that version's weights)
    self.shared_prefix_prefills = 0   # times the prefix itself was prefilled
    if shared_prefix is not None:
      padded, n, _ = engine.pad_prompt(shared_prefix, truncate=False)
      if n >= engine.max_prefill_length:
        raise ValueError(f"shared_prefix of {n} tokens leaves no room for a prompt's own tokens "
                         f"under max_prefill_length={engine.max_prefill_length}")
      self.shared_prefix = np.asarray(shared_prefix).reshape(-1).tolist()
      self._shared_padded = padded
    self.state = engine.init_decode_state()
    self.completions: queue.Queue[Completion] = queue.Queue()
    self._requests: queue.Queue[Request] = queue.Queue()
    self._groups: collections.deque[_Group] = collections.deque()
    n_slots = engine.max_concurrent_decodes
    self._slots: list[_Slot | None] = [None] * n_slots
    # Host mirror of each slot's completion so far (the step's bookkeeping is array ops), the
    # host's activity mask and what the device's mask currently is.
    self._tok_buf = np.zeros((n_slots, engine.max_decode_length), np.int32)
    self._lp_buf = np.zeros((n_slots, engine.max_decode_length), np.float32)
    self._ver_buf = np.zeros((n_slots, engine.max_decode_length), np.int64)
    self._count = np.zeros((n_slots,), np.int64)
    self._max_new = np.zeros((n_slots,), np.int64)
    # Prompt tokens in each slot's cache: its cache length before a step is prompt + count - 1,
    # so a step writes at positions below prompt + count (what picks the attention window).
    self._prompt_len = np.zeros((n_slots,), np.int64)
    self._active = np.zeros((n_slots,), bool)
    self._device_active = np.zeros((n_slots,), bool)
    self._pending: tuple[Any, int] | None = None
    self._lock = threading.Lock()
    # Background prefill: the worker moves requests from _requests to _ready (prefilled) under
    # _cv; _in_flight counts the requests it holds while prefilling them. _groups stays the loop
    # thread's own; it takes the ready groups at the start of each refill.
    self._cv = threading.Condition(self._lock)
    self._ready: list[_Group] = []
    self._in_flight = 0
    self._worker: threading.Thread | None = None
    self._worker_error: tuple[BaseException, str] | None = None
    self._loop_backlog = 0  # prefilled samples waiting in _groups (written by the loop thread)
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None
    self._error: BaseException | None = None
    self._error_tb = ""
    self._rng = np.random.default_rng(seed)
    self._max_stop = max((len(s) for s in self.sampling.stop_strings), default=0)
    # Metrics.
    self.steps = 0
    self.active_slot_steps = 0
    # Slots the decode steps computed: B per full step, the compact engine's size per compacted
    # step. Active over computed is the share of decode work that advanced a sequence.
    self.computed_slot_steps = 0
    self.generated_tokens = 0
    self.compact_steps = 0      # decode steps run on a compacted (smaller) state
    self.attended_positions = 0  # sum over steps of the attention window (cache positions read)
    self.decode_time_s = 0.0
    self.prefill_wait_s = 0.0    # the loop blocked waiting for the background prefill worker
    self.background_prefilled = 0  # requests the worker prefilled
    self.shared_prefix_hits = 0   # requests prefilled as a continuation of the shared prefix
    self.shared_prefix_tokens_skipped = 0  # prompt tokens those prefills did not recompute
    self.idle_time_s = 0.0      # blocked waiting for a request with no active slot
    self.update_pauses_s: list[float] = []
    self.update_pause_steps: list[int] = []  # decode steps between update_params and the swap
    self._pending_since_step = 0
    if self.shared_prefix:   # the first weights' prefix, before any request needs it
      self._shared_for(self.params, self.version)

  # ---- public API ----------------------------------------------------------------------------
  def submit(self, request: Request) -> None:
    """Validates and enqueues a request (raises at once on bad input; nothing is queued)."""
    self.check()
    if request.group_size < 1:
      raise ValueError(f"request {request.id!r}: group_size must be >= 1, got "
                       f"{request.group_size}")
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
    key = np.asarray(jax.random.PRNGKey(seed))
    rest = 0
    p = len(self.shared_prefix or ())
    if p and n > p and prompt[:p] == self.shared_prefix:
      rest = n - p
      padded, _, _ = self.engine.pad_prompt(prompt[p:])
    self._requests.put(_Group(request, prompt, padded, n, truncated, key, mx, rest=rest))

  def update_params(self, params, version: int) -> None:
    """Thread-safe. Validates (tree, shapes, finiteness) and moves the new weights onto the
    engine's mesh in the caller's thread; the loop swaps them in at its next step boundary.
    Bad params raise here and the loop keeps generating with the old ones."""
    version = int(version)
    params = self.engine.load_params(params)
    with self._lock:
      latest = self.version if self._pending is None else max(self.version, self._pending[1])
      if version <= latest:
        # Tokens carry the version they were sampled under, and the shared prefix's cache (and
        # the recompute ablation's staleness test) is keyed by it: two weights under one number
        # would be indistinguishable downstream.
        raise ValueError(f"update_params: version {version} must be greater than the loop's "
                         f"latest version {latest}")
      self._pending = (params, version)
      self._pending_since_step = self.steps

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
    for thread in (self._thread, self._worker):
      if thread is not None:
        thread.join(timeout)
        if thread.is_alive():
          raise TimeoutError(f"generator {thread.name} thread still running {timeout} s after "
                             "stop(); call stop() again to wait longer")
    self._thread = None

  def _signal_stop(self) -> None:
    """Tells the loop thread and the prefill worker to stop (the worker may be waiting)."""
    self._stop.set()
    with self._cv:
      self._cv.notify_all()

  def check(self) -> None:
    """Re-raises an exception from the loop thread."""
    if self._error is not None:
      raise GeneratorError(f"generator loop failed:\n{self._error_tb}") from self._error

  def get(self, timeout: float | None = None) -> Completion:
    """Next completion; raises GeneratorError if the loop died, queue.Empty on timeout."""
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
    with self._lock:  # the worker takes requests and counts them in flight under this lock
      return (self._requests.empty() and not self._groups and not self._ready
              and not self._in_flight and all(s is None for s in self._slots))

  def run_until_idle(self, max_steps: int | None = None) -> list[Completion]:
    """Steps in the calling thread until all submitted work is done; returns the completions."""
    n = 0
    while not self.idle():
      self.step()
      n += 1
      if max_steps is not None and n >= max_steps:
        break
    out = []
    while not self.completions.empty():
      out.append(self.completions.get())
    return out

  @property
  def num_active(self) -> int:
    return int(self._active.sum())

  def metrics(self) -> dict[str, float]:
    total = self.steps * self.engine.max_concurrent_decodes
    computed = self.computed_slot_steps
    return {
        "steps": self.steps, "generated_tokens": self.generated_tokens,
        # Active slots over the engine's B slots in every step (compacted steps count all B).
        "slot_utilization": self.active_slot_steps / total if total else 0.0,
        # Active slots over the slots each step actually computed (a compacted step computes
        # only its smaller engine's slots).
        "computed_slot_utilization": self.active_slot_steps / computed if computed else 0.0,
        "compact_steps": self.compact_steps,
        # The mean attention window per step, over the engine's cache length (1.0 = dense).
        "attention_window_fraction": (self.attended_positions / self.steps
                                      / self.engine.cache_length if self.steps else 0.0),
        "tokens_per_s": self.generated_tokens / self.decode_time_s if self.decode_time_s else 0.0,
        "version": self.version,
        "max_update_pause_s": max(self.update_pauses_s, default=0.0),
        "prefill_wait_s": self.prefill_wait_s,
        "background_prefilled": self.background_prefilled,
        "shared_prefix_hits": self.shared_prefix_hits,
        "shared_prefix_prefills": self.shared_prefix_prefills,
        "shared_prefix_tokens_skipped": self.shared_prefix_tokens_skipped,
    }

  # ---- the loop ------------------------------------------------------------------------------
  def _run(self):
    try:
      while not self._stop.is_set():
        if not self.step():
          self._wait_for_work()
    except BaseException as e:  # surfaced to the caller by check()/get()
      self._error, self._error_tb = e, traceback.format_exc()
      log.error("generator loop failed: %s", self._error_tb)
      self._signal_stop()   # the prefill worker too: nothing would take what it prefills

  def _wait_for_work(self):
    t0 = time.perf_counter()
    try:
      group = self._requests.get(timeout=self.idle_wait_s)
    except queue.Empty:
      return
    finally:
      self.idle_time_s += time.perf_counter() - t0
    self._groups.append(group)

  def step(self) -> bool:
    """One loop iteration; returns False when there was nothing to decode."""
    self._apply_pending_update()
    self._fill_slots()
    if not self._active.any():
      self._compact = None  # every compacted sequence has finished: nothing to write back
      return False
    if self.compact_drain:
      self._maybe_compact()
    act = np.flatnonzero(self._active)
    window = self.engine.window_for(int((self._prompt_len[act] + self._count[act]).max()))
    self.attended_positions += window
    t0 = time.perf_counter()
    if self._compact is None:
      eng = self.engine
      self.state, res = eng.generate(self.params, self.state, window)
      res = jax.device_get(res)
    else:
      slots, small, eng = self._compact
      small, r = eng.generate(self.params, small, window)
      self._compact = (slots, small, eng)
      r = jax.device_get(r)
      # Back to full-size per-slot arrays: row i of the compacted step is slot slots[i].
      n = self.engine.max_concurrent_decodes
      res = type(r)(*(np.zeros((n,) + np.shape(a)[1:], np.asarray(a).dtype) for a in r))
      for full, part in zip(res, r):
        full[slots] = np.asarray(part)[:len(slots)]
      self.compact_steps += 1
    self.computed_slot_steps += eng.max_concurrent_decodes
    self.decode_time_s += time.perf_counter() - t0
    self.steps += 1
    idx = np.flatnonzero(self._active)
    self.active_slot_steps += idx.size
    bad = ~res.finite[idx]
    if bad.any():
      raise NonFiniteError(f"non-finite logits in slots {idx[bad].tolist()} at policy "
                           f"version {self.version}; stopping instead of sampling garbage")
    self.generated_tokens += idx.size
    self._record(idx, res.tokens[idx], res.logprobs[idx], np.full(idx.shape, self.version))
    return True

  def _pending_work(self) -> bool:
    """Whether a request or a group sample is waiting for a slot."""
    return (not self._requests.empty() or bool(self._ready) or bool(self._in_flight)
            or any(g.next_index < g.request.group_size for g in self._groups))

  def _maybe_compact(self) -> None:
    """Moves the active slots onto a smaller engine when nothing is waiting and they fit."""
    if self._pending_work():
      return
    slots = np.flatnonzero(self._active)
    size = self.engine.compact_size(slots.size)
    current = (self.engine.max_concurrent_decodes if self._compact is None
               else self._compact[2].max_concurrent_decodes)
    if size is None or size >= current:
      return
    if self._compact is not None:
      self._expand()
    self._compact = (slots, self.engine.compact(self.state, slots),
                     self.engine.compact_engine(size))

  def _expand(self) -> None:
    """Writes the still-active compacted slots back into the full-size state."""
    slots, small, _ = self._compact
    self._compact = None
    self.state = self.engine.expand(self.state, small, np.where(self._active[slots], slots, -1))

  def _apply_pending_update(self):
    with self._lock:
      pending, self._pending = self._pending, None
      since = self._pending_since_step
      if pending is None:
        return
      t0 = time.perf_counter()
      # Under the lock: the prefill worker reads the (params, version) pair under it too.
      self.params, self.version = pending
    if self.recompute_kv_on_update:
      if self._compact is not None:
        self._expand()
      for i, s in enumerate(self._slots):
        if s is not None:  # everything in the cache: the prompt and all but the pending token
          done = self._tok_buf[i, :self._count[i] - 1].tolist()
          self.state = self.engine.refresh_slot(self.params, self.state, i,
                                                s.group.prompt + done)
      for g in self._groups:
        g.prefix = None  # re-prefilled under the new weights when their turn comes
      jax.block_until_ready(self.state)
    self.update_pauses_s.append(time.perf_counter() - t0)
    self.update_pause_steps.append(self.steps - since)

  def _next_sample(self, take_request: bool = True):
    """(group, sample index) for the next free slot, taking a new request when needed (and
    `take_request`)."""
    while self._groups and self._groups[0].next_index >= self._groups[0].request.group_size:
      self._groups.popleft()
    if not self._groups:
      if not take_request:
        return None
      try:
        self._groups.append(self._requests.get_nowait())
      except queue.Empty:
        return None
    g = self._groups[0]
    i = g.next_index
    g.next_index += 1
    return g, i

  def shared_prefix_cache(self):
    """The shared prefix's Prefix under the current weights (None without a shared_prefix): what
    Engine.precompile(existing_prefix=...) takes to compile the programs that continue it."""
    return self._shared_for(self.params, self.version) if self.shared_prefix else None

  def _shared_for(self, params, version: int):
    """The shared prefix's Prefix under weights `version` (`params`): the cached one, or
    prefilled now (in the thread that needs it: the loop's or the prefill worker's, never in
    the swap) and cached while `version` is current."""
    with self._lock:
      if self._shared is not None and self._shared[0] == version:
        return self._shared[1]
    prefix = jax.block_until_ready(self.engine.prefill(
        params, self._shared_padded, len(self.shared_prefix)))
    with self._lock:
      self.shared_prefix_prefills += 1
      if version == self.version:
        self._shared = (version, prefix)
    return prefix

  def _prefill(self, groups: list[_Group], params=None, version: int | None = None) -> None:
    """Prefills the groups that have no prefix yet: one prefill_many call per bucket and batch
    size (engine.split_batch), so every request is prefilled once, together with the others
    (those that start with the shared prefix as its continuation, apart from the rest).
    Under the loop's current weights unless `params` / `version` are given (the worker)."""
    if params is None:
      params, version = self.params, self.version
    by_bucket: dict[tuple[bool, int], list[_Group]] = {}
    for g in groups:
      by_bucket.setdefault((g.rest > 0, len(g.padded)), []).append(g)
    for (cont, _), gs in by_bucket.items():
      start = 0
      for n in self.engine.split_batch(len(gs)):
        chunk = gs[start:start + n]
        start += n
        tokens = np.stack([g.padded for g in chunk])
        if cont:
          prefixes = self.engine.prefill_many(params, tokens, [g.rest for g in chunk],
                                              existing_prefix=self._shared_for(params, version))
        else:
          prefixes = self.engine.prefill_many(params, tokens, [g.true_length for g in chunk])
        for row, g in enumerate(chunk):
          g.prefix, g.prefix_version = (prefixes, row), version
        if cont:
          with self._lock:   # the worker and the loop thread both prefill
            self.shared_prefix_hits += n
            self.shared_prefix_tokens_skipped += n * len(self.shared_prefix)

  # ---- background prefill ----------------------------------------------------------------------
  # On a CPU host a prefill and decode steps running at the same time get more work done than the
  # two one after the other (the decode step alone leaves part of the cores idle: SmolLM2-135M,
  # 2 cores, 1.2-1.5x; BENCHMARKS.md). The worker takes requests from the queue in order, one
  # prefill batch at a time, under the weights current when it takes them, and hands them over
  # prefilled; it exits when the queue is empty (the loop starts a new one when work arrives).
  def _prefill_worker(self):
    batch = self.engine.prefill_batch_sizes[-1]
    groups: list[_Group] = []
    try:
      while True:
        with self._cv:
          while True:
            if self._stop.is_set():
              self._worker = None
              return
            backlog = self._loop_backlog + sum(g.request.group_size for g in self._ready)
            if backlog < max(1, self.prefill_ahead):
              break
            self._cv.wait(0.05)
          groups = []
          while len(groups) < batch:
            try:
              groups.append(self._requests.get_nowait())
            except queue.Empty:
              break
          if not groups:
            self._worker = None
            return
          self._in_flight = len(groups)
          params, version = self.params, self.version
        self._prefill(groups, params, version)
        jax.block_until_ready([g.prefix[0] for g in groups])
        with self._cv:
          self._ready.extend(groups)
          self._in_flight = 0
          self.background_prefilled += len(groups)
          groups = []
          self._cv.notify_all()
    except BaseException as e:  # re-raised in the loop thread; the requests are kept, unprefilled
      with self._cv:
        for g in groups:
          g.prefix = None
        self._ready.extend(groups)
        self._worker_error = (e, traceback.format_exc())
        self._in_flight = 0
        self._worker = None
        self._cv.notify_all()

  def _raise_worker_error(self):
    if self._worker_error is not None:
      e, tb = self._worker_error
      raise GeneratorError(f"background prefill failed:\n{tb}") from e

  def _collect_prefilled(self):
    """Takes the worker's prefilled groups into _groups (queue order). With nothing to decode and
    nothing to insert, waits for the worker's batch in flight instead of spinning."""
    with self._cv:
      self._raise_worker_error()
      if (not self._ready and self._worker is not None and not self._active.any()
          and not any(g.next_index < g.request.group_size for g in self._groups)):
        t0 = time.perf_counter()
        self._loop_backlog = 0
        self._cv.notify_all()
        while (not self._ready and self._worker is not None and self._worker_error is None
               and not self._stop.is_set()):
          self._cv.wait(0.05)
        self.prefill_wait_s += time.perf_counter() - t0
        self._raise_worker_error()
      self._groups.extend(self._ready)
      self._ready.clear()

  def _top_up(self):
    """With background prefill: takes queued requests for the loop's own prefill when too few
    slots would decode (loop_prefill_below), or one prefill batch when nothing decodes and no
    worker runs (the start, after an idle spell)."""
    with self._cv:
      n_slots = self.engine.max_concurrent_decodes
      active = int(self._active.sum())
      waiting = sum(g.request.group_size - g.next_index for g in self._groups)
      if active + waiting < self.loop_prefill_below * n_slots:
        # Too few slots would decode: the loop prefills enough to fill every free slot itself.
        while waiting < n_slots - active:
          try:
            g = self._requests.get_nowait()
          except queue.Empty:
            break
          self._groups.append(g)
          waiting += g.request.group_size
      elif self._worker is None and not active:
        # Nothing decodes and no worker runs: the loop prefills the next batch itself.
        batch = self.engine.prefill_batch_sizes[-1]
        while sum(g.prefix is None for g in self._groups) < batch:
          try:
            self._groups.append(self._requests.get_nowait())
          except queue.Empty:
            break

  def _after_fill_background(self):
    with self._cv:
      self._loop_backlog = sum(g.request.group_size - g.next_index for g in self._groups
                               if g.prefix is not None)
      if self._worker is None and not self._requests.empty() and not self._stop.is_set():
        self._worker = threading.Thread(target=self._prefill_worker, name="generator-prefill",
                                        daemon=True)
        self._worker.start()
      self._cv.notify_all()

  def _stale(self, g: _Group) -> bool:
    """Whether a group needs a (new) prefill before its next sample goes into a slot."""
    return g.prefix is None or (self.recompute_kv_on_update and g.prefix_version != self.version)

  def _fill_slots(self):
    bg = self.background_prefill
    if bg:
      self._collect_prefilled()
    while True:
      if bg:  # (again after a sample that finished on its first token)
        self._top_up()
      plan = []  # (slot, group, sample index)
      for slot in np.flatnonzero(~self._active):
        nxt = self._next_sample(take_request=not bg)
        if nxt is None:
          break
        plan.append((int(slot), *nxt))
      if not plan:
        break
      if self._compact is not None:  # new work: the compacted slots go back first
        self._expand()
      need, seen = [], set()
      for _, g, _ in plan:
        if self._stale(g) and id(g) not in seen:
          seen.add(id(g))
          need.append(g)
      if need:  # prefill ahead: queued requests join this call (FIFO order is kept)
        for g in self._groups:
          if len(need) >= self.prefill_ahead:
            break
          if self._stale(g) and id(g) not in seen:
            seen.add(id(g))
            need.append(g)
        while not bg and len(need) < self.prefill_ahead:
          try:
            g = self._requests.get_nowait()
          except queue.Empty:
            break
          self._groups.append(g)
          need.append(g)
      self._prefill(need)
      # One insert per prefill batch the plan draws from (usually one).
      calls: dict[int, list] = {}
      for entry in plan:
        calls.setdefault(id(entry[1].prefix[0]), []).append(entry)
      firsts = []
      for entries in calls.values():
        slots = [e[0] for e in entries]
        for slot, g, i in entries:
          self._slots[slot] = _Slot(g, i)
          self._count[slot] = 0
          self._max_new[slot] = g.max_new
          self._prompt_len[slot] = g.true_length
        self._active[slots] = True
        self.state, tok, lp = self.engine.insert_many(
            entries[0][1].prefix[0], self.state, slots, [e[1].prefix[1] for e in entries],
            np.stack([e[1].key for e in entries]), [e[2] for e in entries], self._active)
        self._device_active = self._active.copy()
        firsts.append((entries, tok, lp))
      firsts = jax.device_get(firsts)  # one transfer for all first tokens
      finished = False
      for entries, tok, lp in firsts:
        m = len(entries)
        # The first token's log-prob is NaN when its prompt's last logits hold a NaN or a +Inf
        # (the decode step checks every logit of the later tokens, -Inf included): stop rather
        # than stream garbage.
        bad = ~np.isfinite(lp[:m])
        if bad.any():
          ids = [entries[j][1].request.id for j in np.flatnonzero(bad)]
          raise NonFiniteError(f"non-finite prompt logits for requests {ids} at policy version "
                               f"{entries[0][1].prefix_version}; stopping instead of sampling "
                               "garbage")
        finished |= self._record(np.array([e[0] for e in entries]), tok[:m], lp[:m],
                                 np.array([e[1].prefix_version for e in entries]))
      if not finished:  # a sample can finish on its first token: refill its slot right away
        break
    if bg:
      self._after_fill_background()
    if not np.array_equal(self._device_active, self._active):
      self.state = self.engine.set_active(self.state, self._active)
      self._device_active = self._active.copy()

  def _record(self, slots: np.ndarray, tokens: np.ndarray, logprobs: np.ndarray,
              versions: np.ndarray) -> bool:
    """Appends one token per listed slot; streams out the completions this finishes and frees
    their slots. Returns whether any finished."""
    c = self._count[slots]
    self._tok_buf[slots, c] = tokens
    self._lp_buf[slots, c] = logprobs
    self._ver_buf[slots, c] = versions
    self._count[slots] = c + 1
    eos = (tokens == self.sampling.eos_id) if self.sampling.eos_id is not None \
        else np.zeros(slots.shape, bool)
    length = self._count[slots] >= self._max_new[slots]
    stop = np.zeros(slots.shape, bool)
    if self._max_stop:
      for j in np.flatnonzero(~eos):
        stop[j] = self._hit_stop(self._tok_buf[slots[j], :c[j] + 1])
    done = eos | stop | length
    for j in np.flatnonzero(done):
      slot = int(slots[j])
      reason = "eos" if eos[j] else "stop" if stop[j] else "length"
      self._finish(slot, reason)
    return bool(done.any())

  def _finish(self, slot: int, reason: str) -> None:
    s, n = self._slots[slot], int(self._count[slot])
    self._slots[slot] = None
    self._active[slot] = False
    g = s.group
    c = Completion(g.request.id, s.index, list(g.prompt), self._tok_buf[slot, :n].tolist(),
                   self._lp_buf[slot, :n].copy(), self._ver_buf[slot, :n].copy(), reason,
                   g.request.metadata, g.truncated)
    self.completions.put(c)
    if self.callback is not None:
      self.callback(c)

  def _hit_stop(self, tokens) -> bool:
    # Only the tail can contain a stop string that the previous step did not already contain.
    tail = self.detokenize(tokens[-(self._max_stop + 8):].tolist())
    return any(s in tail for s in self.sampling.stop_strings)
