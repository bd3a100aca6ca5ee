"""A control group of its own for each sandboxed run (rewards/sandbox.py makes one per run): the
run's CPU, memory and processes counted and bounded as a whole, whatever it does with them.

Why a cgroup: every other measure is per process or per live process. RLIMIT_CPU and RLIMIT_AS
bound one process each; summing the CPU of a run's live processes plus what their parents reaped
misses children the kernel reaps itself (SIGCHLD ignored): the fourth red-team wave (issue #64)
passed twice its CPU limit that way, and starved an honest run beside it with short-lived setsid
children. SysV shm, memfd and tmpfs pages belong to no process, so no rlimit sees them (one run
held gigabytes of shm and of unmapped memfd pages). A cgroup counts what
its tasks and all their descendants ever did, reaped or not, and the memory controller charges
shm, memfd and tmpfs pages to the cgroup that touched them. So by construction:
  - CPU: the cgroup's usage (v1 cpuacct.usage, v2 cpu.stat usage_usec) is the run's CPU limit's
    measure (run_tree.CpuWatch);
  - memory: the tree's memory, shm, memfd and tmpfs pages included, is capped by the kernel
    (memory.limit_in_bytes / memory.max, swap too): past it the kernel's OOM killer picks inside
    the run, never the worker or the trainer;
  - processes: pids.max caps the tree (threads included), whatever uid they run as;
  - fairness: each run has an equal CPU weight (cpu.shares / cpu.weight), so a run that forks a
    hundred busy loops gets one run's share of a contended CPU, not a hundred.
The run's first process (the sandbox's setup, as root inside its namespaces, before anything of
the program runs) moves itself in by writing "0" to each cgroup.procs, then enters a cgroup
namespace of its own; the private root has no /sys, so the run can neither see nor change its
cgroup.

Where: only as children of the cgroups this process is in (/proc/self/cgroup, located through
/proc/self/mountinfo). Nothing is ever written to our own cgroup or above it. Children are named
mj_run_<our pid>_<n>; each is removed when its run is over (its processes killed first), and a
child whose owner pid is dead is removed by `sweep` (a Sandbox sweeps when it starts; the pool
sweeps for a worker it lost). cgroup v1 (a hierarchy per controller, as CI mounts them) and v2
(one hierarchy: the controllers our cgroup delegates, in its cgroup.subtree_control; CPU usage and
cgroup.kill come with every v2 cgroup) are both supported. Where none can be made, `RunCgroups`
says so once, loudly, and the sandbox falls back to the best accounting without one: the filter
refuses kernel reaping (so the tree's CPU still reaches a live process's counters, which the CPU
watch sums) and memfd (pages no process holds), the IPC namespace's shm limits and the tmpfs
sizes bound the rest, and the CPU watch checks the tree's memory as it checks its CPU
(run_tree.CpuWatch); the same where a cgroup has no memory controller.

MAGISTRAL_SANDBOX_CGROUP (or Sandbox(cgroup=...)) picks: "auto" (v1 where a v1 CPU accounting
hierarchy takes children, else v2), "v1", "v2", or "off" (the fallback, for tests and hosts where
cgroups misbehave).
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import signal
import time

log = logging.getLogger(__name__)

ENV = "MAGISTRAL_SANDBOX_CGROUP"
MODES = ("auto", "v1", "v2", "off")
PREFIX = "mj_run_"
CPU_WEIGHT_V1, CPU_WEIGHT_V2 = 1024, 100     # the defaults, written so that no run inherits more
_V1_USED = ("cpuacct", "memory", "pids", "cpu")
_counter = itertools.count()
_warned = False


@dataclasses.dataclass(frozen=True)
class Hierarchy:
  """Where this process's cgroup of one hierarchy lives, and what children there can count."""
  version: int
  controllers: frozenset
  base: str                     # our own cgroup's directory: children go here, nothing else


def _mounts() -> list[tuple[str, str, str, set]]:
  """(fstype, mount root, mount point, super options) of each cgroup mount we can see."""
  out = []
  try:
    with open("/proc/self/mountinfo") as f:
      lines = f.read().splitlines()
  except OSError:
    return out
  for line in lines:
    pre, _, post = line.partition(" - ")
    a, b = pre.split(), post.split()
    if len(a) >= 5 and len(b) >= 3 and b[0] in ("cgroup", "cgroup2"):
      out.append((b[0], a[3], a[4].replace("\\040", " "), set(b[2].split(","))))
  return out


