"""Runs untrusted programs: a private filesystem, no network, nothing left alive afterwards.

Each run is wrapped as
    setpriv --pdeathsig KILL -- prlimit <cpu, as, fsize, nproc, nofile> --
      unshare [--user --map-root-user] --mount --net --pid --fork --kill-child --
      python -I -S -c SETUP_SOURCE <spec> <program>
(for a Python program, that interpreter runs it after the setup: one interpreter start, not two)
started in a new session, so:
  - the new mount namespace gets a fresh root (see sandbox_root.py): a tmpfs holding read-only bind mounts
    of only what programs need (/usr and the /bin, /lib* links or dirs, the dynamic loader's /etc
    files, a non-/usr interpreter's prefix, the precompiled header); the run directory at
    /sandbox, the only writable place, destroyed after the run; private size-limited tmpfs /tmp
    and /dev/shm; a /proc of the run's own PID namespace; a handful of device nodes. The old
    root is detached after pivot_root, so no project, home, dataset or host /tmp path resolves;
  - the new network namespace has only a down loopback: sockets cannot reach anything;
  - the program is PID 1 of a new PID namespace; when it exits or we kill `unshare`, the kernel
    kills every process in the namespace, `setsid()` grandchildren included, and the namespace's
    tmpfs mounts go with it;
  - as root, U is an unprivileged uid per pool slot (no /etc/passwd entry needed), so RLIMIT_NPROC
    bites (it is ignored for root) and the program cannot signal our processes. Without root, a
    user namespace maps our uid to root inside it, for the mount setup only: every capability is
    dropped from the bounding set before exec, so the program has none (cannot unmount, remount
    read-write or mount anything) and runs as our uid on the outside;
  - if the worker dies, PDEATHSIG takes `unshare` and so the namespace with it.
We read stdout ourselves, stop at the deadline and at an output cap, and never wait on a pipe a
survivor could hold open.

Where no mount namespace can be made (no unshare, user namespaces disabled), the sandbox REFUSES
to run code (SandboxUnavailable) unless built with allow_weak=True (RewardConfig
.allow_weak_sandbox): then it falls back, with a loud warning, to the PID/network namespaces
without a private filesystem (root), or to a new session + rlimits (neither). `isolation_level()`
says which mode is in force.

Verdicts are out of the candidate's reach by construction (rewards/code_check.py): the program
only ever gets inputs, and what it sends back is plain values (stdout text, or JSON that decodes
to None/bool/int/float/str/list/tuple/dict/set), compared to the expected values in our process.
Nothing in its process, environment, argv or filesystem means "passed", so there is nothing to
find; the best a forger can do is produce the right values, i.e. solve the task.
"""
from __future__ import annotations

import ctypes
import dataclasses
import glob
import logging
import os
import platform
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from magistral_jax.rewards.sandbox_root import SETUP_SOURCE, SYS_PIVOT_ROOT

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
DEFAULT_UID_BASE = 60000

# Strongest first. The first two have a private filesystem; the last two are the weak modes that
# only allow_weak permits.
ISOLATION_PRIVATE_FS = "mountns+netns+pidns+uid+rlimits"
ISOLATION_USERNS = "userns+mountns+netns+pidns+rlimits"
ISOLATION_NAMESPACES = "netns+pidns+uid+rlimits"
ISOLATION_FALLBACK = "session+rlimits"
ISOLATION_REFUSED = "refused"
PRIVATE_FS = (ISOLATION_PRIVATE_FS, ISOLATION_USERNS)
WORKDIR = "/sandbox"          # where the run directory appears inside the private root


class SandboxUnavailable(RuntimeError):
  """No mount namespace could be made and the weak modes were not allowed."""




@dataclasses.dataclass(frozen=True)
class Limits:
  cpu_s: float = 4.0          # RLIMIT_CPU (and the wall-clock deadline)
  memory_mb: int = 300        # RLIMIT_AS
  file_size_mb: int = 16      # RLIMIT_FSIZE: any file the program writes, stderr included
  nproc: int = 32             # RLIMIT_NPROC, per uid (threads count too)
  nofile: int = 64            # RLIMIT_NOFILE
  max_output_bytes: int = 16 << 20   # stdout cap; past it the run is killed
  tmp_mb: int = 16            # size of each private tmpfs (/tmp, /dev/shm)


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


def _base_ro_paths() -> tuple[list[list[str]], list[list[str]]]:
  """(read-only binds [host, inside], symlinks [target, link]) of the minimal root: /usr, the
  /bin and /lib* dirs (symlinks into /usr on merged-/usr systems are recreated as symlinks) and
  the files the dynamic loader and `alternatives` need from /etc."""
  binds, links = [["/usr", "/usr"]], []
  for p in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
    if os.path.islink(p):
      links.append([os.readlink(p), p])
    elif os.path.isdir(p):
      binds.append([p, p])
  for p in ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/alternatives"):
    if os.path.exists(p):
      binds.append([p, p])
  return binds, links


