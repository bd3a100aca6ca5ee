"""Ray backend for the verifier pool: same interface as VerifierPool, workers on many machines.

Optional extra (`pip install magistral_jax[ray]`). Each Ray actor is a long-lived verifier with
its own sandbox uid; it runs `compute_reward` in its main thread (math-verify's SIGALRM timeouts
need that: actors are created with max_concurrency=1). A watcher thread enforces the per-task
deadline by killing the actor (ray.kill) and starting a replacement, like the process pool.
"""
from __future__ import annotations

import collections
import concurrent.futures
import threading
import time

from magistral_jax.rewards import code_check
from magistral_jax.rewards.reward import RewardResult, compute_reward, failed_result
from magistral_jax.rewards.config import RewardConfig
from magistral_jax.verify.uids import release_uid_offsets, slot_uids


def _ray():
  try:
    import ray
  except ImportError as e:
    raise ImportError("the Ray verifier backend needs `ray` (pip install magistral_jax[ray])") from e
  return ray


class _Verifier:
  def __init__(self, uid: int, cfg: RewardConfig):
    from magistral_jax.rewards import sandbox
    sandbox.configure(uid=uid, allow_weak=cfg.allow_weak_sandbox)
    self.cfg = cfg

  def score(self, task, response, response_tokens, group_seed):
    return compute_reward(task, response, response_tokens, self.cfg, group_seed)


class RayVerifierPool:
  """VerifierPool over Ray actors. Call `ray.init(...)` first (or it starts a local instance)."""

  def __init__(self, num_workers: int = 2, reward_cfg: RewardConfig | None = None,
               task_timeout_s: float = 120.0, max_tasks_per_worker: int = 1000,
               max_queue: int = 1024, uid_base: int | None = None):
    ray = _ray()
    if not ray.is_initialized():
      ray.init(num_cpus=num_workers, include_dashboard=False, log_to_driver=False)
    self._ray = ray
    self.num_workers = num_workers
    self.reward_cfg = reward_cfg or RewardConfig()
    self.task_timeout_s = task_timeout_s
    self.max_tasks_per_worker = max_tasks_per_worker
    # Slot uids from this process's block, disjoint from its other pools' (verify/pool.py). A
    # killed actor's sandboxes may run on another host, where no sweep of the uid reaches them.
    self.uid_base, self._uid_offsets = slot_uids(num_workers, uid_base)
    self._actor_cls = ray.remote(num_cpus=1, max_concurrency=1)(_Verifier)
    self._slots = threading.BoundedSemaphore(max_queue + num_workers)
    self._idle = collections.deque(range(num_workers))
    self._actors = [self._new_actor(s) for s in range(num_workers)]
    self._done = [0] * num_workers
    self._waiting = collections.deque()
    self._running = {}     # ObjectRef -> (slot, future, deadline, submitted)
    self._lock = threading.Condition()
    self._closed = False
    self._counts = collections.Counter()
    self._latencies = collections.deque(maxlen=2048)
    self._t0 = time.monotonic()
    self._thread = threading.Thread(target=self._loop, daemon=True, name="ray-verifier-pool")
    self._thread.start()

  @classmethod
  def from_config(cls, cfg, reward_cfg: RewardConfig | None = None) -> "RayVerifierPool":
    """The run config's `verifier` section (verify/config.py): joins the Ray cluster at
    verifier.ray_address ("" starts a Ray instance on this host)."""
    ray = _ray()
    if cfg.ray_address and not ray.is_initialized():
      ray.init(address=cfg.ray_address, include_dashboard=False, log_to_driver=False)
    return cls(num_workers=cfg.num_workers, reward_cfg=reward_cfg,
               task_timeout_s=cfg.task_timeout_s, max_tasks_per_worker=cfg.max_tasks_per_worker)

  def _new_actor(self, slot):
    return self._actor_cls.remote(self.uid_base + slot, self.reward_cfg)

  def submit(self, task, response, response_tokens=None, group_seed=0):
    if self._closed:
      raise RuntimeError("RayVerifierPool is closed")
    self._slots.acquire()       # back-pressure
    fut = concurrent.futures.Future()
    with self._lock:
      self._waiting.append(((task, response, response_tokens, group_seed), fut, time.monotonic()))
      self._counts["submitted"] += 1
      self._lock.notify()
    return fut

  def _finish(self, fut, res: RewardResult, submitted, counter=None):
    self._counts["completed"] += 1
    if counter:
      self._counts[counter] += 1
    self._latencies.append(time.monotonic() - submitted)
    self._slots.release()
    fut.set_result(res)

  def _loop(self):
    ray = self._ray
    while True:
      with self._lock:
        while self._idle and self._waiting:
          slot = self._idle.popleft()
          args, fut, t = self._waiting.popleft()
          ref = self._actors[slot].score.remote(*args)
          c = self.reward_cfg
          budget = code_check.worst_case_s(args[0], c.num_tests, c.test_timeout_s,
                                           c.compile_timeout_s)   # as in VerifierPool.submit
          timeout_s = self.task_timeout_s + budget
          self._running[ref] = (slot, fut, time.monotonic() + timeout_s, t, timeout_s)
        if self._closed and not self._running and not self._waiting:
          return
        refs = list(self._running)
      if not refs:
        with self._lock:
          self._lock.wait(0.2)
        continue
      ready, _ = ray.wait(refs, num_returns=1, timeout=0.05)
      now = time.monotonic()
      with self._lock:
        for ref in refs:
          slot, fut, deadline, t, timeout_s = self._running[ref]
          if ref in ready:
            del self._running[ref]
            try:
              res, counter = ray.get(ref), None
            except Exception as e:   # actor died
              res, counter = failed_result(f"verifier actor died: {type(e).__name__}"), "crashes"
              self._actors[slot] = self._new_actor(slot)
            self._done[slot] += 1
            if self._done[slot] >= self.max_tasks_per_worker:
              ray.kill(self._actors[slot])
              self._actors[slot] = self._new_actor(slot)
              self._done[slot] = 0
              self._counts["recycled"] += 1
            self._idle.append(slot)
            self._finish(fut, res, t, counter)
          elif now >= deadline:
            del self._running[ref]
            ray.kill(self._actors[slot])
            self._actors[slot] = self._new_actor(slot)
            self._done[slot] = 0
            self._idle.append(slot)
            # The deadline it met: task_timeout_s plus the task's own worst case, as configured.
            self._finish(fut, failed_result(
                f"verification timed out after {timeout_s:g}s (task_timeout_s "
                f"{self.task_timeout_s:g}s + {timeout_s - self.task_timeout_s:g}s for its "
                "code's own limits)"), t, "timeouts")

  def metrics(self):
    lat = sorted(self._latencies)
    elapsed = time.monotonic() - self._t0
    c = self._counts
    return dict(workers=self.num_workers, queued=len(self._waiting), busy=len(self._running),
                submitted=c["submitted"], completed=c["completed"], timeouts=c["timeouts"],
                crashes=c["crashes"], recycled=c["recycled"],
                throughput_per_s=c["completed"] / elapsed if elapsed else 0.0,
                latency_mean_s=sum(lat) / len(lat) if lat else 0.0,
                latency_p95_s=lat[int(0.95 * (len(lat) - 1))] if lat else 0.0)

  def close(self, timeout: float = 10.0):
    if self._closed:
      return
    self._closed = True
    with self._lock:
      self._lock.notify()
    self._thread.join(timeout)
    for a in self._actors:
      self._ray.kill(a)
    release_uid_offsets(self._uid_offsets)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()
