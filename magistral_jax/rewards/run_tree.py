"""A sandboxed run's processes and files as the host sees them (rewards/sandbox.py runs it): its
process tree, the CPU the tree has used and what it was doing (samples for rewards/run_judge.py,
which judges a run still going at its wall-clock backstop), reading its output, killing it, its
input as a sealed memfd, and removing a tree of files that the run may have shaped.
"""
from __future__ import annotations

import collections
import dataclasses
import fcntl
import os
import selectors
import signal
import subprocess
import time

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


def tree_memory_mb(pid: int) -> float:
  """The memory of `pid` and its descendants in MB: each process's proportional set size (shared
  pages split among their users, so a page shared by the tree counts once), or its RSS where the
  kernel has no smaps_rollup. For runs without a memory cgroup (run_cgroup.py) only."""
  total = 0
  for p in descendants(pid):
    for path, key in ((f"/proc/{p}/smaps_rollup", "Pss:"), (f"/proc/{p}/status", "VmRSS:")):
      try:
        with open(path) as f:
          kb = next((int(line.split()[1]) for line in f if line.startswith(key)), None)
      except (OSError, ValueError, IndexError):
        kb = None
      if kb is not None:
        total += kb
        break
  return total / 1024


@dataclasses.dataclass(frozen=True)
class Sample:
  """One look at a run's process tree (CpuWatch takes one every EVERY_S; rewards/run_judge.py
  reads what the run was doing between two of them)."""
  t: float                      # time.monotonic()
  cpu_s: float                  # the tree's CPU, reaped children included (the limit's measure)
  threads: dict | None          # tid -> (ns on a CPU, ns runnable but waiting) from schedstat;
                                # None where the kernel has no schedstat
  runnable: bool                # some thread was in state R (running or waiting for a CPU)
  host_busy_s: float | None     # busy time of the CPUs we may use, whoever used it (/proc/stat)


def _host_busy_s(cpus: frozenset) -> float | None:
  """Busy CPU seconds so far (user, nice, system, irq, softirq, steal) of the CPUs in `cpus`."""
  try:
    with open("/proc/stat") as f:
      lines = f.read().splitlines()
  except OSError:
    return None
  total = 0
  for line in lines:
    name, _, rest = line.partition(" ")
    if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
      v = [int(x) for x in rest.split()]
      total += v[0] + v[1] + v[2] + v[5] + v[6] + v[7]
  return total / _TICK


def sample_tree(pid: int, cpus: frozenset, group=None) -> Sample:
  """The tree's CPU (its cgroup's, with a run_cgroup.RunGroup `group`: every process it ever had,
  reaped or not), each live thread's schedstat and state, and the host's busy time."""
  threads: dict | None = {}
  runnable = False
  for p in descendants(pid):
    try:
      tids = os.listdir(f"/proc/{p}/task")
    except OSError:
      continue
    for t in tids:
      try:
        with open(f"/proc/{p}/task/{t}/stat") as f:
          runnable |= f.read().rpartition(")")[2].split()[0] == "R"
      except (OSError, IndexError):
        continue
      if threads is None:
        continue
      try:
        with open(f"/proc/{p}/task/{t}/schedstat") as f:
          run_ns, wait_ns = (int(x) for x in f.read().split()[:2])
        threads[int(t)] = (run_ns, wait_ns)
      except FileNotFoundError:
        threads = None             # no schedstat in this kernel (or the thread just went)
      except (OSError, ValueError):
        pass
  cpu = group.cpu_s() if group is not None else None
  return Sample(time.monotonic(), tree_cpu_s(pid) if cpu is None else cpu, threads, runnable,
                _host_busy_s(cpus))


class CpuWatch:
  """The CPU limit over a run's whole process tree: RLIMIT_CPU counts each process on its own,
  so 32 forked busy loops would take 32 times the limit before the backstop stopped them. Where
  no cgroup bounds the run's memory, the tree's memory is checked here too (`memory_mb`). The
  measure is the run's cgroup (`group`, rewards/run_cgroup.py) where it has one; without, the
  tree's live processes and what they reaped (the filter then keeps every child's CPU on that
  path: sandbox.py). Checked every EVERY_S while we wait on the run (a walk of its /proc
  entries); the last few samples are kept for the judgement of a run still going at its
  backstop (run_judge.py)."""
  EVERY_S = 0.5
  KEEP = 8

  def __init__(self, pid: int, limit_s: float, group=None, memory_mb: float | None = None):
    self.pid, self.limit_s, self.group = pid, limit_s, group
    self.memory_mb = memory_mb       # the tree's memory limit, where no cgroup bounds it
    self.next = time.monotonic() + self.EVERY_S
    self.used, self.spent, self.over_memory = 0.0, False, False
    self.cpus = frozenset(os.sched_getaffinity(0))   # ours: the run's can only be narrower
    self.samples: collections.deque = collections.deque(maxlen=self.KEEP)

  def sample(self) -> Sample:
    s = sample_tree(self.pid, self.cpus, self.group)
    self.samples.append(s)
    self.used = s.cpu_s
    self.spent = self.used >= self.limit_s
    if self.memory_mb is not None:
      self.over_memory = tree_memory_mb(self.pid) > self.memory_mb
    return s

  def check(self) -> bool:
    """True once the tree has used its CPU limit, or holds more than its memory limit."""
    now = time.monotonic()
    if not (self.spent or self.over_memory) and now >= self.next:
      self.next = now + self.EVERY_S
      self.sample()
    return self.spent or self.over_memory


def read_output(proc, deadline: float, cap: int, watch: "CpuWatch | None" = None,
                err_cap: int = 4096):
  """Reads stdout (up to `cap`) and the first `err_cap` bytes of stderr until both close,
  the deadline passes, `watch` finds the CPU limit spent (both: timed_out) or stdout or stderr
  passes `cap` (truncated: the run is then killed, so a flood, vmsplice'd pages included,
  costs us at most `cap` bytes of reading per stream). Never blocks past the deadline."""
  out, err, size, err_size = [], bytearray(), 0, 0
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
        else:
          err_size += len(data)
          if len(err) < err_cap:
            err += data[:err_cap - len(err)]
      if size > cap or err_size > cap:
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
