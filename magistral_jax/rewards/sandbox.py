"""Runs untrusted programs: a private filesystem, no network, nothing left alive afterwards.

Each run is wrapped as
    setpriv --pdeathsig KILL -- prlimit <cpu, as, fsize, nproc, nofile> --
      unshare [--user --map-root-user] --mount --net --ipc --pid --fork --kill-child --
      python -I -S -c SETUP_SOURCE <spec> <program>
(for a Python program, that interpreter runs it after the setup: one interpreter start, not two)
started in a new session, so:
  - the new mount namespace gets a fresh root (see sandbox_root.py): a tmpfs holding read-only
    bind mounts of only what programs need (/usr and the /bin, /lib* links or dirs, the dynamic
    loader's /etc files, a non-/usr interpreter's prefix, the precompiled header); the working
    directory /sandbox, a size- and inode-limited tmpfs of the run's own, holding our input files
    (the source, the binary) as copies of ours (not bind mounts: its mountinfo names no host path
    of ours); private size-limited tmpfs /tmp and /dev/shm; a
    /proc of the run's own PID namespace; a handful of device nodes. The old root is detached
    after pivot_root, so no project, home, dataset or host /tmp path resolves;
  - the new network namespace has only a down loopback: sockets cannot reach anything;
  - the new IPC namespace has SysV objects and POSIX message queues of its own, and shm limits
    (size of each segment and all together within tmp_mb, SHM_SEGMENTS segments);
  - the run joins a cgroup of its own first (run_cgroup.py), then a cgroup namespace;
  - the program is PID 1 of a new PID namespace; when it exits or we kill `unshare`, the kernel
    kills every process in the namespace, `setsid()` grandchildren included, and the namespace's
    tmpfs mounts and IPC objects go with it;
  - as root, U is an unprivileged uid per pool slot (no /etc/passwd entry needed), so RLIMIT_NPROC
    bites (it is ignored for root) and the program cannot signal our processes. Without root, a
    user namespace maps our uid to root inside it, for the mount setup only: every capability is
    dropped from the bounding set before exec, so the program has none (cannot unmount, remount
    read-write or mount anything) and runs as our uid on the outside;
  - a seccomp filter (x86_64, aarch64; sandbox_root.seccomp_program says why for each) refuses
    unshare, setns and clone with namespace flags; the kernel keyring (keyctl, add_key,
    request_key), io_uring, userfaultfd, ptrace, perf_event_open and bpf; AF_VSOCK sockets; and
    personality changes;
  - if the worker dies, PDEATHSIG takes `unshare`, and the namespace's first process with it.

What the second red-team wave (issue #50) found, and why each class is now contained by
construction rather than by a check on the instance:
  - Answers passed between runs through IPC: each run has its own IPC namespace (--ipc), and
    POSIX shared memory and semaphores live in its private /dev/shm. No run sees another's
    objects, and they all die with the run, so none is left on the host.
  - Root writes through a symlink in the run directory: we never open, create or write a path
    in a directory the program can write. Inputs go in as a sealed memfd on stdin; the source
    and binary are copied into the run's tmpfs by its setup; the only host directory a sandboxed
    process may write is the compiler's, and no candidate code runs there. A link or FIFO the
    program plants is in its own tmpfs, which nothing of ours ever opens.
  - Hangs in our own process: the memfd means no open() and no pipe write of ours for stdin
    (a FIFO cannot block us, nor a program that never reads); the conversation with a Python
    candidate (sandbox_channel.py) writes non-blocking, draining its output meanwhile, and every
    read and write stops at the run's deadline. Decoding refuses sets and dict keys whose hashes
    collide (code_codec.py), so it stays linear.
  - Cleanup that could be defeated, and unbounded writes: what the program writes lives in its
    tmpfs (size and inode quota), gone with the namespace: no 2,500-deep tree or gigabyte ever
    reaches the host. The host directory holds only our files and the compiler's output, and
    `remove_tree` removes any tree anyway without recursion or following links.
  - Processes that outlive the scorer: dropping to U clears the parent-death signal, so the
    setup re-arms it after setresuid; the pool then kills every process of a dead worker's uid
    (verify/pool.py), which covers the instant between the two. Without root no uid change
    happens, and the signal is never cleared.
  - A nested user namespace (whose root could mount and unshare again): the seccomp filter. On a
    machine without its numbers (SECCOMP in sandbox_root.py) the filter is not installed.
  - Honest programs failed by load: limits are CPU seconds (RLIMIT_CPU), which load cannot
    move. The wall clock is only a backstop (Limits.backstop_s): a run still going there is
    judged by what it was doing when it fired (`run_judge.judge_overrun`): at its CPU limit,
    asleep or blocked, or running unhindered, it is the program's doing (a time limit);
    runnable but kept waiting while others held the CPUs, the host was too loaded to judge it,
    a verifier fault (the caller drops the group instead of scoring an honest program wrong).
We read stdout ourselves, stop at the deadline and at an output cap, and never wait on a pipe a
survivor could hold open.

The fourth wave (issue #64), class by class:
  - Verdicts carried between runs by the kernel keyring (not namespaced), and keys left on the
    host: the filter refuses keyctl, add_key and request_key; each run joins a fresh session
    keyring, so it never holds ours; and as root every key the slot uid can reach is removed
    after each run (sandbox_keys.py says why that second line is needed and how).
  - Kernel interfaces past the filter's view or the namespaces' reach (io_uring, userfaultfd,
    ptrace, personality, perf_event_open, bpf, AF_VSOCK): refused by the filter
    (sandbox_root.seccomp_program says why for each).
  - Faults a wrong program could force (burn a little CPU, then sleep or block): a run is judged
    by what it was doing when the backstop fired, not by its average (run_judge.py).
  - Verdicts learned from which test or call comes next: every one runs, in a secret order, and
    the verdict is formed at the end (code_guard.py), so there is nothing to carry between runs.
  - CPU and memory limits dodged by a tree (children the kernel reaps, setsid children, shm,
    memfd, tmpfs pages, a tree of processes each under its own rlimit): each run has a cgroup of
    its own (run_cgroup.py), which counts and bounds everything its processes ever did and
    gives it one run's CPU weight; without one, the filter keeps every child's CPU on a counter
    we read and refuses memfd, and the CPU watch checks the tree's memory (run_tree.py). SysV
    shm is bounded per run by its IPC namespace's limits.

Where no mount namespace can be made (no unshare, user namespaces disabled), the sandbox REFUSES
to run code (SandboxUnavailable) unless built with allow_weak=True (RewardConfig
.allow_weak_sandbox): then it falls back, with a loud warning, to the PID/network/IPC namespaces
without a private filesystem (root), or to a new session + rlimits (neither). Those modes have
none of the filesystem containment above: the run directory is a host directory the program
writes. `isolation_level()` says which mode is in force.

Verdicts are out of the candidate's reach by construction (rewards/code_check.py): the program
only ever gets inputs, and what it sends back is plain values (stdout text, or JSON that decodes
to exact builtin and collections types, or handles to call back), compared to the expected
values in our process; an answer is bounded in size before it is decoded (code_asserts.py).
Nothing in its process, environment, argv or filesystem means "passed", so there is nothing to
find; the best a forger can do is produce the right values, i.e. solve the task.
"""
from __future__ import annotations

