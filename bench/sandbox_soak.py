"""Soak benchmark: the verifier pool under sustained hostile load (issues #33 and #50): --tasks
code tasks, a --hostile_share of hostile programs (tests/rewards/hostile_programs.py), the rest
of known verdict (tests/rewards/known_verdicts.py), --cpp_share C++; --chaos_every_s SIGKILLs a
busy worker that often. Baseline: the correct/wrong programs run bare, interleaved in chunks
(--ratio_tasks). Then tests/rewards/host_leaks.py scans what the pool left.

  python bench/sandbox_soak.py [--tasks=5000] [--workers=2] [--cpp_share=0.05]
                               [--chaos_every_s=0] [--no_progress]

Last line, one JSON object: verdict_accuracy, tasks_lost, faulted, chaos_kills,
worker_deaths_beyond_chaos, honest_verifier_faults, leaks per kind, throughput_ratio, ....
"""
import collections
import concurrent.futures
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time

import common

import psutil

# The programs and the leak scans are the sandbox tests' own.
sys.path.insert(0, os.path.join(common.ROOT, "tests", "rewards"))
import host_leaks  # noqa: E402
from hostile_programs import ALWAYS, ATTACKS, IPC_ATTACKS, SECRET  # noqa: E402
from known_verdicts import (Catalog, Item, bare_run, build_mix, code_response,  # noqa: E402
                            stdin_task, verdict_ok)

from magistral_jax.rewards import reward as reward_mod, sandbox  # noqa: E402
from magistral_jax.rewards.config import RewardConfig  # noqa: E402
from magistral_jax.verify.pool import VerifierPool  # noqa: E402

# How the error of a task starts when it got no verdict through no doing of its program: its
# worker was killed under it (the chaos), or a limit on our side stopped it (the reward's
# VERIFIER_FAULT). Such a task is dropped (counted as faulted), not scored.
FAULTS = {"verifier worker died": "worker_died", "could not send task to worker": "worker_died",
          getattr(reward_mod, "VERIFIER_FAULT", "verifier fault"): "verifier_fault"}


def rss_mb(pids) -> dict[str, float]:
  out = {}
  for pid in pids:
    try:
      out[str(pid)] = psutil.Process(pid).memory_info().rss / 2**20
    except psutil.Error:
      pass
  return out


class Chaos(threading.Thread):
  """SIGKILLs a busy worker (one with sandboxed processes under it) about every `every_s`
  seconds (never where every_s <= 0): a worker lost with its runs alive, as a hostile program or
  the host can make happen. Busy workers are drawn with weights = their processes, so the ones
  running daemons and holders are hit most. The pool must resolve the task with an error and
  leave nothing of it alive."""

  def __init__(self, pool: VerifierPool, every_s: float, seed: int):
    super().__init__(name="soak-chaos", daemon=True)
    self.pool, self.every_s = pool, every_s
    self.r = random.Random(seed)
    self.kills: list[dict] = []
    self._halt = threading.Event()

  def run(self):
    while self.every_s > 0 and not self._halt.wait(self.every_s * self.r.uniform(0.5, 1.5)):
      busy = {}
      for pid in self.pool.worker_pids():
        try:
          n = len(psutil.Process(pid).children(recursive=True))
        except psutil.Error:
          continue
        if n:
          busy[pid] = n
      if not busy:
        continue
      pids = sorted(busy)
      pid = self.r.choices(pids, weights=[busy[p] for p in pids])[0]
      try:
        os.kill(pid, signal.SIGKILL)
      except ProcessLookupError:
        continue
      self.kills.append(dict(pid=pid, processes=busy[pid]))

  def stop(self):
    self._halt.set()
    self.join()


