"""The verifier pool's worker slots (verify/pool.py dispatches tasks to them): who holds each
slot, the successor starting up to replace it (recycling never leaves a slot empty), and keeping
a slot's sandbox uid clean between holders: a holder that dies or is retired is stopped, its run
dirs and run cgroups removed, and whatever still runs as the slot's uid killed (verify/uids.py)
before the next holder starts.
"""
from __future__ import annotations

import logging
import time

from magistral_jax.rewards import sandbox, sandbox_keys
from magistral_jax.rewards.config import RewardConfig
from magistral_jax.verify.uids import kill_uid_processes
from magistral_jax.verify.worker import Worker, start_worker, stop_worker

log = logging.getLogger(__name__)


class Slots:
  """The slot holders of one pool and their successors. Stateful (the workers), so a class; only
  the pool's dispatcher thread (and its constructor and close) call it. `count(name, n)` adds to
  the pool's counters."""

  def __init__(self, ctx, num_workers: int, uid_base: int, reward_cfg: RewardConfig,
               max_tasks_per_worker: int, sweeps: bool, sweep_timeout_s: float, count):
    self.ctx, self.uid_base, self.reward_cfg = ctx, uid_base, reward_cfg
    self.max_tasks_per_worker = max_tasks_per_worker
    self.sweeps, self.sweep_timeout_s, self.count = sweeps, sweep_timeout_s, count
    self.closed = False
    self.successors: dict[int, Worker] = {}   # slot -> worker starting up to replace it
    self.workers: list[Worker] = []
    try:
      for s in range(num_workers):
        self.sweep(s)   # a previous process with our pid may have left runs of these uids
        self.workers.append(self.start(s))
    except BaseException:   # e.g. no process could be started: give back what we took
      for w in self.workers:
        stop_worker(w, self.cleanup, kill=True)
      raise

  def all(self) -> list[Worker]:
    """The slot holders and the successors starting up to replace them."""
    return [*self.workers, *self.successors.values()]

  def start(self, slot: int) -> Worker:
    return start_worker(self.ctx, slot, self.uid_base + slot, self.reward_cfg)

  def cleanup(self, what: str, fn, *args):
    """Runs one cleanup step. Its failure is logged and counted, never raised: a cleanup that
    raises in the dispatcher (rmtree's RecursionError on a 2,500-deep tree a program left, issue
    #50) must not stop the pool, or no future of the batch ever resolves."""
    try:
      return fn(*args)
    except Exception as e:
      self.count("cleanup_errors")
      log.error("verifier pool: %s failed (%s: %s); serving on", what, type(e).__name__, e,
                exc_info=True)
      return None

  def sweep(self, slot: int):
    """Kills whatever still runs as the slot's uid (see the module docstring). Called only when
    no live worker of the slot runs sandboxes: a successor still starting up runs its sandbox
    probes as that uid, so `_replace` stops it first."""
    if not self.sweeps:
      return
    uid = self.uid_base + slot
    res = self.cleanup(f"killing the processes of slot {slot}'s uid {uid}", kill_uid_processes,
                        uid, self.sweep_timeout_s)
    # A worker killed mid-run never reached its own removal of the uid's kernel keys.
    self.cleanup(f"removing the kernel keys of slot {slot}'s uid {uid}",
                  sandbox_keys.remove_uid_keys, uid)
    if not res or not res[0]:
      return
    found, left = res
    self.count("orphans_killed", found - left)
    self.count("orphans_left", left)
    log.warning("verifier slot %d: killed %d process(es) of its sandbox uid %d that outlived their "
                "worker%s", slot, found - left, uid, f"; {left} still alive" if left else "")

  def replace(self, w: Worker, kill: bool):
    """Retires w; its successor (if one is ready) or a new worker takes the slot, once nothing of
    the slot's uid is left running."""
    stop_worker(w, self.cleanup, kill)
    nxt = self.successors.pop(w.slot, None)
    if nxt is not None and not nxt.ready:
      # Still starting: its sandbox probes run as the slot uid, and the sweep below would kill
      # them (the worker would then settle for a weaker sandbox, or none). A fresh one follows.
      stop_worker(nxt, self.cleanup, kill=True)
      nxt = None
    self.sweep(w.slot)
    if self.closed:
      if nxt is not None:
        stop_worker(nxt, self.cleanup, kill=True)
      return
    self.workers[w.slot] = nxt if nxt is not None else self.start(w.slot)

  def maybe_recycle(self, w: Worker):
    """Called when w is idle: starts its successor once w has done its share of tasks, and hands
    the slot over once the successor is ready."""
    if w.tasks_done < self.max_tasks_per_worker or self.closed:
      return
    nxt = self.successors.get(w.slot)
    if nxt is None:
      self.successors[w.slot] = self.start(w.slot)
    elif nxt.ready:
      self.count("recycled")
      self.replace(w, kill=False)

  def on_successor_event(self, nxt: Worker, obj):
    """A message or exit of a successor that is still starting up (it sends only "ready")."""
    if obj is nxt.conn:
      try:
        msg = nxt.conn.recv()
      except (EOFError, OSError):
        msg = None
      if msg is not None and msg[0] == "ready":
        nxt.ready = True
        cur = self.workers[nxt.slot]
        if cur.tid is None:   # the old worker is idle: hand over now (else after its task)
          self.maybe_recycle(cur)
        return
    # Its pipe closed or its sentinel fired: the successor died while starting. Drop it; the old
    # worker's next idle moment starts another. (No sweep: the slot's worker runs sandboxes as
    # the same uid, and a starting successor ran only its probes.)
    log.warning("verifier successor for slot %d died while starting (exit code %s)", nxt.slot,
                nxt.proc.exitcode)
    del self.successors[nxt.slot]
    stop_worker(nxt, self.cleanup, kill=True)

  def shutdown(self, graceful: bool = True):
    """Stops every worker: asks them to exit (kills them after 5 s, or at once unless
    `graceful`), removes their run dirs, then kills whatever still runs as a slot uid."""
    for w in list(self.successors.values()):
      stop_worker(w, self.cleanup, kill=True)
    self.successors.clear()
    for w in self.workers:
      if w.retired or not graceful:
        continue
      try:
        w.conn.send(None)
      except Exception:
        pass
    deadline = time.monotonic() + (5.0 if graceful else 0.0)
    for w in self.workers:
      if w.retired:
        continue
      w.retired = True
      self.cleanup(f"waiting for worker {w.proc.pid}", w.proc.join,
                    max(0.1, deadline - time.monotonic()))
      if w.proc.is_alive():
        self.cleanup(f"killing worker {w.proc.pid}", w.proc.kill)
        self.cleanup(f"waiting for worker {w.proc.pid}", w.proc.join, 2.0)
      if not w.proc.is_alive():
        self.cleanup(f"removing the run dirs of worker {w.proc.pid}", sandbox.remove_leftovers,
                      w.proc.pid)
      self.cleanup(f"closing the pipe of worker {w.proc.pid}", w.conn.close)
    # Every worker is gone: whatever still runs as a slot uid is an orphaned sandbox.
    for s in range(len(self.workers)):
      self.sweep(s)