import dataclasses
import glob
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time

from magistral_jax.rewards import run_cgroup, run_judge, run_tree, sandbox_keys
from magistral_jax.rewards.run_tree import CpuWatch, remove_tree, sealed_memfd
from magistral_jax.rewards.sandbox_command import (  # noqa: F401 (the modes are this module's face)
    ISOLATION_FALLBACK, ISOLATION_NAMESPACES, ISOLATION_PRIVATE_FS, ISOLATION_REFUSED,
    ISOLATION_USERNS, PRIVATE_FS, SHM_SEGMENTS, WORKDIR, Launcher, SandboxUnavailable)
from magistral_jax.rewards.sandbox_limits import Limits
from magistral_jax.rewards.sandbox_root import SYS_PIVOT_ROOT

log = logging.getLogger(__name__)

# Sandbox uids: 1,000,000 + 256 * (the pid of the process that owns them) + slot, so no two live
# processes share one (a pool's slots are 0..254, a stand-alone Sandbox takes 255). Killing
# everything of a slot's uid (the pool does after a worker dies) can then hit nothing else.
UID_BASE = 1_000_000
UIDS_PER_PROCESS = 256


def process_uid_base(pid: int | None = None) -> int:
  """The first of the 256 sandbox uids that process `pid` (default: this one) owns."""
  return UID_BASE + UIDS_PER_PROCESS * (os.getpid() if pid is None else pid)


