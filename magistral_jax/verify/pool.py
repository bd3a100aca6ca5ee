"""A long-lived pool of CPU verifier processes that scores completions and never stalls.

One dispatcher thread owns the workers. It hands a task to an idle worker, waits on the result
pipes, the worker sentinels and a wake-up pipe, and enforces each task's deadline:
  - timeout: the worker is SIGKILLed, the future gets reward 0 with an error, and a fresh worker
    takes the slot once the old one's sandboxes are gone (verify/uids.py). A task's deadline is
    task_timeout_s plus the longest its code may take under its own limits
    (code_check.worst_case_s), so only a hung worker meets it, never a slow honest program;
  - crash: same, with "worker died";
  - recycling: after `max_tasks_per_worker` tasks a successor is started in the background; the
    old worker keeps taking tasks until the successor reports ready (a worker needs seconds to
    import and warm the verifiers), then it is retired and the successor takes its slot, so a
    recycle never leaves a slot empty.
Submitting blocks when `max_queue` tasks are waiting (back-pressure). Futures always resolve to a
RewardResult; nothing raises into the caller. A failing cleanup step (removing a dead worker's
run dirs, killing its sandboxes) is logged and counted (`cleanup_errors`) and the pool keeps
serving. Should the dispatcher fail anyway, every running and queued task resolves with an error
that names the failure, and `submit` raises from then on ("verifier pool stopped: ...").

Workers are started with the "spawn" method: the parent is usually a JAX process with threads,
where fork is unsafe. The worker's side, and starting and stopping one: verify/worker.py. The
slots (who holds each, successors, recycling, cleaning a slot between holders): verify/slots.py.
Each slot's sandboxes run as a uid of its own, and whatever still runs as it once its worker is
gone is killed: verify/uids.py.
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import itertools
import logging
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import queue
import threading
import time

from magistral_jax.rewards import code_check, sandbox
from magistral_jax.rewards.config import RewardConfig
from magistral_jax.rewards.reward import RewardResult, failed_result
from magistral_jax.verify.config import VerifierConfig
from magistral_jax.verify.slots import Slots
from magistral_jax.verify.uids import MAX_SLOTS, MIN_SWEEP_UID, release_uid_offsets, slot_uids
from magistral_jax.verify.worker import Worker

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Pending:
  tid: int
  payload: tuple
  future: concurrent.futures.Future
  submitted: float
  timeout_s: float = 0.0     # from its start on a worker to its deadline (see `submit`)



class VerifierPool:
  """Process pool that computes `compute_reward` for submitted completions."""

  def __init__(self, num_workers: int = 2, reward_cfg: RewardConfig | None = None,
               task_timeout_s: float = 120.0, max_tasks_per_worker: int = 1000,
               max_queue: int = 1024, uid_base: int | None = None,
               sweep_timeout_s: float = 5.0):
    if not 1 <= num_workers <= MAX_SLOTS:
      raise ValueError(f"num_workers must be in 1..{MAX_SLOTS} (each slot takes one of the "
                       f"{sandbox.UIDS_PER_PROCESS} sandbox uids of this process, the last is a "
                       f"stand-alone Sandbox's), got {num_workers}")
    self.num_workers = num_workers
    self.reward_cfg = reward_cfg or RewardConfig()
    self.task_timeout_s = task_timeout_s
    self.max_tasks_per_worker = max_tasks_per_worker
    self.sweep_timeout_s = sweep_timeout_s
    # Slot s runs its sandboxes as uid_base + s. The default is this process's own block
    # (1_000_000 + 256 * pid; offset by the slots of its other live pools), so distinct pools and
    # processes never share a uid: RLIMIT_NPROC counts per uid, and a slot's uid is killed whole.
    self.uid_base, self._uid_offsets = slot_uids(num_workers, uid_base)
    # Only root runs sandboxes under other uids (see the module docstring); never a uid that may
    # be a real account's.
    self._sweeps = os.geteuid() == 0 and self.uid_base >= MIN_SWEEP_UID
    self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
    self._ids = itertools.count()
    self._closed = False
    self._abort = False
    self._stopped: str | None = None   # why the dispatcher failed, once it has
    self._lock = threading.Lock()
    self._latencies: collections.deque = collections.deque(maxlen=2048)
    self._counts = collections.Counter()
    self._wake_r, self._wake_w = os.pipe()
    os.set_blocking(self._wake_w, False)
    os.set_blocking(self._wake_r, False)
    try:
      self._slots = Slots(mp.get_context("spawn"), num_workers, self.uid_base, self.reward_cfg,
                          max_tasks_per_worker, self._sweeps, sweep_timeout_s, self._count)
    except BaseException:   # e.g. no process could be started: give back what we took
      self._closed = True
      release_uid_offsets(self._uid_offsets)
      raise
    self._t0 = time.monotonic()
    self._thread = threading.Thread(target=self._dispatch, name="verifier-pool", daemon=True)
    self._thread.start()

  @classmethod
  def from_config(cls, cfg: VerifierConfig, reward_cfg: RewardConfig | None = None):
    """The pool the run config's `verifier` section describes (this class, or the Ray backend
    for verifier.backend="ray"), scoring with `reward_cfg`."""
    if cfg.backend == "ray":
      from magistral_jax.verify.ray_pool import RayVerifierPool
      return RayVerifierPool.from_config(cfg, reward_cfg)
    return cls(num_workers=cfg.num_workers, reward_cfg=reward_cfg,
               task_timeout_s=cfg.task_timeout_s, max_tasks_per_worker=cfg.max_tasks_per_worker)

  # ------------------------------------------------------------------ public API

  def submit(self, task: dict, response: str, response_tokens: int | None = None,
             group_seed: int = 0) -> concurrent.futures.Future:
    """Queues one completion; blocks while the queue is full. Returns a Future[RewardResult]."""
    if self._closed:
      raise RuntimeError("VerifierPool is closed")
    if self._stopped is not None:
      raise RuntimeError(f"verifier pool stopped: {self._stopped}")
    fut: concurrent.futures.Future = concurrent.futures.Future()
    # The deadline: task_timeout_s plus the longest its code may take under its own limits, so
    # a slow honest program ends by its own limits' verdict; only a hung worker meets it.
    c = self.reward_cfg
    timeout_s = self.task_timeout_s + code_check.worst_case_s(task, c.num_tests, c.test_timeout_s,
                                                              c.compile_timeout_s)
    item = _Pending(next(self._ids), (task, response, response_tokens, group_seed), fut,
                    time.monotonic(), timeout_s)
    self._queue.put(item)
    with self._lock:
      self._counts["submitted"] += 1
    if self._stopped is not None:
      # The dispatcher failed while we waited for room (its failure drained the queue): nobody
      # will take this task, so fail it here.
      self._fail_queued(f"verifier pool stopped: {self._stopped}")
    self._wake()
    return fut

  def map(self, items, timeout: float | None = None) -> list[RewardResult]:
    """Scores (task, response, response_tokens, group_seed) tuples; results in input order."""
    futs = [self.submit(*it) for it in items]
    return [f.result(timeout) for f in futs]

  def metrics(self) -> dict:
    with self._lock:
      lat = sorted(self._latencies)
      c = dict(self._counts)
    elapsed = time.monotonic() - self._t0
    pct = lambda q: lat[min(len(lat) - 1, int(q * len(lat)))] if lat else 0.0
    return dict(
        workers=self.num_workers, queued=self._queue.qsize(),
        busy=sum(w.tid is not None for w in self._workers),
        submitted=c.get("submitted", 0), completed=c.get("completed", 0),
        timeouts=c.get("timeouts", 0), crashes=c.get("crashes", 0),
        recycled=c.get("recycled", 0), errors=c.get("errors", 0),
        cleanup_errors=c.get("cleanup_errors", 0),
        # Processes of a slot's uid found alive once its worker was gone (some may have been
        # dying already), killed; and those still alive when the bounded wait for them ended.
        orphans_killed=c.get("orphans_killed", 0), orphans_left=c.get("orphans_left", 0),
        stopped=self._stopped,
        throughput_per_s=c.get("completed", 0) / elapsed if elapsed > 0 else 0.0,
        latency_mean_s=sum(lat) / len(lat) if lat else 0.0,
        latency_p50_s=pct(0.5), latency_p95_s=pct(0.95), latency_max_s=lat[-1] if lat else 0.0)

  def worker_pids(self) -> list[int]:
    return [w.proc.pid for w in self._slots.all() if w.proc.pid is not None]

  def close(self, timeout: float = 10.0):
    """Finishes queued work (up to `timeout`), then stops every worker. Idempotent."""
    if self._closed:
      return
    self._closed = self._slots.closed = True
    self._wake()
    self._thread.join(timeout)
    if self._thread.is_alive():   # still busy at the timeout: abandon the running tasks
      self._abort = True
      self._wake()
      self._thread.join(5.0)
    self._slots.shutdown()
    # Anything left (the dispatcher was still busy at the timeout) resolves as an error.
    self._fail_queued("pool closed before the task ran")
    for fd in (self._wake_r, self._wake_w):
      try:
        os.close(fd)
      except OSError:
        pass
    release_uid_offsets(self._uid_offsets)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  def __del__(self):
    try:
      self.close(timeout=1.0)
    except Exception:
      pass

  # ------------------------------------------------------------------ internals

  @property
  def _workers(self) -> list[Worker]:
    return self._slots.workers

  def _count(self, name: str, n: int = 1):
    with self._lock:
      self._counts[name] += n

  def _wake(self):
    try:
      os.write(self._wake_w, b"x")
    except (BlockingIOError, OSError):
      pass   # pipe full: the dispatcher is already due to wake

  def _resolve(self, item: _Pending, res: RewardResult, counter: str | None = None):
    with self._lock:
      self._counts["completed"] += 1
      if counter:
        self._counts[counter] += 1
      if res.error:
        self._counts["errors"] += 1
      self._latencies.append(time.monotonic() - item.submitted)
    try:
      item.future.set_result(res)
    except concurrent.futures.InvalidStateError:
      pass   # the caller cancelled it (or it already resolved): nothing to tell

  def _fail_queued(self, msg: str):
    while True:
      try:
        item = self._queue.get_nowait()
      except queue.Empty:
        return
      self._resolve(item, failed_result(msg))

  def _dispatch(self):
    running: dict[int, _Pending] = {}
    try:
      self._dispatch_loop(running)
    except BaseException as e:
      self._on_dispatcher_failure(e, running)

  def _on_dispatcher_failure(self, e: BaseException, running: dict):
    """The loop raised (a bug, or a failure outside the guarded cleanups): the pool cannot serve
    on. Every task it holds resolves with an error naming the failure, `submit` raises from now
    on, and the workers (and their sandboxes) are stopped."""
    why = f"dispatcher failed: {type(e).__name__}: {e}"
    self._stopped = why
    log.critical("verifier pool stopped: %s; failing %d running and %d queued task(s)", why,
                 len(running), self._queue.qsize(), exc_info=(type(e), e, e.__traceback__))
    msg = f"verifier pool stopped: {why}"
    for item in list(running.values()):
      self._resolve(item, failed_result(msg))
    running.clear()
    self._fail_queued(msg)
    # Their tasks have resolved already: kill them rather than wait for the tasks to end.
    self._slots.closed = True
    self._slots.cleanup("stopping the workers of the stopped pool", self._slots.shutdown, False)

  def _dispatch_loop(self, running: dict):
    while True:
      if self._abort:
        for item in running.values():
          self._resolve(item, failed_result("pool closed while the task ran"))
        return
      # Hand queued work to idle, ready workers.
      for w in self._workers:
        if w.ready and w.tid is None and not w.retired:
          try:
            item = self._queue.get_nowait()
          except queue.Empty:
            break
          try:
            w.conn.send((item.tid, *item.payload))
          except Exception as e:   # unpicklable task, or the worker just died
            self._resolve(item, failed_result(f"could not send task to worker: {e}"))
            continue
          w.tid, w.deadline = item.tid, time.monotonic() + item.timeout_s
          running[item.tid] = item
      if self._closed and not running and self._queue.empty():
        return
      now = time.monotonic()
      deadlines = [w.deadline for w in self._workers if w.tid is not None]
      wait_s = max(0.0, min(deadlines) - now) if deadlines else 0.5
      objs = {self._wake_r: None}
      for w in self._slots.all():
        if not w.retired:
          objs[w.conn] = w
          objs[w.proc.sentinel] = w
      ready = mpc.wait(list(objs), timeout=wait_s)
      for obj in ready:
        if obj == self._wake_r:
          try:
            while os.read(self._wake_r, 4096):
              pass
          except (BlockingIOError, OSError):
            pass
          continue
        w = objs[obj]
        if self._slots.successors.get(w.slot) is w:
          self._slots.on_successor_event(w, obj)
          continue
        if self._workers[w.slot] is not w or w.retired:
          continue   # already replaced during this round
        if obj is w.conn:
          try:
            msg = w.conn.recv()
          except (EOFError, OSError):
            msg = None
          if msg is None:
            self._on_crash(w, running)
          elif msg[0] == "ready":
            w.ready = True
          elif msg[0] == "done" and msg[1] == w.tid:
            item = running.pop(w.tid)
            w.tid = None
            w.tasks_done += 1
            self._resolve(item, msg[2])
            self._slots.maybe_recycle(w)
        elif not w.proc.is_alive():
          self._on_crash(w, running)
      now = time.monotonic()
      for w in list(self._workers):
        if w.tid is not None and now >= w.deadline and not w.retired:
          item = running.pop(w.tid)
          log.warning("verifier task %d timed out after %.1fs; killing worker %d", item.tid,
                      item.timeout_s, w.slot)
          w.tid = None
          self._resolve(item, failed_result(f"verification timed out after {item.timeout_s:g}s"),
                        "timeouts")
          self._slots.replace(w, kill=True)

  def _on_crash(self, w: Worker, running: dict):
    if self._workers[w.slot] is not w or w.retired:
      return
    code = w.proc.exitcode
    if w.tid is not None:
      item = running.pop(w.tid)
      self._resolve(item, failed_result(f"verifier worker died (exit code {code})"), "crashes")
      w.tid = None
    else:
      self._count("crashes")
    log.warning("verifier worker %d died (exit code %s); restarting", w.slot, code)
    self._slots.replace(w, kill=True)