def interpreter_binds(python: str) -> tuple[str, list[tuple[str, str]]]:
  """(path to exec, extra read-only binds) for running `python` in the private root: its real
  path, and its installation prefix when that is outside /usr (a pyenv or /opt build). A venv is
  never bound: we exec the base interpreter it links to."""
  real = os.path.realpath(python)
  if real.startswith("/usr/"):
    return real, []
  prefix = os.path.dirname(os.path.dirname(real))
  return real, [(prefix, prefix)]


class Sandbox:
  """Runs programs for one pool slot. Stateful (uid, chosen isolation), so a class."""

  def __init__(self, uid: int | None = None, root_dir: str | None = None,
               allow_weak: bool = False):
    self.uid = uid if uid is not None else DEFAULT_UID_BASE + os.getpid() % 5000
    self.root_dir = root_dir
    self.allow_weak = allow_weak
    self._unshare = shutil.which("unshare")
    # setpriv --pdeathsig: if our process dies, the run dies with it (and so its namespace).
    self._prefix = [shutil.which("setpriv"), "--pdeathsig", "KILL", "--", shutil.which("prlimit")]
    # The setup runs before pivot_root, so any interpreter will do: the system one starts fastest
    # (a pyenv one takes twice as long); -I -S: nothing from the environment or site-packages.
    self._setup_python = next((p for p in ("/usr/bin/python3", "/usr/local/bin/python3")
                               if os.access(p, os.X_OK)), sys.executable)
    self._ro, self._links = _base_ro_paths()
    self._mnt = os.path.join(root_dir or tempfile.gettempdir(), "mj_sbx_mnt")
    self.isolation = self._choose_isolation()
    if self.isolation == ISOLATION_REFUSED:
      log.error("sandbox: no mount namespace (unshare missing or user namespaces refused): "
                "REFUSING to run generated code. Set allow_weak_sandbox to accept a sandbox "
                "without a private filesystem.")
    elif self.isolation not in PRIVATE_FS:
      log.warning("!" * 72 + "\nsandbox: WEAK ISOLATION (%s), allowed by allow_weak_sandbox: "
                  "generated code sees the host filesystem (reads what is world-readable, writes "
                  "where the world may write)%s\n" + "!" * 72, self.isolation,
                  "" if self.isolation == ISOLATION_NAMESPACES else
                  ", shares our network and uid and can signal our processes")

  # ------------------------------------------------------------------ isolation choice

  def _tools(self) -> bool:
    return all(shutil.which(t) for t in ("unshare", "setpriv", "prlimit"))

  def _probe(self, isolation: str) -> bool:
    d = None
    try:
      d = self.make_dir(isolation)
      cmd, _ = self._command(["true"], d, Limits(), (), isolation)
      r = subprocess.run(cmd, capture_output=True, timeout=20, cwd=d)
      if r.returncode != 0:
        log.info("sandbox: %s unavailable: %s", isolation, r.stderr.decode(errors="replace")[-300:])
      return r.returncode == 0
    except (OSError, subprocess.SubprocessError, ValueError) as e:
      log.info("sandbox: %s unavailable: %s", isolation, e)
      return False
    finally:
      if d:
        self.remove_dir(d)

  def _choose_isolation(self) -> str:
    tools = self._tools()
    if tools and platform.machine() in SYS_PIVOT_ROOT:
      os.makedirs(self._mnt, mode=0o755, exist_ok=True)
      if os.geteuid() == 0 and self._probe(ISOLATION_PRIVATE_FS):
        return ISOLATION_PRIVATE_FS
      if self._probe(ISOLATION_USERNS):
        return ISOLATION_USERNS
    if not self.allow_weak:
      return ISOLATION_REFUSED
    if tools and os.geteuid() == 0 and self._probe(ISOLATION_NAMESPACES):
      return ISOLATION_NAMESPACES
    return ISOLATION_FALLBACK

  # ------------------------------------------------------------------ runs

  def make_dir(self, isolation: str | None = None) -> str:
    """A fresh run dir owned by the slot uid (the program may write there, and only there)."""
    # The pid in the name: whoever sees this process die can remove what it left (leftovers()).
    d = tempfile.mkdtemp(prefix=f"mj_sbx_{os.getpid()}_", dir=self.root_dir)
    if (isolation or self.isolation) in (ISOLATION_PRIVATE_FS, ISOLATION_NAMESPACES):
      os.chown(d, self.uid, self.uid)
    return d

  @staticmethod
  def remove_dir(d: str):
    shutil.rmtree(d, ignore_errors=True)

  def inside(self, path: str, cwd: str) -> str:
    """Where a host path under the run dir `cwd` appears to the program."""
    if self.isolation not in PRIVATE_FS:
      return path
    return os.path.join(WORKDIR, os.path.relpath(path, cwd))

  def _command(self, argv, cwd, limits, ro_binds, isolation, python_src=None):
    """(argv to Popen, preexec_fn or None) for one run under `isolation`. With `python_src`,
    argv is [python]: that interpreter runs the source (in the private root, the same
    interpreter process that set the root up)."""
    if python_src is not None and isolation not in PRIVATE_FS:
      argv = [argv[0], "-I", "-S", "-c", python_src]
    if isolation == ISOLATION_REFUSED:
      raise SandboxUnavailable("sandbox refused: no mount namespace on this host; generated code "
                               "is not run (RewardConfig.allow_weak_sandbox allows weaker modes)")
    if isolation in PRIVATE_FS:
      user = isolation == ISOLATION_USERNS
      spec = {"mnt": self._mnt, "work": [cwd, WORKDIR], "tmp_mb": limits.tmp_mb,
              "ro": self._ro + [[h, i] for h, i in ro_binds], "links": self._links,
              "uid": None if user else self.uid, "then": python_src,
              "sys_pivot_root": SYS_PIVOT_ROOT.get(platform.machine(), -1)}
      ns = ["--user", "--map-root-user"] if user else []
      setup_python = argv[0] if python_src is not None else self._setup_python
      return [*self._prefix, *_prlimit_args(limits), "--", self._unshare, *ns, "--mount", "--net",
              "--pid", "--fork", "--kill-child", "--", setup_python, "-I", "-S", "-c", SETUP_SOURCE,
              repr(spec), *([] if python_src is not None else argv)], None
    if isolation == ISOLATION_NAMESPACES:
      # setpriv/prlimit instead of a Python preexec_fn: without one, subprocess can vfork, which
      # saves ~10 ms per run in a worker that holds SymPy (a plain fork copies its page tables).
      return [*self._prefix, *_prlimit_args(limits), "--", self._unshare, "--net", "--pid",
              "--fork", "--kill-child", f"--setuid={self.uid}", f"--setgid={self.uid}", "--",
              *argv], None
    return list(argv), _make_preexec(limits, limits.cpu_s)

  def _env(self, cwd, env):
    if env is not None:
      return env
    private = self.isolation in PRIVATE_FS
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": WORKDIR if private else cwd,
            "TMPDIR": "/tmp" if private else cwd, "LANG": "C.UTF-8"}

  def start(self, argv: list[str], cwd: str, limits: Limits,
            ro_binds: tuple[tuple[str, str], ...] | list = (), env: dict | None = None,
            python_src: str | None = None) -> subprocess.Popen:
    """Starts `argv` in `cwd` with pipes on stdin, stdout and stderr (for a conversation; see
    `Channel`, which kills it when closed). `python_src`: as in `run`."""
    cmd, preexec = self._command(argv, cwd, limits, ro_binds, self.isolation, python_src)
    return subprocess.Popen(cmd, cwd=cwd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=self._env(cwd, env),
                            start_new_session=True, close_fds=True, preexec_fn=preexec)

  def run(self, argv: list[str], cwd: str, limits: Limits, stdin: bytes | None = None,
          stdin_path: str | None = None, wall_s: float | None = None,
          env: dict | None = None, ro_binds: tuple[tuple[str, str], ...] | list = (),
          python_src: str | None = None) -> RunResult:
    """Runs `argv` in `cwd` under the limits. Input: `stdin` bytes, or a file at `stdin_path`.
    `ro_binds`: extra (host path, path inside) read-only binds in the private root.
    `python_src`: argv is [python interpreter], and it runs this source (`-I -S`)."""
    wall_s = limits.cpu_s if wall_s is None else wall_s
    cmd, preexec = self._command(argv, cwd, limits, ro_binds, self.isolation, python_src)
    env = self._env(cwd, env)
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
    # The namespace's first process (unshare's child) first, so that `unshare` reaps it before it
    # exits: killed together, the child outlives its parent for an instant and is left as a
    # zombie of the slot uid under the machine's init, which need not reap it soon. Such zombies
    # count against the slot uid's RLIMIT_NPROC: 29 of them after the HumanEval calls made the
    # next C++ compile fail with EAGAIN. Then killing `unshare` kills whatever is left of the
    # namespace (--kill-child), and the group kill covers the fallback mode.
    children = _children(proc.pid)
    for pid in children:
      try:
        os.kill(pid, signal.SIGKILL)
      except (ProcessLookupError, PermissionError, OSError):
        pass
    if children:
      try:
        proc.wait(timeout=0.5)
      except subprocess.TimeoutExpired:
        pass
    for fn in (lambda: os.killpg(proc.pid, signal.SIGKILL), proc.kill):
      try:
        fn()
      except (ProcessLookupError, PermissionError, OSError):
        pass


