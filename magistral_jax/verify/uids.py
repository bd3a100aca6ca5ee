"""The sandbox uids of a verifier pool's slots, and killing whatever still runs as one.

Each slot owns an unprivileged uid for its sandbox, `uid_base + slot`, taken from
this process's block 1_000_000 + 256 * pid + k, k = 0..254 (k = 255 is a stand-alone Sandbox's).
Pools alive in one process get disjoint slots of the block, so no two live workers anywhere on
the machine share a uid, and killing every process of a slot's uid hits only that slot's
sandboxes.

Sandboxes of a dead worker. As root, the sandbox's setup drops to the slot uid with setresuid,
which clears the parent-death signal that `unshare --kill-child` armed on the namespace's first
process; the sandbox re-arms it, but a worker SIGKILLed in between leaves that run alive (issue
#50: 65 processes outlived the scorer, the slot uids sat at their RLIMIT_NPROC and the next
compiles failed). So whenever a worker is killed or dies, and for every slot at start and at
close, the pool (verify/pool.py) kills every process of the slot's uid (a process running as that
uid sends SIGKILL to all it may signal: `setpriv --reuid=U -- kill -9 -1`) and waits until none
is left, before the slot's successor starts. Without root nothing needs it, and nothing could do
it: the sandbox then runs in a user namespace as our own uid (a kill as that uid would hit us),
and it never changes uid, so the parent-death signal is never cleared.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time

from magistral_jax.rewards import sandbox

MAX_SLOTS = sandbox.UIDS_PER_PROCESS - 1       # slots 0..254; 255 is a stand-alone Sandbox's uid
# Below this a uid may be a real account (or root, or ours): never kill all of its processes.
MIN_SWEEP_UID = 100_000

_uid_lock = threading.Lock()
_uid_offsets_in_use: set[int] = set()   # offsets in this process's block held by live pools


def claim_uid_offsets(n: int) -> int:
  """The first of `n` consecutive free offsets (0..254) in this process's uid block."""
  with _uid_lock:
    for first in range(MAX_SLOTS - n + 1):
      if _uid_offsets_in_use.isdisjoint(range(first, first + n)):
        _uid_offsets_in_use.update(range(first, first + n))
        return first
    held = len(_uid_offsets_in_use)
  raise ValueError(f"no {n} free sandbox uids left for a verifier pool in this process: its other "
                   f"pools hold {held} of the {MAX_SLOTS} slot uids")


def slot_uids(num_workers: int, uid_base: int | None) -> tuple[int, range]:
  """(uid_base, the offsets claimed in this process's block) for a pool of `num_workers` slots:
  `uid_base` as given (nothing claimed), or claimed from this process's block when None. Give
  the offsets back with release_uid_offsets when the pool closes."""
  if uid_base is not None:
    return uid_base, range(0)
  first = claim_uid_offsets(num_workers)
  return sandbox.process_uid_base() + first, range(first, first + num_workers)


def release_uid_offsets(offsets: range):
  with _uid_lock:
    _uid_offsets_in_use.difference_update(offsets)


def uid_processes(uid: int) -> tuple[list[int], int]:
  """(pids of the live processes, count of zombies) whose real, effective, saved or filesystem
  uid is `uid`, from /proc/*/status."""
  live, zombies = [], 0
  want = str(uid)
  for name in os.listdir("/proc"):
    if not name.isdigit():
      continue
    try:
      with open(f"/proc/{name}/status") as f:
        status = f.read()
    except OSError:   # exited meanwhile
      continue
    state = uids = None
    for line in status.splitlines():
      if line.startswith("State:"):
        state = line.split()[1:2]
      elif line.startswith("Uid:"):
        uids = line.split()[1:]
        break   # State comes before Uid
    if uids is None or want not in uids:
      continue
    if state and state[0] in ("Z", "X"):   # dead, waiting to be reaped: nothing left to kill
      zombies += 1
    else:
      live.append(int(name))
  return live, zombies


def _kill_as(uid: int, timeout_s: float):
  """Runs `kill -9 -1` as `uid`: the kernel signals every process that uid may signal (all of
  its own, in any PID namespace below ours) in one pass that forks cannot race, except the
  killer itself. No preexec_fn: the pool lives in threaded (JAX) processes."""
  setpriv, kill = shutil.which("setpriv"), shutil.which("kill")
  if not setpriv or not kill:
    return
  try:
    subprocess.run([setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--", kill,
                    "-9", "-1"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, close_fds=True, timeout=max(0.1, timeout_s))
  except subprocess.TimeoutExpired:
    pass   # the rounds below go on; what is left is reported


def _kill_pid_of(pid: int, uid: int):
  """SIGKILLs `pid` if it still runs as `uid` (a pidfd, so a recycled pid is never hit): the
  backstop where `kill -1` could not run (no setpriv, or its exec refused at the uid's
  RLIMIT_NPROC)."""
  try:
    fd = os.pidfd_open(pid)
  except (AttributeError, OSError):
    return
  try:
    with open(f"/proc/{pid}/status") as f:
      uids = next(l.split()[1:] for l in f if l.startswith("Uid:"))
    if str(uid) in uids:
      signal.pidfd_send_signal(fd, signal.SIGKILL)
  except (OSError, StopIteration, AttributeError):
    pass
  finally:
    os.close(fd)


def kill_uid_processes(uid: int, timeout_s: float = 5.0) -> tuple[int, int]:
  """Kills every process of `uid` and waits (at most `timeout_s`) until none is left alive.
  Returns (processes alive at the start, processes still alive at the end). Root only: the
  caller checks. Refuses uids below MIN_SWEEP_UID and our own."""
  if uid < MIN_SWEEP_UID or uid in (os.getuid(), os.geteuid()):
    raise ValueError(f"refusing to kill every process of uid {uid}: not a sandbox uid")
  live, _ = uid_processes(uid)
  found = len(live)
  deadline = time.monotonic() + timeout_s
  while live and time.monotonic() < deadline:
    _kill_as(uid, deadline - time.monotonic())
    for pid in live:
      _kill_pid_of(pid, uid)
    settle = min(deadline, time.monotonic() + 0.5)
    while live and time.monotonic() < settle:   # SIGKILLed processes take moments to exit
      time.sleep(0.01)
      live, _ = uid_processes(uid)
  return found, len(live)
