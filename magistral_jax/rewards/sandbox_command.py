"""The command line of one sandboxed run under each isolation mode (rewards/sandbox.py chooses the
mode and runs it): the wrappers, the namespaces, and for a private filesystem the spec that the
setup (sandbox_root.SETUP_SOURCE) builds the run's root, cgroup, IPC limits and filter from.
"""
from __future__ import annotations

import os
import platform
import shutil
import sys
import tempfile

from magistral_jax.rewards.sandbox_limits import make_preexec, prlimit_args
from magistral_jax.rewards.sandbox_root import (SECCOMP, SETUP_SOURCE, SYS_PIVOT_ROOT,
                                                base_ro_paths, seccomp_program)

# The seccomp filters of this machine (sandbox_root.seccomp_program), by whether the run's cgroup
# counts its CPU and bounds its memory, or None where SECCOMP has no numbers for it.
_SECCOMP_PROGRAM = ({(c, m): seccomp_program(SECCOMP[platform.machine()], c, m)
                     for c in (False, True) for m in (False, True)}
                    if platform.machine() in SECCOMP else None)
# Strongest first. The first two have a private filesystem; the last two are the weak modes that
# only allow_weak permits.
ISOLATION_PRIVATE_FS = "mountns+netns+pidns+uid+rlimits"
ISOLATION_USERNS = "userns+mountns+netns+pidns+rlimits"
ISOLATION_NAMESPACES = "netns+pidns+uid+rlimits"
ISOLATION_FALLBACK = "session+rlimits"
ISOLATION_REFUSED = "refused"
PRIVATE_FS = (ISOLATION_PRIVATE_FS, ISOLATION_USERNS)
WORKDIR = "/sandbox"          # where the run directory appears inside the private root
PAGE = os.sysconf("SC_PAGE_SIZE")
SHM_SEGMENTS = 16             # SysV shm segments a run may hold (all of them within tmp_mb)


class SandboxUnavailable(RuntimeError):
  """No mount namespace could be made and the weak modes were not allowed."""




class Launcher:
  """The tools a run is wrapped in, found once (a class: the paths and binds are looked up at
  construction and kept)."""

  def __init__(self, root_dir: str | None = None):
    self._unshare = shutil.which("unshare")
    # setpriv --pdeathsig: if our process dies, the run dies with it (and so its namespace).
    self._prefix = [shutil.which("setpriv"), "--pdeathsig", "KILL", "--", shutil.which("prlimit")]
    # The setup runs before pivot_root, so any interpreter will do: the system one starts fastest
    # (a pyenv one takes twice as long); -I -S: nothing from the environment or site-packages.
    self._setup_python = next((p for p in ("/usr/bin/python3", "/usr/local/bin/python3")
                               if os.access(p, os.X_OK)), sys.executable)
    self._ro, self._links = base_ro_paths()
    self.mnt = os.path.join(root_dir or tempfile.gettempdir(), "mj_sbx_mnt")

  def command(self, uid, argv, cwd, limits, ro_binds, isolation, python_src=None, inputs=None,
              writable=False, group=None):
    """(argv to Popen, preexec_fn or None) for one run under `isolation`, as slot `uid`. With
    `python_src`, argv is [python]: that interpreter runs the source (in the private root, the
    same interpreter process that set the root up). With a private filesystem, `inputs` (names
    of files in `cwd`; None: every regular file there) are copied into the run's tmpfs working
    directory, or, with `writable`, `cwd` itself is the working directory (for the
    compiler only: no candidate code may run with a host directory to write). `group`: the
    run's cgroup (run_cgroup.RunGroup), joined by the setup before anything else."""
    if python_src is not None and isolation not in PRIVATE_FS:
      argv = [argv[0], "-I", "-S", "-c", python_src]
    if isolation == ISOLATION_REFUSED:
      raise SandboxUnavailable("sandbox refused: no mount namespace on this host; generated code "
                               "is not run (RewardConfig.allow_weak_sandbox allows weaker modes)")
    if isolation in PRIVATE_FS:
      user = isolation == ISOLATION_USERNS
      if inputs is None:
        inputs = [e.name for e in os.scandir(cwd) if e.is_file(follow_symlinks=False)]
      spec = {"mnt": self.mnt, "workdir": WORKDIR, "work_rw": cwd if writable else None,
              "inputs": [[os.path.join(cwd, n), n] for n in inputs], "work_mb": limits.work_mb,
              "work_inodes": limits.work_inodes, "tmp_mb": limits.tmp_mb,
              "ro": self._ro + [[h, i] for h, i in ro_binds], "links": self._links,
              "uid": None if user else uid, "then": python_src,
              "sys_pivot_root": SYS_PIVOT_ROOT.get(platform.machine(), -1),
              "seccomp": _SECCOMP_PROGRAM and _SECCOMP_PROGRAM[
                  group is not None, group is not None and group.bounds_memory],
              "cgroup_procs": group.procs_files if group is not None else [],
              "shm": [("shmmax", limits.tmp_mb << 20), ("shmall", (limits.tmp_mb << 20) // PAGE),
                      ("shmmni", SHM_SEGMENTS)],
              "keyctl": SECCOMP.get(platform.machine(), {}).get("keyctl")}
      ns = ["--user", "--map-root-user"] if user else []
      setup_python = argv[0] if python_src is not None else self._setup_python
      # --ipc: SysV objects and POSIX message queues of their own, gone with the run, so no run
      # reads what another left (and none is left on the host).
      return [*self._prefix, *prlimit_args(limits), "--", self._unshare, *ns, "--mount", "--net",
              "--ipc", "--pid", "--fork", "--kill-child", "--", setup_python, "-I", "-S", "-c",
              SETUP_SOURCE, repr(spec), *([] if python_src is not None else argv)], None
    if isolation == ISOLATION_NAMESPACES:
      # setpriv/prlimit instead of a Python preexec_fn: without one, subprocess can vfork, which
      # spares every run the copy of the page tables that a plain fork makes in a worker that
      # holds SymPy.
      return [*self._prefix, *prlimit_args(limits), "--", self._unshare, "--net", "--ipc",
              "--pid", "--fork", "--kill-child", f"--setuid={uid}", f"--setgid={uid}",
              "--", *argv], None
    return list(argv), make_preexec(limits, limits.cpu_s)