def soak(pool: VerifierPool, items: list[Item], cfg: RewardConfig, wait_s: float, seen_pids: set,
         progress: bool = True, chaos_every_s: float = 0.0, seed: int = 0) -> dict:
  t0, futs, step = time.perf_counter(), [], max(1, len(items) // 10)
  chaos = Chaos(pool, chaos_every_s, seed)
  chaos.start()
  try:
    for k, it in enumerate(items):
      futs.append(pool.submit(it.task, code_response(it.src, it.lang), None, k))
      if k % 50 == 0:
        seen_pids.update(pool.worker_pids())
      if progress and k and k % step == 0:
        print(f"soak: submitted {k}/{len(items)}, resolved {sum(f.done() for f in futs)}, "
              f"{time.perf_counter() - t0:.0f} s", flush=True)
    done, _ = concurrent.futures.wait(futs, timeout=wait_s)
  finally:
    chaos.stop()
  wall = time.perf_counter() - t0
  seen_pids.update(pool.worker_pids())
  kills = chaos.kills
  seen_pids.update(k["pid"] for k in kills)   # their run dirs are the pool's to remove
  wrong, errors, faulted, by_cat, fault_counts = [], [], [], {}, collections.Counter()
  honest_faults = 0   # a verifier fault on a correct or wrong program: our limits, not its doing
  for it, f in zip(items, futs):
    c = by_cat.setdefault(it.category, {"tasks": 0, "right": 0, "faulted": 0})
    c["tasks"] += 1
    if f not in done:
      continue
    res = f.result()
    kind = next((k for prefix, k in FAULTS.items() if (res.error or "").startswith(prefix)), None)
    if kind:   # no verdict: dropped, neither right nor wrong
      c["faulted"] += 1
      fault_counts[kind] += 1
      if kind == "verifier_fault" and it.category != "hostile":
        honest_faults += 1
      faulted.append(f"{it.category}/{it.name}: {res.error[:120]}")
      continue
    if res.error:
      errors.append(f"{it.category}/{it.name}: {res.error[:120]}")
    if verdict_ok(it, res, cfg):
      c["right"] += 1
    else:
      wrong.append(dict(category=it.category, shape=it.shape, name=it.name,
                        correct=res.parts.get("correct"), error=res.error,
                        detail=str(res.info.get("code"))[:200]))
  resolved = len(done)
  verdicts = resolved - len(faulted)
  return dict(tasks=len(items), resolved=resolved, tasks_lost=len(items) - resolved,
              verdicts=verdicts,
              verdict_accuracy=(verdicts - len(wrong)) / verdicts if verdicts else 0.0,
              wrong_verdicts_count=len(wrong), wrong_verdicts=wrong[:8],
              faulted=len(faulted), faulted_by_kind=dict(fault_counts), faulted_first=faulted[:5],
              honest_verifier_faults=honest_faults,
              chaos_every_s=chaos_every_s, chaos_kills=len(kills), chaos_kills_first=kills[:5],
              errors_count=len(errors), errors_first=errors[:5], by_category=by_cat,
              soak_wall_s=wall, throughput_per_s=len(items) / wall)


def throughput_phase(pool: VerifierPool, items: list[Item], workers: int, bare_dir: str,
                     chunk: int) -> dict:
  """Pool vs bare on the same correct/wrong programs, interleaved in chunks so that load from
  other processes hits both alike."""
  pool_s, bare_s, bare_right = 0.0, 0.0, 0
  with concurrent.futures.ThreadPoolExecutor(workers) as ex:
    for i in range(0, len(items), chunk):
      part = items[i:i + chunk]
      t = time.perf_counter()
      for f in [pool.submit(it.task, code_response(it.src, it.lang), None, 0) for it in part]:
        f.result()
      pool_s += time.perf_counter() - t
      t = time.perf_counter()
      bare = list(ex.map(lambda it: bare_run(it, bare_dir), part))
      bare_s += time.perf_counter() - t
      bare_right += sum(b == it.expect_pass for b, it in zip(bare, part))
  n = len(items)
  return dict(ratio_tasks=n, pool_benign_per_s=n / pool_s, bare_benign_per_s=n / bare_s,
              throughput_ratio=(n / pool_s) / (n / bare_s), bare_verdict_accuracy=bare_right / n)


def run(a) -> dict:
  """The soak, then the throughput phase, then the leak scan; `a`: the command line's flags."""
  workers, seed, progress = a.workers, a.seed, not a.no_progress
  cfg = RewardConfig(language_bonus=0.0, test_timeout_s=a.test_timeout_s)
  res = dict(bench="sandbox_soak", workers=workers, hostile_share=a.hostile_share,
             cpp_share=a.cpp_share, test_timeout_s=a.test_timeout_s,
             isolation_level=sandbox.isolation_level(), ipc_attacks=list(IPC_ATTACKS))
  bare_dir = tempfile.mkdtemp(prefix="mj_soak_bare_")
  planted, planted_ipc = host_leaks.plant_files(SECRET), host_leaks.plant_ipc(SECRET)
  try:
    # The keys of this process's sandbox uids (the pool's slots are among them) before any run.
    block = sandbox.process_uid_base()
    before = host_leaks.snapshot(range(block, block + sandbox.UIDS_PER_PROCESS))
    t = time.perf_counter()
    catalog = Catalog(bare_dir)
    items = build_mix(a.tasks, seed, a.hostile_share, a.cpp_share, catalog, include=ALWAYS)
    ratio_items = build_mix(a.ratio_tasks, seed + 1, a.hostile_share, a.cpp_share, catalog,
                            categories=("correct", "wrong")) if a.ratio_tasks else []
    res.update(catalog_s=time.perf_counter() - t, catalog_programs=len(catalog._ok),
               catalog_dropped=len(catalog.dropped), catalog_dropped_first=catalog.dropped[:5],
               mix=dict(sorted(collections.Counter(f"{it.category}/{it.shape}"
                                                   for it in items).items())),
               hostile_variants=len(ATTACKS),
               always_in_mix=sorted({it.name for it in items} & set(ALWAYS)))
    # The reading attacks are real: run bare (no sandbox) they print the secret and pass.
    res["read_attacks_pass_bare"] = {
        n: bare_run(Item("hostile", "stdin", n, stdin_task(n, 0, atk.lang,
                                                           (("0\n", SECRET + "\n"),)),
                         atk.src, atk.lang), bare_dir)
        for n, atk in ATTACKS.items() if atk.reads_secret}
    if progress:
      print("mix", res["mix"], flush=True)
    seen_pids: set[int] = set()
    pool = VerifierPool(workers, cfg, task_timeout_s=a.task_timeout_s, max_queue=4 * workers,
                        max_tasks_per_worker=a.max_tasks_per_worker)
    # Every sandbox uid of this process (its pools' slots and a stand-alone Sandbox's).
    uids = range(min(block, pool.uid_base), max(block + sandbox.UIDS_PER_PROCESS,
                                                pool.uid_base + workers))
    try:
      # Warm: every worker ready (a trivial task each), then the start RSS.
      for f in [pool.submit({"kind": "code", "problem": "p", "language": "python",
                             "tests": [{"input": "", "output": "1\n"}]}, code_response("print(1)"))
                for _ in range(2 * workers)]:
        f.result()
      res["worker_rss_start_mb"] = rss_mb(pool.worker_pids())
      res.update(soak(pool, items, cfg, wait_s=max(600.0, 2 * a.task_timeout_s),
                      seen_pids=seen_pids, progress=progress, chaos_every_s=a.chaos_every_s,
                      seed=seed))
      res["worker_rss_end_mb"] = rss_mb(pool.worker_pids())
      if ratio_items:
        res.update(throughput_phase(pool, ratio_items, workers, bare_dir, chunk=4 * workers))
      res["pool_metrics"] = {k: v for k, v in pool.metrics().items()
                             if k in ("submitted", "completed", "timeouts", "crashes", "recycled",
                                      "errors", "latency_p50_s", "latency_p95_s", "latency_max_s",
                                      "cleanup_errors", "orphans_killed", "orphans_left",
                                      "stopped")}
      # A worker death the chaos did not cause is a program that reached its worker.
      res["worker_deaths_beyond_chaos"] = max(0, res["pool_metrics"]["crashes"]
                                              - res.get("chaos_kills", 0))
      seen_pids.update(pool.worker_pids())
    finally:
      pool.close()
    res.update(host_leaks.report(before, uids, seen_pids), worker_pids_seen=len(seen_pids))
  finally:
    host_leaks.unplant_files(planted)
    host_leaks.unplant_ipc(planted_ipc)
    shutil.rmtree(bare_dir, ignore_errors=True)
  res["host"] = common.host_info()
  return res


def main():
  args = common.argument_parser(
      __doc__, tasks=(5000, "tasks in the soak"), workers=(2, "pool size"), hostile_share=0.2,
      cpp_share=(0.05, "share of C++ tasks (of the benign and of the hostile ones)"),
      test_timeout_s=(2.0, "per-run CPU/wall limit"),
      task_timeout_s=(60.0, "pool's per-task deadline"),
      ratio_tasks=(200, "correct/wrong tasks timed through the pool and bare (0: skip)"),
      max_tasks_per_worker=1000, seed=0,
      chaos_every_s=(0.0, "SIGKILL a busy worker about this often during the soak (0: never)"),
      no_progress=(False, "no progress lines during the soak")).parse_args()
  # SIGTERM (e.g. from `timeout`) unwinds through run()'s cleanup: the planted files go.
  signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
  common.emit(run(args), ndigits=4)


if __name__ == "__main__":
  main()
