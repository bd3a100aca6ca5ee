"""A verifier worker: the process that scores completions for one pool slot (verify/pool.py starts
it with the "spawn" method and talks to it over a pipe), and the pool's handle on it."""
from __future__ import annotations

import dataclasses
import multiprocessing as mp
import multiprocessing.connection as mpc
import os

from magistral_jax.rewards import sandbox
from magistral_jax.rewards.config import RewardConfig
from magistral_jax.rewards.reward import compute_reward, failed_result


def worker_main(conn, slot: int, uid: int, cfg: RewardConfig):
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
class Worker:
  """The pool's handle on one worker process, and the task it is running."""
  slot: int
  proc: mp.Process
  conn: mpc.Connection
  ready: bool = False
  tid: int | None = None
  deadline: float = 0.0
  tasks_done: int = 0
  retired: bool = False


def start_worker(ctx, slot: int, uid: int, cfg: RewardConfig) -> Worker:
  """Starts the worker process of `slot`, whose sandboxes run as `uid`."""
  parent, child = ctx.Pipe(duplex=True)
  proc = ctx.Process(target=worker_main, name=f"verifier-{slot}", args=(child, slot, uid, cfg),
                     daemon=True)
  proc.start()
  child.close()
  return Worker(slot, proc, parent)


def stop_worker(w: Worker, cleanup, kill: bool):
  """Stops one worker: asks it to exit (or kills it), waits, and removes the run dirs a killed one
  leaves. Each step runs through `cleanup(what, fn, *args)`, which logs and counts a failure
  instead of raising (VerifierPool._cleanup)."""
  w.retired = True
  if not kill:
    try:
      w.conn.send(None)
    except Exception:
      kill = True
  if kill:
    cleanup(f"killing worker {w.proc.pid}", w.proc.kill)
  cleanup(f"waiting for worker {w.proc.pid}", w.proc.join, 1.0 if kill else 5.0)
  if w.proc.is_alive():
    cleanup(f"killing worker {w.proc.pid}", w.proc.kill)
    cleanup(f"waiting for worker {w.proc.pid}", w.proc.join, 1.0)
  if not w.proc.is_alive():   # a killed worker leaves its run dir behind
    cleanup(f"removing the run dirs of worker {w.proc.pid}", sandbox.remove_leftovers, w.proc.pid)
  cleanup(f"closing the pipe of worker {w.proc.pid}", w.conn.close)
