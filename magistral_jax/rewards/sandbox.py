"""Runs untrusted programs: one fresh temp dir, no network, nothing left alive afterwards.

Each run is wrapped as
    setpriv --pdeathsig KILL -- prlimit <cpu, as, fsize, nproc, nofile> --
      unshare --net --pid --fork --kill-child --setuid=U --setgid=U -- <program>
started in a new session, so:
  - the new network namespace has only a down loopback: sockets cannot reach anything;
  - the program is PID 1 of a new PID namespace; when it exits or we kill `unshare`, the kernel
    kills every process in the namespace, `setsid()` grandchildren included;
  - U is an unprivileged uid per pool slot (no /etc/passwd entry needed), so RLIMIT_NPROC bites
    (it is ignored for root) and the program cannot signal our processes;
  - if the worker dies, PDEATHSIG takes `unshare` and so the namespace with it.
We read stdout ourselves, stop at the deadline and at an output cap, and never wait on a pipe a
survivor could hold open.

Without root (or where `unshare` is refused) we fall back to a new session + rlimits + process
group kill, and log that the isolation is weaker (see `isolation_level()`).
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import logging
import os
import resource
import selectors
import shutil
import signal
import subprocess
import tempfile
import time

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
DEFAULT_UID_BASE = 60000

ISOLATION_NAMESPACES = "netns+pidns+uid+rlimits"
ISOLATION_FALLBACK = "session+rlimits"


@dataclasses.dataclass(frozen=True)
class Limits:
  cpu_s: float = 4.0          # RLIMIT_CPU (and the wall-clock deadline)
  memory_mb: int = 300        # RLIMIT_AS
  file_size_mb: int = 16      # RLIMIT_FSIZE: any file the program writes, stderr included
  nproc: int = 32             # RLIMIT_NPROC, per uid (threads count too)
  nofile: int = 64            # RLIMIT_NOFILE
  max_output_bytes: int = 16 << 20   # stdout cap; past it the run is killed


@dataclasses.dataclass
class RunResult:
  returncode: int | None
  stdout: bytes
  stderr: bytes
  timed_out: bool = False
  output_truncated: bool = False
  wall_s: float = 0.0


_libc = None


def _prctl_pdeathsig():
  global _libc
  if _libc is None:
    _libc = ctypes.CDLL(None, use_errno=True)
  return _libc


def _make_preexec(limits: Limits, wall_s: float):
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


def _prlimit_args(limits: Limits) -> list[str]:
  cpu = max(1, int(limits.cpu_s + 0.999))
  return [f"--cpu={cpu}:{cpu + 1}", f"--as={limits.memory_mb << 20}",
          f"--fsize={limits.file_size_mb << 20}", f"--nproc={limits.nproc}",
          f"--nofile={limits.nofile}", "--core=0"]


@functools.lru_cache(maxsize=None)
def _namespaces_work(uid: int) -> bool:
  unshare = shutil.which("unshare")
  if (unshare is None or shutil.which("setpriv") is None or shutil.which("prlimit") is None
      or os.geteuid() != 0):
    return False
  try:
    r = subprocess.run(["setpriv", "--pdeathsig", "KILL", "--", "prlimit", "--nproc=8", "--",
                        unshare, "--net", "--pid", "--fork", "--kill-child", f"--setuid={uid}",
                        f"--setgid={uid}", "--", "true"], capture_output=True, timeout=10)
    return r.returncode == 0
  except (OSError, subprocess.SubprocessError):
    return False


class Sandbox:
  """Runs programs for one pool slot. Stateful (uid, chosen isolation), so a class."""

  def __init__(self, uid: int | None = None, root_dir: str | None = None):
    self.uid = uid if uid is not None else DEFAULT_UID_BASE + os.getpid() % 5000
    self.root_dir = root_dir
    self.isolation = ISOLATION_NAMESPACES if _namespaces_work(self.uid) else ISOLATION_FALLBACK
    if self.isolation != ISOLATION_NAMESPACES:
      log.warning("sandbox: namespaces unavailable (not root or unshare refused); using %s: no "
                  "network or PID isolation and no separate uid", self.isolation)
    self._unshare = shutil.which("unshare")
    # setpriv --pdeathsig: if our process dies, the run dies with it (and so its namespace).
    self._prefix = [shutil.which("setpriv"), "--pdeathsig", "KILL", "--", shutil.which("prlimit")]

  def make_dir(self) -> str:
    """A fresh temp dir owned by the slot uid (the program may write there)."""
    d = tempfile.mkdtemp(prefix="mj_sbx_", dir=self.root_dir)
    if self.isolation == ISOLATION_NAMESPACES:
      os.chown(d, self.uid, self.uid)
    return d

  @staticmethod
  def remove_dir(d: str):
    shutil.rmtree(d, ignore_errors=True)

  def run(self, argv: list[str], cwd: str, limits: Limits, stdin: bytes | None = None,
          stdin_path: str | None = None, wall_s: float | None = None,
          env: dict | None = None) -> RunResult:
    """Runs `argv` in `cwd` under the limits. Input: `stdin` bytes, or a file at `stdin_path`."""
    wall_s = limits.cpu_s if wall_s is None else wall_s
    preexec = None
    if self.isolation == ISOLATION_NAMESPACES:
      # setpriv/prlimit instead of a Python preexec_fn: without one, subprocess can vfork, which
      # saves ~10 ms per run in a worker that holds SymPy (a plain fork copies its page tables).
      cmd = [*self._prefix, *_prlimit_args(limits), "--", self._unshare, "--net", "--pid",
             "--fork", "--kill-child", f"--setuid={self.uid}", f"--setgid={self.uid}", "--", *argv]
    else:
      cmd = list(argv)
      preexec = _make_preexec(limits, wall_s)
    env = env if env is not None else {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": cwd,
                                       "TMPDIR": cwd, "LANG": "C.UTF-8"}
    # Small inputs go through a pipe (fits the pipe buffer, so writing never blocks); large ones
    # through a file, so a program that never reads cannot block us.
    if stdin is not None and len(stdin) > 32768:
      stdin_path = os.path.join(cwd, ".stdin")
      with open(stdin_path, "wb") as f:
        f.write(stdin)
      stdin = None
    stdin_file = open(stdin_path, "rb") if stdin_path else None
    start = time.monotonic()
    try:
      proc = subprocess.Popen(
          cmd, cwd=cwd, stdin=stdin_file or (subprocess.PIPE if stdin is not None else
                                             subprocess.DEVNULL),
          stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, start_new_session=True,
          close_fds=True, preexec_fn=preexec)
    finally:
      if stdin_file:
        stdin_file.close()
    if stdin is not None:
      try:
        proc.stdin.write(stdin)
      except (BrokenPipeError, OSError):
        pass
      try:
        proc.stdin.close()
      except (BrokenPipeError, OSError):
        pass
    out, err, timed_out, truncated = self._read(proc, start + wall_s, limits.max_output_bytes)
    if timed_out or truncated:
      self._kill(proc)
    try:
      rc = proc.wait(timeout=max(0.0, start + wall_s + 1.0 - time.monotonic()))
    except subprocess.TimeoutExpired:
      timed_out = True
      self._kill(proc)
      rc = proc.wait()
    return RunResult(rc, out, err, timed_out, truncated, time.monotonic() - start)

  @staticmethod
  def _read(proc, deadline: float, cap: int, err_cap: int = 4096):
    """Reads stdout (up to `cap`) and the first `err_cap` bytes of stderr until both close,
    the deadline passes or stdout overflows. Never blocks past the deadline."""
    out, err, size = [], bytearray(), 0
    fds = {proc.stdout.fileno(): "out", proc.stderr.fileno(): "err"}
    timed_out = truncated = False
    with selectors.DefaultSelector() as sel:
      for fd in fds:
        sel.register(fd, selectors.EVENT_READ)
      while fds:
        left = deadline - time.monotonic()
        if left <= 0:
          timed_out = True
          break
        for key, _ in sel.select(left):
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

  @staticmethod
  def _kill(proc):
    # Killing `unshare` makes the kernel kill the namespace (--kill-child); the group kill covers
    # the fallback mode.
    for fn in (lambda: os.killpg(proc.pid, signal.SIGKILL), proc.kill):
      try:
        fn()
      except (ProcessLookupError, PermissionError, OSError):
        pass


_default: Sandbox | None = None


def configure(uid: int | None = None, root_dir: str | None = None) -> Sandbox:
  """Sets this process's sandbox (pool workers call it with their slot uid)."""
  global _default
  _default = Sandbox(uid=uid, root_dir=root_dir)
  return _default


def default_sandbox() -> Sandbox:
  global _default
  if _default is None:
    _default = Sandbox()
  return _default


def isolation_level() -> str:
  return default_sandbox().isolation
