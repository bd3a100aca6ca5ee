"""What bounds a sandboxed run (rewards/sandbox.py): CPU seconds, memory, file size, processes,
files, output and tmpfs sizes, and the wall-clock backstop behind them; and the two ways they are
applied: prlimit(1) arguments for the namespace modes, a preexec rlimit setter for the fallback.
"""
from __future__ import annotations

import ctypes
import dataclasses
import resource
import signal

PR_SET_PDEATHSIG = 1


@dataclasses.dataclass(frozen=True)
class Limits:
  cpu_s: float = 4.0          # RLIMIT_CPU, per process: the time limit that load cannot move
  memory_mb: int = 300        # RLIMIT_AS
  file_size_mb: int = 16      # RLIMIT_FSIZE: any file the program writes, stderr included
  nproc: int = 32             # RLIMIT_NPROC, per uid (threads count too)
  nofile: int = 64            # RLIMIT_NOFILE
  max_output_bytes: int = 16 << 20   # stdout cap; past it the run is killed
  tmp_mb: int = 16            # size of each private tmpfs (/tmp, /dev/shm)
  work_mb: int = 64           # size of the run's writable directory (a tmpfs of its own)
  work_inodes: int = 4096     # files and directories it may hold
  # The wall-clock backstop: wall_factor * cpu_s + wall_extra_s. Generous, because reaching it
  # is a verifier fault only if the run was kept waiting for a CPU by others (run_judge.py).
  wall_factor: float = 3.0
  wall_extra_s: float = 3.0

  @property
  def backstop_s(self) -> float:
    return self.wall_factor * self.cpu_s + self.wall_extra_s


_libc = None


def _prctl_pdeathsig():
  global _libc
  if _libc is None:
    _libc = ctypes.CDLL(None, use_errno=True)
  return _libc


def make_preexec(limits: Limits, wall_s: float):
  libc = _prctl_pdeathsig()
  cpu = max(1, int(limits.cpu_s + 0.999))
  mem = limits.memory_mb << 20
  fsize = limits.file_size_mb << 20

  def preexec():
    # Runs in the forked child before exec: only async-signal-safe-ish calls, nothing that locks.
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    resource.setrlimit(resource.RLIMIT_NPROC, (limits.nproc, limits.nproc))
    resource.setrlimit(resource.RLIMIT_NOFILE, (limits.nofile, limits.nofile))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
  return preexec


def prlimit_args(limits: Limits) -> list[str]:
  cpu = max(1, int(limits.cpu_s + 0.999))
  return [f"--cpu={cpu}:{cpu + 1}", f"--as={limits.memory_mb << 20}",
          f"--fsize={limits.file_size_mb << 20}", f"--nproc={limits.nproc}",
          f"--nofile={limits.nofile}", "--core=0"]