def _under(path: str, root: str, mountpoint: str) -> str | None:
  """The directory of cgroup `path` in a mount of its hierarchy rooted at `root`, or None when
  the mount does not reach it."""
  if root != "/" and path != root and not path.startswith(root.rstrip("/") + "/"):
    return None
  rel = os.path.relpath(path, root)
  d = os.path.normpath(os.path.join(mountpoint, "" if rel == "." else rel))
  return d if os.path.isdir(d) else None


def own_hierarchies() -> list[Hierarchy]:
  """The hierarchies this process is in that some mount here reaches, with our cgroup's dir."""
  try:
    with open("/proc/self/cgroup") as f:
      lines = f.read().splitlines()
  except OSError:
    return []
  mounts, out = _mounts(), []
  for line in lines:
    hid, _, rest = line.partition(":")
    names, _, path = rest.partition(":")
    if hid == "0" and names == "":
      for fstype, root, mp, _ in mounts:
        if fstype == "cgroup2" and (d := _under(path, root, mp)):
          try:
            with open(os.path.join(d, "cgroup.subtree_control")) as f:
              ctl = frozenset(f.read().split())
          except OSError:
            ctl = frozenset()
          out.append(Hierarchy(2, ctl | {"cpu.stat"}, d))
          break
      continue
    wanted = {n for n in names.split(",") if n in _V1_USED}
    if not wanted:
      continue
    for fstype, root, mp, opts in mounts:
      if fstype == "cgroup" and wanted <= opts and (d := _under(path, root, mp)):
        out.append(Hierarchy(1, frozenset(wanted), d))
        break
  return out


class RunGroup:
  """One run's cgroup: a child directory in each hierarchy used (one for v2)."""

  def __init__(self, version: int, dirs: dict[str, str], bounds_memory: bool = False):
    self.version = version
    self.dirs = dirs            # controller (v1) or "v2" -> directory
    self.bounds_memory = bounds_memory    # a memory controller caps it

  @property
  def procs_files(self) -> list[str]:
    """The cgroup.procs files the run's first process writes "0" to (once each directory)."""
    return sorted({os.path.join(d, "cgroup.procs") for d in self.dirs.values()})

  def cpu_s(self) -> float | None:
    """CPU seconds the run's tasks, living and dead, reaped or not, have used."""
    try:
      if self.version == 1:
        with open(os.path.join(self.dirs["cpuacct"], "cpuacct.usage")) as f:
          return int(f.read()) / 1e9
      with open(os.path.join(self.dirs["v2"], "cpu.stat")) as f:
        for line in f:
          k, _, v = line.partition(" ")
          if k == "usage_usec":
            return int(v) / 1e6
    except (OSError, ValueError, KeyError):
      pass
    return None

  def remove(self, patience_s: float = 2.0) -> bool:
    """Kills whatever is left in the cgroup and removes its directories. True when all went."""
    return all(_remove_dir(d, patience_s) for d in set(self.dirs.values()))


def _kill_all(d: str):
  try:
    with open(os.path.join(d, "cgroup.kill"), "w") as f:     # v2: the whole tree, atomically
      f.write("1")
    return
  except OSError:
    pass
  try:
    with open(os.path.join(d, "cgroup.procs")) as f:
      pids = [int(x) for x in f.read().split()]
  except (OSError, ValueError):
    return
  for pid in pids:
    try:
      os.kill(pid, signal.SIGKILL)
    except OSError:
      pass


def _remove_dir(d: str, patience_s: float, kill: bool = True) -> bool:
  """rmdir `d` (a cgroup of ours), killing its tasks until it is empty (a killed task leaves
  the cgroup only once it is reaped, so this waits a little). Without `kill`, only if empty."""
  deadline = time.monotonic() + (patience_s if kill else 0.0)
  while True:
    try:
      os.rmdir(d)
      return True
    except FileNotFoundError:
      return True
    except OSError:
      if time.monotonic() > deadline:
        if kill:
          log.warning("cgroup %s: still busy after %.1fs, left for the sweep", d, patience_s)
        return False
      _kill_all(d)
      time.sleep(0.01)


def _write(d: str, name: str, value) -> bool:
  try:
    with open(os.path.join(d, name), "w") as f:
      f.write(str(value))
    return True
  except OSError:
    return False


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
    return True
  except ProcessLookupError:
    return False
  except PermissionError:
    return True