class Channel:
  """A line-based conversation with a program started by `Sandbox.start`: we write one request
  line, it answers one line on stdout. Every read stops at the run's deadline and at the output
  cap; stderr is drained all along (the first `err_cap` bytes kept), so a program that writes a
  lot there cannot block. Any failure (deadline, cap, exit, closed pipe) kills the program and
  raises ChannelClosed."""

  class Closed(Exception):
    pass

  def __init__(self, proc: subprocess.Popen, deadline: float, cap: int, err_cap: int = 4096):
    self.proc, self.deadline, self.cap, self.err_cap = proc, deadline, cap, err_cap
    self.err = bytearray()
    self._buf = bytearray()
    self._read_total = 0
    self._sel = selectors.DefaultSelector()
    self._sel.register(proc.stdout.fileno(), selectors.EVENT_READ, "out")
    self._sel.register(proc.stderr.fileno(), selectors.EVENT_READ, "err")

  def request(self, line: bytes) -> bytes:
    """Sends one line and reads the answer line."""
    try:
      self.proc.stdin.write(line + b"\n")
      self.proc.stdin.flush()
    except (BrokenPipeError, OSError, ValueError):
      self._fail("the program closed its input or exited")
    return self.read_line()

  def read_line(self) -> bytes:
    while b"\n" not in self._buf:
      left = self.deadline - time.monotonic()
      if left <= 0:
        self._fail("time limit")
      events = self._sel.select(left)
      for key, _ in events:
        data = os.read(key.fd, 1 << 16)
        if not data:
          if key.data == "out":
            self._fail("the program exited or closed its output")
          self._sel.unregister(key.fd)
        elif key.data == "out":
          self._buf += data
          self._read_total += len(data)
          if self._read_total > self.cap:
            self._fail("output limit")
        elif len(self.err) < self.err_cap:
          self.err += data[:self.err_cap - len(self.err)]
    line, _, rest = bytes(self._buf).partition(b"\n")
    self._buf = bytearray(rest)
    return line

  def _fail(self, why: str):
    self.close()
    raise Channel.Closed(why)

  def close(self):
    Sandbox._kill(self.proc)
    for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
      try:
        f.close()
      except (OSError, ValueError):
        pass
    try:
      self._sel.close()
    except (OSError, ValueError):
      pass
    try:
      self.proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
      pass