DEFAULT_UID_BASE = UID_BASE
@dataclasses.dataclass
class RunResult:
  returncode: int | None
  stdout: bytes
  stderr: bytes
  timed_out: bool = False     # stopped at the wall-clock backstop
  output_truncated: bool = False
  wall_s: float = 0.0
  cpu_s: float | None = None  # CPU the program's processes had used when the backstop hit
  fault: str | None = None    # the backstop hit a busy program short of its CPU limit: the host
                              # was too loaded to judge it (a verifier fault, not a wrong answer)


class Sandbox:
  """Runs programs for one pool slot. Stateful (uid, chosen isolation), so a class."""

  def __init__(self, uid: int | None = None, root_dir: str | None = None,
               allow_weak: bool = False, cgroup: str | None = None):
    self.uid = uid if uid is not None else process_uid_base() + UIDS_PER_PROCESS - 1
    self.root_dir = root_dir
    self.allow_weak = allow_weak
    self._launcher = Launcher(root_dir)
    self._mnt = self._launcher.mnt
    self.isolation = self._choose_isolation()
    # A cgroup per run (run_cgroup.py; `cgroup`: its mode, default $MAGISTRAL_SANDBOX_CGROUP or
    # auto), joined by the setup: the private-filesystem modes only.
    self.cgroups = run_cgroup.RunCgroups(cgroup if self.isolation in PRIVATE_FS else "off")
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
      cmd, _ = self._launcher.command(self.uid, ["true"], d, Limits(), (), isolation, inputs=[],
                                      writable=False)
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
    """A fresh host dir for one task's files (the source, the binary). With a private
    filesystem the program never sees it: its files are copied into the run's own tmpfs, and
    only the compiler writes here (see `run(writable=True)`). In the weak uid mode it
    is the program's writable working directory, owned by the slot uid."""
    # The pid in the name: whoever sees this process die can remove what it left (leftovers()).
    d = tempfile.mkdtemp(prefix=f"mj_sbx_{os.getpid()}_", dir=self.root_dir)
    os.chmod(d, 0o755)
    if (isolation or self.isolation) == ISOLATION_NAMESPACES:
      os.chown(d, self.uid, self.uid)
    return d

  @staticmethod
  def remove_dir(d: str):
    remove_tree(d)

  def inside(self, path: str, cwd: str) -> str:
    """Where a host path under the run dir `cwd` appears to the program."""
    if self.isolation not in PRIVATE_FS:
      return path
    return os.path.join(WORKDIR, os.path.relpath(path, cwd))

  def _env(self, cwd, env):
    if env is not None:
      return env
    private = self.isolation in PRIVATE_FS
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": WORKDIR if private else cwd,
            "TMPDIR": "/tmp" if private else cwd, "LANG": "C.UTF-8"}

  def _writable(self, cwd: str, writable: bool):
    """Hands `cwd` to the slot uid for a writable (compiler) run; `_restore` takes it back."""
    if writable and self.isolation == ISOLATION_PRIVATE_FS:
      os.chown(cwd, self.uid, self.uid)

  def _restore(self, cwd: str, writable: bool):
    if writable and self.isolation == ISOLATION_PRIVATE_FS:
      os.chown(cwd, 0, 0)

  def start(self, argv: list[str], cwd: str, limits: Limits,
            ro_binds: tuple[tuple[str, str], ...] | list = (), env: dict | None = None,
            python_src: str | None = None, inputs: list[str] | None = None) -> subprocess.Popen:
    """Starts `argv` in `cwd` with pipes on stdin, stdout and stderr (for a conversation; see
    `Channel`, which kills it and removes its cgroup, `proc.run_group`, when closed).
    `python_src`, `inputs`: as in `run`. Our end of stdin is non-blocking: a program that stops
    reading cannot block a write (Channel)."""
    group = self.cgroups.create(limits.memory_mb, limits.nproc)
    try:
      cmd, preexec = self._launcher.command(self.uid, argv, cwd, limits, ro_binds,
                                            self.isolation, python_src, inputs, group=group)
      proc = subprocess.Popen(cmd, cwd=cwd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, env=self._env(cwd, env),
                              start_new_session=True, close_fds=True, preexec_fn=preexec)
    except BaseException:
      if group is not None:
        group.remove()
      raise
    proc.run_group, proc.run_memory_mb = group, _tree_memory_mb(group, limits)
    os.set_blocking(proc.stdin.fileno(), False)
    return proc

  def run(self, argv: list[str], cwd: str, limits: Limits, stdin: bytes | None = None,
          wall_s: float | None = None, env: dict | None = None,
          ro_binds: tuple[tuple[str, str], ...] | list = (), python_src: str | None = None,
          inputs: list[str] | None = None, writable: bool = False) -> RunResult:
    """Runs `argv` in `cwd` under the limits. `stdin`: the input bytes. `ro_binds`: extra (host
    path, path inside) read-only binds in the private root. `python_src`: argv is [python
    interpreter], and it runs this source (`-I -S`). `inputs`: the files of `cwd` the program
    sees, read-only (None: all). `writable`: the working directory is `cwd` itself, writable
    (the compiler's run). `wall_s`: the backstop (default `limits.backstop_s`)."""
    wall_s = limits.backstop_s if wall_s is None else wall_s
    group = self.cgroups.create(limits.memory_mb, limits.nproc)
    cmd, preexec = self._launcher.command(self.uid, argv, cwd, limits, ro_binds, self.isolation,
                                          python_src, inputs, writable, group)
    env = self._env(cwd, env)
    # The input lives in a sealed memfd: no path in a directory the program controls is ever
    # opened by us (a symlink or FIFO planted there cannot redirect or block us), and no pipe
    # write of ours can block on a program that does not read.
    stdin_fd = sealed_memfd(stdin) if stdin is not None else None
    self._writable(cwd, writable)
    start = time.monotonic()
    try:
      try:
        proc = subprocess.Popen(
            cmd, cwd=cwd, stdin=stdin_fd if stdin_fd is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, start_new_session=True,
            close_fds=True, preexec_fn=preexec)
      finally:
        if stdin_fd is not None:
          os.close(stdin_fd)
      watch = CpuWatch(proc.pid, limits.cpu_s, group, _tree_memory_mb(group, limits))
      out, err, timed_out, truncated = run_tree.read_output(
          proc, start + wall_s, limits.max_output_bytes, watch)
      cpu = fault = None
      if watch.spent or watch.over_memory:     # its own limit: the program's doing
        cpu = watch.used
      elif timed_out:
        cpu, fault = run_judge.judge_overrun(watch, time.monotonic() - start, limits.cpu_s)
      if timed_out or truncated:
        run_tree.kill_run(proc)
      try:
        rc = proc.wait(timeout=max(0.0, start + wall_s + 1.0 - time.monotonic()))
      except subprocess.TimeoutExpired:
        timed_out = True
        run_tree.kill_run(proc)
        rc = proc.wait()
    finally:
      if group is not None:
        group.remove()
      self._restore(cwd, writable)
      self.remove_keys()
    return RunResult(rc, out, err, timed_out, truncated, time.monotonic() - start, cpu, fault)

  def remove_keys(self) -> int:
    """Removes the kernel keys the slot uid made (sandbox_keys.py: the filter refuses keyctl, this
    is the second line). Only where each slot has a uid of its own; call it once a run is over."""
    if self.isolation not in (ISOLATION_PRIVATE_FS, ISOLATION_NAMESPACES):
      return 0
    return sandbox_keys.remove_uid_keys(self.uid)


def _tree_memory_mb(group, limits: Limits) -> int | None:
  """The tree's memory limit for CpuWatch to check, where no cgroup bounds it (None where one
  does)."""
  return None if group is not None and group.bounds_memory else limits.memory_mb


def remove_leftovers(pid: int, root_dir: str | None = None) -> int:
  """Removes the run dirs and run cgroups of a DEAD process `pid` (a verifier worker killed
  mid-run never reaches its own cleanup). Returns how many run dirs there were."""
  dirs = glob.glob(os.path.join(root_dir or tempfile.gettempdir(), f"mj_sbx_{pid}_*"))
  for d in dirs:
    remove_tree(d)
  run_cgroup.sweep(owner=pid)
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