def sweep(owner: int | None = None) -> int:
  """Removes the run cgroups left by dead owners (any empty mj_run_<pid>_* whose pid is gone: a
  dead owner's runs died with it by their parent-death signal, and a busy one may belong to a
  process of another pid namespace sharing this hierarchy), or all of `owner`'s, killing what
  is in them (a pool's dead worker: its pid may be reused soon). Returns how many went."""
  n = 0
  for h in own_hierarchies():
    try:
      names = [e.name for e in os.scandir(h.base) if e.is_dir() and e.name.startswith(PREFIX)]
    except OSError:
      continue
    for name in names:
      try:
        pid = int(name[len(PREFIX):].split("_")[0])
      except ValueError:
        continue
      if (pid == owner) if owner is not None else (pid != os.getpid() and not _alive(pid)):
        n += _remove_dir(os.path.join(h.base, name), 2.0, kill=owner is not None)
  return n


class RunCgroups:
  """Makes a RunGroup per run, in the mode chosen at construction (see the module docstring).
  `version` is 1, 2 or None (no cgroup: the caller falls back); `missing` names what the chosen
  hierarchy cannot count or bound."""

  def __init__(self, mode: str | None = None):
    mode = (mode or os.environ.get(ENV) or "auto").lower()
    if mode not in MODES:
      raise ValueError(f"{ENV} must be one of {MODES}, got {mode!r}")
    self.mode, self.version, self.bases, self.missing = mode, None, {}, ()
    why = "switched off (" + ENV + "=off, or a sandbox mode without a private filesystem)"
    if mode != "off":
      sweep()
      hs = own_hierarchies()
      v1 = {c: h.base for h in hs if h.version == 1 for c in h.controllers}
      v2 = next((h for h in hs if h.version == 2), None)
      tries = {"v1": [1], "v2": [2], "auto": [1, 2]}[mode]
      why = "no cgroup hierarchy of ours takes children"
      for v in tries:
        if v == 1 and "cpuacct" in v1 and self._probe(v1["cpuacct"]):
          self.version, self.bases = 1, {c: v1[c] for c in _V1_USED if c in v1}
          self.missing = tuple(c for c in _V1_USED if c not in v1)
          break
        if v == 2 and v2 is not None and self._probe(v2.base):
          self.version, self.bases = 2, {"v2": v2.base}
          self.missing = tuple(c for c in ("memory", "pids", "cpu") if c not in v2.controllers)
          break
    global _warned
    if self.version is None and not _warned:
      _warned = True
      log.warning("!" * 72 + "\nsandbox: NO PER-RUN CGROUP (%s): a run's CPU and memory are "
                  "counted per process, not as a whole (the filter then keeps children's CPU "
                  "visible and refuses memfd; see rewards/run_cgroup.py)\n" + "!" * 72, why)
    elif self.missing and not _warned:
      _warned = True
      log.warning("sandbox: run cgroups (v%d) cannot bound: %s", self.version,
                  ", ".join(self.missing))

  @staticmethod
  def _probe(base: str) -> bool:
    d = os.path.join(base, f"{PREFIX}{os.getpid()}_probe")
    try:
      os.mkdir(d)
    except FileExistsError:
      pass
    except OSError:
      return False
    return _remove_dir(d, 1.0)

  def create(self, memory_mb: int, nproc: int) -> RunGroup | None:
    """A fresh cgroup for one run, limits written; None without cgroups (or if making it
    failed: then the run goes on with the fallback accounting, and the failure is logged)."""
    if self.version is None:
      return None
    name = f"{PREFIX}{os.getpid()}_{next(_counter)}"
    dirs: dict[str, str] = {}
    try:
      for c, base in self.bases.items():
        d = os.path.join(base, name)
        if d not in dirs.values():
          os.mkdir(d)
        dirs[c] = d
    except OSError as e:
      log.warning("sandbox: cannot make run cgroup %s: %s", name, e)
      RunGroup(self.version, dirs).remove()
      return None
    mem = memory_mb << 20
    if self.version == 1:
      if "memory" in dirs:
        _write(dirs["memory"], "memory.limit_in_bytes", mem)
        _write(dirs["memory"], "memory.memsw.limit_in_bytes", mem)
      if "pids" in dirs:
        _write(dirs["pids"], "pids.max", nproc)
      if "cpu" in dirs:
        _write(dirs["cpu"], "cpu.shares", CPU_WEIGHT_V1)
    else:
      d = dirs["v2"]
      _write(d, "memory.max", mem)
      _write(d, "memory.swap.max", 0)
      _write(d, "pids.max", nproc)
      _write(d, "cpu.weight", CPU_WEIGHT_V2)
    return RunGroup(self.version, dirs, "memory" not in self.missing)
