"""A sandboxed run's processes and files as the host sees them (rewards/sandbox.py runs it): its
process tree and the CPU the tree has used, the judgement of a run still going at its wall-clock
backstop, reading its output, killing it, its input as a sealed memfd, and removing a tree of
files that the run may have shaped.
"""
from __future__ import annotations

import fcntl
import os
import selectors
import signal
import subprocess
import time

# A run that reaches its wall-clock backstop while it has used less CPU than this share of the
# elapsed time was idle (sleeping, blocked, waiting on a lock): its own doing, a time limit. One
# that used more, but less than its CPU limit, was slowed by the host: a verifier fault.
IDLE_CPU_SHARE = 0.05


def sealed_memfd(data: bytes) -> int:
  """A read-positioned memfd holding `data`, sealed against writes and resizing."""
  fd = os.memfd_create("mj_stdin", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
  try:
    view = memoryview(data)
    while view:
      view = view[os.write(fd, view):]
    os.lseek(fd, 0, os.SEEK_SET)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK
                | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE)
  except BaseException:
    os.close(fd)
    raise
  return fd


def children(pid: int) -> list[int]:
  """The direct children of `pid`, of any of its threads (from /proc; empty where unreadable)."""
  out = []
  try:
    tasks = os.listdir(f"/proc/{pid}/task")
  except OSError:
    return out
  for t in tasks:
    try:
      with open(f"/proc/{pid}/task/{t}/children") as f:
        out += [int(x) for x in f.read().split()]
    except (OSError, ValueError):
      pass
  return out


def descendants(pid: int) -> list[int]:
  """`pid` and every process below it."""
  seen, todo = [], [pid]
  while todo and len(seen) < 100_000:
    p = todo.pop()
    seen.append(p)
    todo += children(p)
  return seen


_TICK = os.sysconf("SC_CLK_TCK")


def tree_cpu_s(pid: int) -> float:
  """CPU seconds used by `pid` and its descendants, the children they reaped included."""
  total = 0
  for p in descendants(pid):
    try:
      with open(f"/proc/{p}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
      total += sum(int(x) for x in fields[11:15])    # utime stime cutime cstime
    except (OSError, ValueError, IndexError):
      pass
  return total / _TICK


class CpuWatch:
  """The CPU limit over a run's whole process tree: RLIMIT_CPU counts each process on its own,
  so 32 forked busy loops would take 32 times the limit before the backstop stopped them.
  Checked every EVERY_S while we wait on the run (a walk of its /proc entries)."""
  EVERY_S = 0.5

  def __init__(self, pid: int, limit_s: float):
    self.pid, self.limit_s = pid, limit_s
    self.next = time.monotonic() + self.EVERY_S
    self.used, self.spent = 0.0, False

  def check(self) -> bool:
    """True once the tree has used its CPU limit."""
    now = time.monotonic()
    if not self.spent and now >= self.next:
      self.next = now + self.EVERY_S
      self.used = tree_cpu_s(self.pid)
      self.spent = self.used >= self.limit_s
    return self.spent


def judge_overrun(pid: int, elapsed_s: float, cpu_limit_s: float) -> tuple[float, str | None]:
  """(CPU used, fault or None) for a run still going at its wall-clock backstop, measured before
  it is killed. The program's own doing (None) when it used its CPU limit or was idle; else the
  host was too loaded to judge it in time: a verifier fault, so the group is dropped rather than
  an honest program scored wrong."""
  cpu = tree_cpu_s(pid)
  if cpu >= cpu_limit_s or cpu < IDLE_CPU_SHARE * elapsed_s:
    return cpu, None
  return cpu, (f"wall-clock backstop ({elapsed_s:.1f}s) reached after only {cpu:.2f}s of its "
               f"{cpu_limit_s:g}s CPU limit: the host is overloaded")


def read_output(proc, deadline: float, cap: int, watch: "CpuWatch | None" = None,
                err_cap: int = 4096):
  """Reads stdout (up to `cap`) and the first `err_cap` bytes of stderr until both close,
  the deadline passes, `watch` finds the CPU limit spent (both: timed_out) or stdout
  overflows. Never blocks past the deadline."""
  out, err, size = [], bytearray(), 0
  fds = {proc.stdout.fileno(): "out", proc.stderr.fileno(): "err"}
  timed_out = truncated = False
  with selectors.DefaultSelector() as sel:
    for fd in fds:
      sel.register(fd, selectors.EVENT_READ)
    while fds:
      left = deadline - time.monotonic()
      if left <= 0 or (watch is not None and watch.check()):
        timed_out = True
        break
      for key, _ in sel.select(min(left, CpuWatch.EVERY_S)):
        data = os.read(key.fd, 1 << 16)
        if not data:
          sel.unregister(key.fd)
          del fds[key.fd]
        elif fds[key.fd] == "out":
          out.append(data)
          size += len(data)
        elif len(err) < err_cap:
          err += data[:err_cap - len(err)]
      if size > cap:
        truncated = True
        break
  proc.stdout.close()
  proc.stderr.close()
  return b"".join(out)[:cap], bytes(err), timed_out, truncated


def remove_tree(path: str):
  """Removes `path` and everything under it without recursion, at any depth, never following a
  symlink: one directory fd open at a time (a stack of names, not of fds, so no fd limit), going
  back up through "..". shutil.rmtree recurses (a 2,500-deep tree raised RecursionError) and
  works on whole paths (which fail past PATH_MAX). Entries that vanish meanwhile are skipped."""
  flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
  try:
    fd = os.open(path, flags)
  except FileNotFoundError:
    return
  except NotADirectoryError:
    os.unlink(path)
    return
  names: list[str] = []
  try:
    while True:
      sub = None
      with os.scandir(fd) as it:
        for e in it:
          try:
            if e.is_dir(follow_symlinks=False):
              sub = e.name
              break
            os.unlink(e.name, dir_fd=fd)
          except FileNotFoundError:
            pass
      if sub is not None:
        try:
          child = os.open(sub, flags, dir_fd=fd)
        except NotADirectoryError:     # replaced by a file or link meanwhile: remove that
          os.unlink(sub, dir_fd=fd)
          continue
        os.close(fd)
        fd = child
        names.append(sub)
        continue
      if not names:
        break
      parent = os.open("..", flags, dir_fd=fd)
      os.close(fd)
      fd = parent
      os.rmdir(names.pop(), dir_fd=fd)
  finally:
    os.close(fd)
  os.rmdir(path)


def kill_run(proc: subprocess.Popen):
  """Kills a run started by the sandbox (rewards/sandbox.py, sandbox_channel.py) and what it left.
  """
  # The namespace's first process (unshare's child) first, so that `unshare` reaps it before it
  # exits: killed together, the child outlives its parent for an instant and is left as a
  # zombie of the slot uid under the machine's init, which need not reap it soon. Such zombies
  # count against the slot uid's RLIMIT_NPROC: 29 of them after the HumanEval calls made the
  # next C++ compile fail with EAGAIN. Then killing `unshare` kills whatever is left of the
  # namespace (--kill-child), and the group kill covers the fallback mode.
  kids = children(proc.pid)
  for pid in kids:
    try:
      os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError, OSError):
      pass
  if kids:
    try:
      proc.wait(timeout=0.5)
    except subprocess.TimeoutExpired:
      pass
  for fn in (lambda: os.killpg(proc.pid, signal.SIGKILL), proc.kill):
    try:
      fn()
    except (ProcessLookupError, PermissionError, OSError):
      pass