def _children(pid: int) -> list[int]:
  """The direct children of `pid` (from /proc; empty where it cannot be read)."""
  try:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
      return [int(x) for x in f.read().split()]
  except (OSError, ValueError):
    return []


def remove_leftovers(pid: int, root_dir: str | None = None) -> int:
  """Removes the run dirs of a DEAD process `pid` (a verifier worker killed mid-run never reaches
  its own cleanup). Returns how many there were."""
  dirs = glob.glob(os.path.join(root_dir or tempfile.gettempdir(), f"mj_sbx_{pid}_*"))
  for d in dirs:
    shutil.rmtree(d, ignore_errors=True)
  return len(dirs)


_default: Sandbox | None = None


def configure(uid: int | None = None, root_dir: str | None = None,
              allow_weak: bool = False) -> Sandbox:
  """Sets this process's sandbox (pool workers call it with their slot uid)."""
  global _default
  _default = Sandbox(uid=uid, root_dir=root_dir, allow_weak=allow_weak)
  return _default


def default_sandbox(allow_weak: bool | None = None) -> Sandbox:
  """This process's sandbox; rebuilt when `allow_weak` is given and differs from its own."""
  global _default
  # allow_weak only matters where the private filesystem is unavailable: no rebuild otherwise.
  if _default is None or (allow_weak is not None and allow_weak != _default.allow_weak
                          and _default.isolation not in PRIVATE_FS):
    _default = Sandbox(uid=_default.uid if _default else None,
                       root_dir=_default.root_dir if _default else None,
                       allow_weak=bool(allow_weak))
  return _default


def isolation_level() -> str:
  """The mode in force: ISOLATION_PRIVATE_FS or ISOLATION_USERNS (private filesystem),
  ISOLATION_NAMESPACES or ISOLATION_FALLBACK (weak, only with allow_weak), ISOLATION_REFUSED."""
  return default_sandbox().isolation
