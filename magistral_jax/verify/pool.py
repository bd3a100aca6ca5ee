"""A long-lived pool of CPU verifier processes that scores completions and never stalls.

One dispatcher thread owns the workers. It hands a task to an idle worker, waits on the result
pipes, the worker sentinels and a wake-up pipe, and enforces each task's deadline:
  - timeout: the worker is SIGKILLed (its sandboxed programs die with it through PDEATHSIG and
    PID namespaces), the future gets reward 0 with an error, and a fresh worker takes the slot;
  - crash: same, with "worker died";
  - recycling: after `max_tasks_per_worker` tasks a successor is started in the background; the
    old worker keeps taking tasks until the successor reports ready (a worker needs seconds to
    import and warm the verifiers), then it is retired and the successor takes its slot, so a
    recycle never leaves a slot empty.
Submitting blocks when `max_queue` tasks are waiting (back-pressure). Futures always resolve to a
RewardResult; nothing raises into the caller.

Workers are started with the "spawn" method: the parent is usually a JAX process with threads,
where fork is unsafe. Each slot owns an unprivileged uid for its sandbox (uid_base + slot).
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

from magistral_jax.rewards import sandbox
from magistral_jax.rewards.reward import RewardConfig, RewardResult, compute_reward, failed_result

log = logging.getLogger(__name__)


def _worker_main(conn, slot: int, uid: int, cfg: RewardConfig):
  import signal
  signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C is the parent's to handle
  from magistral_jax.rewards import sandbox
  from magistral_jax.rewards import math_check, language
  sandbox.configure(uid=uid, allow_weak=cfg.allow_weak_sandbox)
  try:   # warm the heavy imports before reporting ready
    math_check.math_equal("1", "1")
    language.detect_language("warm up")
  except Exception:
    pass
  conn.send(("ready", os.getpid()))
  while True:
    try:
      msg = conn.recv()
    except (EOFError, OSError):
      return
    if msg is None:
      return
    tid, task, response, response_tokens, group_seed = msg
    try:
      res = compute_reward(task, response, response_tokens, cfg, group_seed)
    except BaseException as e:   # compute_reward catches Exception; this is SystemExit & co.
      res = failed_result(f"worker error: {type(e).__name__}: {e}")
    conn.send(("done", tid, res))


@dataclasses.dataclass
class _Worker:
  slot: int
  proc: mp.Process
  conn: mpc.Connection
  ready: bool = False
  tid: int | None = None
  deadline: float = 0.0
  tasks_done: int = 0
  retired: bool = False


@dataclasses.dataclass
class _Pending:
  tid: int
  payload: tuple
  future: concurrent.futures.Future
  submitted: float


class VerifierPool:
  """Process pool that computes `compute_reward` for submitted completions."""

  def __init__(self, num_workers: int = 2, reward_cfg: RewardConfig | None = None,
               task_timeout_s: float = 120.0, max_tasks_per_worker: int = 1000,
               max_queue: int = 1024, uid_base: int | None = None):
    if num_workers < 1:
      raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    self.num_workers = num_workers
    self.reward_cfg = reward_cfg or RewardConfig()
    self.task_timeout_s = task_timeout_s
    self.max_tasks_per_worker = max_tasks_per_worker
    # Distinct pools on one machine get distinct uid ranges (RLIMIT_NPROC counts per uid).
    self.uid_base = uid_base if uid_base is not None else 60000 + (os.getpid() % 4000) * 64
    self._ctx = mp.get_context("spawn")
    self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
    self._ids = itertools.count()
    self._closed = False
    self._abort = False
    self._lock = threading.Lock()
    self._wake_r, self._wake_w = os.pipe()
    os.set_blocking(self._wake_w, False)
    os.set_blocking(self._wake_r, False)
    self._workers: list[_Worker] = [self._start_worker(s) for s in range(num_workers)]
    self._successors: dict[int, _Worker] = {}   # slot -> worker starting up to replace it
    self._latencies: collections.deque = collections.deque(maxlen=2048)
    self._counts = collections.Counter()
    self._t0 = time.monotonic()
    self._thread = threading.Thread(target=self._dispatch, name="verifier-pool", daemon=True)
    self._thread.start()

  # ------------------------------------------------------------------ public API

  def submit(self, task: dict, response: str, response_tokens: int | None = None,
             group_seed: int = 0) -> concurrent.futures.Future:
    """Queues one completion; blocks while the queue is full. Returns a Future[RewardResult]."""
    if self._closed:
      raise RuntimeError("VerifierPool is closed")
    fut: concurrent.futures.Future = concurrent.futures.Future()
    item = _Pending(next(self._ids), (task, response, response_tokens, group_seed), fut,
                    time.monotonic())
    self._queue.put(item)
    with self._lock:
      self._counts["submitted"] += 1
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
        throughput_per_s=c.get("completed", 0) / elapsed if elapsed > 0 else 0.0,
        latency_mean_s=sum(lat) / len(lat) if lat else 0.0,
        latency_p50_s=pct(0.5), latency_p95_s=pct(0.95), latency_max_s=lat[-1] if lat else 0.0)

  def worker_pids(self) -> list[int]:
    return [w.proc.pid for w in self._all_workers() if w.proc.pid is not None]

  def close(self, timeout: float = 10.0):
    """Finishes queued work (up to `timeout`), then stops every worker. Idempotent."""
    if self._closed:
      return
    self._closed = True
    self._wake()
    self._thread.join(timeout)
    if self._thread.is_alive():   # still busy at the timeout: abandon the running tasks
      self._abort = True
      self._wake()
      self._thread.join(5.0)
    self._shutdown_workers()
    # Anything left (the dispatcher was still busy at the timeout) resolves as an error.
    self._fail_queued("pool closed before the task ran")
    for fd in (self._wake_r, self._wake_w):
      try:
        os.close(fd)
      except OSError:
        pass

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

  def _wake(self):
    try:
      os.write(self._wake_w, b"x")
    except (BlockingIOError, OSError):
      pass   # pipe full: the dispatcher is already due to wake

  def _all_workers(self) -> list[_Worker]:
    """The slot holders and the successors starting up to replace them."""
    return [*self._workers, *self._successors.values()]

  def _start_worker(self, slot: int) -> _Worker:
    parent, child = self._ctx.Pipe(duplex=True)
    proc = self._ctx.Process(target=_worker_main, name=f"verifier-{slot}",
                             args=(child, slot, self.uid_base + slot, self.reward_cfg), daemon=True)
    proc.start()
    child.close()
    return _Worker(slot, proc, parent)

  def _stop_worker(self, w: _Worker, kill: bool):
    if kill:
      w.proc.kill()
    else:
      try:
        w.conn.send(None)
      except OSError:
        w.proc.kill()
    w.proc.join(5.0 if not kill else 1.0)
    if w.proc.is_alive():
      w.proc.kill()
      w.proc.join(1.0)
    if not w.proc.is_alive():   # a killed worker leaves its run dir behind
      sandbox.remove_leftovers(w.proc.pid)
    w.conn.close()
    w.retired = True

  def _replace(self, w: _Worker, kill: bool):
    """Retires w; its successor (if one is starting) or a new worker takes the slot."""
    self._stop_worker(w, kill)
    nxt = self._successors.pop(w.slot, None)
    if self._closed:
      if nxt is not None:
        self._stop_worker(nxt, kill=True)
      return
    self._workers[w.slot] = nxt if nxt is not None else self._start_worker(w.slot)

  def _maybe_recycle(self, w: _Worker):
    """Called when w is idle: starts its successor once w has done its share of tasks, and hands
    the slot over once the successor is ready."""
    if w.tasks_done < self.max_tasks_per_worker or self._closed:
      return
    nxt = self._successors.get(w.slot)
    if nxt is None:
      self._successors[w.slot] = self._start_worker(w.slot)
    elif nxt.ready:
      with self._lock:
        self._counts["recycled"] += 1
      self._replace(w, kill=False)

  def _resolve(self, item: _Pending, res: RewardResult, counter: str | None = None):
    with self._lock:
      self._counts["completed"] += 1
      if counter:
        self._counts[counter] += 1
      if res.error:
        self._counts["errors"] += 1
      self._latencies.append(time.monotonic() - item.submitted)
    if not item.future.done():
      item.future.set_result(res)

  def _fail_queued(self, msg: str):
    while True:
      try:
        item = self._queue.get_nowait()
      except queue.Empty:
        return
      self._resolve(item, failed_result(msg))

  def _dispatch(self):
    running: dict[int, _Pending] = {}
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
          w.tid, w.deadline = item.tid, time.monotonic() + self.task_timeout_s
          running[item.tid] = item
      if self._closed and not running and self._queue.empty():
        return
      now = time.monotonic()
      deadlines = [w.deadline for w in self._workers if w.tid is not None]
      wait_s = max(0.0, min(deadlines) - now) if deadlines else 0.5
      objs = {self._wake_r: None}
      for w in self._all_workers():
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
        if self._successors.get(w.slot) is w:
          self._on_successor_event(w, obj)
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
            self._maybe_recycle(w)
        elif not w.proc.is_alive():
          self._on_crash(w, running)
      now = time.monotonic()
      for w in list(self._workers):
        if w.tid is not None and now >= w.deadline and not w.retired:
          item = running.pop(w.tid)
          log.warning("verifier task %d timed out after %.1fs; killing worker %d", item.tid,
                      self.task_timeout_s, w.slot)
          w.tid = None
          self._resolve(item, failed_result(f"verification timed out after {self.task_timeout_s}s"),
                        "timeouts")
          self._replace(w, kill=True)

  def _on_successor_event(self, nxt: _Worker, obj):
    """A message or exit of a successor that is still starting up (it sends only "ready")."""
    if obj is nxt.conn:
      try:
        msg = nxt.conn.recv()
      except (EOFError, OSError):
        msg = None
      if msg is not None and msg[0] == "ready":
        nxt.ready = True
        cur = self._workers[nxt.slot]
        if cur.tid is None:   # the old worker is idle: hand over now (else after its task)
          self._maybe_recycle(cur)
        return
    # Its pipe closed or its sentinel fired: the successor died while starting. Drop it; the old
    # worker's next idle moment starts another.
    log.warning("verifier successor for slot %d died while starting (exit code %s)", nxt.slot,
                nxt.proc.exitcode)
    del self._successors[nxt.slot]
    self._stop_worker(nxt, kill=True)

  def _on_crash(self, w: _Worker, running: dict):
    if self._workers[w.slot] is not w or w.retired:
      return
    code = w.proc.exitcode
    if w.tid is not None:
      item = running.pop(w.tid)
      self._resolve(item, failed_result(f"verifier worker died (exit code {code})"), "crashes")
      w.tid = None
    else:
      with self._lock:
        self._counts["crashes"] += 1
    log.warning("verifier worker %d died (exit code %s); restarting", w.slot, code)
    self._replace(w, kill=True)

  def _shutdown_workers(self):
    for w in list(self._successors.values()):
      self._stop_worker(w, kill=True)
    self._successors.clear()
    for w in self._workers:
      if w.retired:
        continue
      try:
        w.conn.send(None)
      except OSError:
        pass
    deadline = time.monotonic() + 5.0
    for w in self._workers:
      if w.retired:
        continue
      w.retired = True
      w.proc.join(max(0.1, deadline - time.monotonic()))
      if w.proc.is_alive():
        w.proc.kill()
        w.proc.join(2.0)
      w.conn.close()
