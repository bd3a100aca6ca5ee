"""A sandboxed run's private root: what the host lends it read-only (base_ro_paths, and an
interpreter's prefix: interpreter_binds), and the program that builds it, run by
`python -I -S -c SETUP_SOURCE` inside the new namespaces (rewards/sandbox.py), as namespace root,
before the untrusted program.
"""
import os

# Runs inside the new namespaces, as (namespace) root, before the program: builds the private root
# and execs the program. Python rather than a shell script of mount(8) calls: one process, not one
# per mount.
# argv: spec (a Python literal), then the program's argv.
SETUP_SOURCE = r"""
import ctypes, os, sys
# The spec is a literal we wrote (repr); eval without builtins, not json (whose imports cost).
spec = eval(sys.argv[1], {"__builtins__": {}}); argv = sys.argv[2:]
libc = ctypes.CDLL(None, use_errno=True)
# The run's own cgroup (rewards/run_cgroup.py), joined first, so everything the program does is
# counted there; then a cgroup namespace of its own, so it sees that cgroup as its root.
for p in spec.get("cgroup_procs", ()):
  with open(p, "w") as f:
    f.write("0")
if spec.get("cgroup_procs") and libc.unshare(0x02000000) != 0:     # CLONE_NEWCGROUP
  raise OSError(ctypes.get_errno(), "unshare cgroup namespace")
# SysV shm limits of the run's private IPC namespace (these sysctls are per namespace): its
# segments, each and all together, are bounded like its tmpfs, cgroup or not.
for name, value in spec.get("shm", ()):
  with open("/proc/sys/kernel/" + name, "w") as f:
    f.write(str(value))
RDONLY, NOSUID, NODEV, NOEXEC, REMOUNT, BIND, REC, PRIVATE = 1, 2, 4, 8, 32, 4096, 16384, 1 << 18
def mount(src, dst, fstype, flags, data=None):
  if libc.mount(src and src.encode(), dst.encode(), fstype and fstype.encode(),
                ctypes.c_ulong(flags), data and data.encode()) != 0:
    e = ctypes.get_errno()
    raise OSError(e, "mount %s on %s: %s" % (src, dst, os.strerror(e)))
def touch(p):
  os.makedirs(os.path.dirname(p), exist_ok=True)
  open(p, "a").close()
# Nothing we mount may propagate back to the host's namespace.
mount(None, "/", None, REC | PRIVATE)
def ro_bind(src, dst):
  if os.path.isdir(src):
    os.makedirs(dst, exist_ok=True)
  else:
    touch(dst)
  mount(src, dst, None, BIND | REC)
  # A read-only remount must keep the source's locked flags (nosuid, nodev, noexec, atime), or a
  # user namespace gets EPERM.
  keep = os.statvfs(src).f_flag & (NOSUID | NODEV | NOEXEC | 1024 | 2048 | 4096)
  mount(None, dst, None, REMOUNT | BIND | RDONLY | NOSUID | keep)
R = spec["mnt"]
mount("tmpfs", R, "tmpfs", NOSUID | NODEV, "size=1m,mode=0755")
for src, dst in spec["ro"]:
  ro_bind(src, R + dst)
for target, link in spec["links"]:
  os.makedirs(os.path.dirname(R + link), exist_ok=True)
  os.symlink(target, R + link)
W = R + spec["workdir"]
os.makedirs(W)
if spec["work_rw"] is not None:
  # The compiler's run only: the host dir, writable, for its output (no candidate code runs).
  mount(spec["work_rw"], W, None, BIND | NOSUID | NODEV)
else:
  # Every other run: a fresh size- and inode-limited tmpfs, gone with the namespace, so nothing
  # the program writes reaches the host, and the host never touches a path the program made.
  # Our input files (the source, the binary) are copied into it, read-only and ours: copies, not
  # bind mounts, so the run's /proc/self/mountinfo names no host path of ours.
  owner = ",uid=%d,gid=%d" % (spec["uid"], spec["uid"]) if spec["uid"] is not None else ""
  mount("tmpfs", W, "tmpfs", NOSUID | NODEV,
        "size=%dm,nr_inodes=%d,mode=0755%s" % (spec["work_mb"], spec["work_inodes"], owner))
  for src, name in spec["inputs"]:
    fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW)
    out = os.open(W + "/" + name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
                  os.fstat(fd).st_mode & 0o555)
    while os.sendfile(out, fd, None, 1 << 24):
      pass
    os.close(fd)
    os.close(out)
size = "size=%dm,mode=1777" % spec["tmp_mb"]
os.makedirs(R + "/tmp")
mount("tmpfs", R + "/tmp", "tmpfs", NOSUID | NODEV, size)
os.makedirs(R + "/dev/shm")
mount("tmpfs", R + "/dev/shm", "tmpfs", NOSUID | NODEV | NOEXEC, size)
for d in ("null", "zero", "full", "random", "urandom"):
  touch(R + "/dev/" + d)
  mount("/dev/" + d, R + "/dev/" + d, None, BIND | NOSUID)
for i, n in enumerate(("stdin", "stdout", "stderr")):
  os.symlink("/proc/self/fd/%d" % i, R + "/dev/" + n)
os.symlink("/proc/self/fd", R + "/dev/fd")
# /proc of our PID namespace, mounted while the host's /proc is still visible (a user namespace
# may only mount proc where a full one is already in sight).
os.makedirs(R + "/proc")
mount("proc", R + "/proc", "proc", NOSUID | NODEV | NOEXEC)
os.chdir(R)
if libc.syscall(spec["sys_pivot_root"], b".", b".") != 0:
  raise OSError(ctypes.get_errno(), "pivot_root")
if libc.umount2(b".", 2) != 0:        # MNT_DETACH: the old root becomes unreachable
  raise OSError(ctypes.get_errno(), "umount old root")
os.chdir("/")
mount(None, "/", None, REMOUNT | RDONLY | NOSUID | NODEV)
# No capability survives exec: empty bounding set (as root in a user namespace, exec would grant
# the bounding set) and no_new_privs.
for cap in range(64):
  if libc.prctl(24, cap, 0, 0, 0) != 0:     # PR_CAPBSET_DROP; EINVAL past the last cap
    break
libc.prctl(38, 1, 0, 0, 0)                  # PR_SET_NO_NEW_PRIVS
# A fresh, empty session keyring of the run's own (KEYCTL_JOIN_SESSION_KEYRING, anonymous), joined
# before the uid drop so that it counts as ours, not the slot uid's: the run no longer holds the
# verifier's session keyring, so nothing it does can link a key under ours (the filter refuses
# keyctl anyway; this is the second line, see sandbox_keys.py). Gone with the run.
if spec.get("keyctl") is not None:
  libc.syscall(ctypes.c_long(spec["keyctl"]), ctypes.c_long(1), ctypes.c_long(0))
uid = spec["uid"]
if uid is not None:
  os.setgroups([])
  os.setresgid(uid, uid, uid)
  os.setresuid(uid, uid, uid)
  # A credential change clears the parent-death signal that `unshare --kill-child` armed: re-arm
  # it, or a killed worker's namespace would live on (the pool also kills the slot uid's
  # processes after a worker dies, which covers the instant between the two).
  libc.prctl(1, 9, 0, 0, 0)                 # PR_SET_PDEATHSIG, SIGKILL
# The seccomp filter (seccomp_program below, built on our side; None where the machine has no
# numbers): installed last, since the setup itself needs some of what it refuses.
code = spec["seccomp"]
if code is not None:
  class Ins(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8),
                ("k", ctypes.c_uint32)]
  class Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(Ins))]
  ins = (Ins * len(code))(*[Ins(*c) for c in code])
  if libc.prctl(22, 2, ctypes.byref(Prog(len(code), ins)), 0, 0) != 0:   # SECCOMP_MODE_FILTER
    raise OSError(ctypes.get_errno(), "seccomp")
os.chdir(spec["workdir"])
if spec.get("then") is not None:
  # Python source to run in THIS interpreter (one interpreter start per run instead of two). No
  # exec follows, so in a user namespace the capabilities are cleared here (capset: effective,
  # permitted, inheritable all empty); as root, setresuid to U has cleared them already.
  if uid is None:
    class Header(ctypes.Structure):
      _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
    if libc.capset(ctypes.byref(Header(0x20080522, 0)), ctypes.byref((ctypes.c_uint32 * 6)())):
      raise OSError(ctypes.get_errno(), "capset")
  sys.argv = ["-c"]
  exec(compile(spec["then"], "<run>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
else:
  # Our own PATH search: os.execvp imports modules, and the setup interpreter's library may not
  # be inside the new root.
  prog = argv[0]
  if "/" not in prog:
    for d in os.environ.get("PATH", "/usr/bin:/bin").split(":"):
      if os.access(d + "/" + prog, os.X_OK):
        prog = d + "/" + prog
        break
  try:
    os.execv(prog, argv)
  except OSError as e:
    sys.stderr.write("sandbox: cannot exec %s: %s\n" % (argv[0], e))
    os._exit(127)
"""

# pivot_root(2) has no libc wrapper: the setup program calls it by number, per machine.
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "ppc64le": 203, "s390x": 217, "riscv64": 41}
# The seccomp filter's numbers per machine: the audit arch (AUDIT_ARCH_*) and the syscalls it
# treats apart. Other machines run without the filter (the sandbox's docstring says what that
# loses).
SECCOMP = {
    "x86_64": {"arch": 0xC000003E, "clone": 56, "unshare": 272, "setns": 308, "clone3": 435,
               "socket": 41, "personality": 135, "keyctl": 250, "add_key": 248,
               "request_key": 249, "io_uring_setup": 425, "io_uring_enter": 426,
               "io_uring_register": 427, "userfaultfd": 323, "ptrace": 101,
               "perf_event_open": 298, "bpf": 321, "rt_sigaction": 13, "memfd_create": 319},
    "aarch64": {"arch": 0xC00000B7, "clone": 220, "unshare": 97, "setns": 268, "clone3": 435,
                "socket": 198, "personality": 92, "keyctl": 219, "add_key": 217,
                "request_key": 218, "io_uring_setup": 425, "io_uring_enter": 426,
                "io_uring_register": 427, "userfaultfd": 282, "ptrace": 117,
                "perf_event_open": 241, "bpf": 280, "rt_sigaction": 134, "memfd_create": 279},
}
# Refused outright (EPERM), and why:
#   - unshare, setns: no namespace can be made or joined from inside (a nested user namespace's
#     root could mount and unshare again);
#   - keyctl, add_key, request_key: the kernel keyring is not namespaced, so a key is a channel
#     that outlives the run and crosses to the next run of the same problem (the fourth red-team
#     wave passed guessed verdicts through world-readable keys, and left keys of the sandbox uids
#     behind); request_key would also start a root helper (/sbin/request-key) where keyutils is
#     installed;
#   - io_uring_*: a second syscall interface that this filter cannot see into (its operations run
#     without passing through here), so everything below would be moot;
#   - userfaultfd: lets a program stall the kernel's (and so our) accesses to its memory at will;
#   - ptrace: no process debugs another (PTRACE_TRACEME included: it would hand the run's first
#     process control over its children's syscalls, past this filter's view);
#   - perf_event_open, bpf: kernel profiling and programs, attack surface a solution never needs.
SECCOMP_DENIED = ("unshare", "setns", "keyctl", "add_key", "request_key", "io_uring_setup",
                  "io_uring_enter", "io_uring_register", "userfaultfd", "ptrace",
                  "perf_event_open", "bpf")
AF_VSOCK = 40                 # socket(2)'s family refused: the network namespace does not cover it
CLONE_NEW_FLAGS = 0x7E020000  # CLONE_NEWNS|NEWCGROUP|NEWUTS|NEWIPC|NEWUSER|NEWPID|NEWNET
PERSONALITY_QUERY = 0xFFFFFFFF
# cBPF, as seccomp reads it: opcodes, return actions and the offsets of seccomp_data's fields.
_LD, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06
SECCOMP_ALLOW, SECCOMP_KILL = 0x7FFF0000, 0x80000000
SECCOMP_EPERM, SECCOMP_ENOSYS = 0x50000 | 1, 0x50000 | 38
_NR, _ARCH, _ARG0, _ARG1 = 0, 4, 16, 24  # an arg's low 32 bits (little-endian, as in SECCOMP)
SIGCHLD = 17


def seccomp_program(numbers: dict, cpu_counted: bool = True, memory_counted: bool = True
                    ) -> list[tuple[int, int, int, int]]:
  """The filter for one machine's `numbers` (a SECCOMP entry), as (code, jt, jf, k)
  instructions. As Docker's default profile does:
    - another ABI than the machine's own (i386 on x86_64) is killed; x32 numbers are refused;
    - clone3 answers ENOSYS: its flags sit in memory a filter cannot read, and libc then falls
      back to clone, whose flags it can: clone with a CLONE_NEW* flag is refused;
    - SECCOMP_DENIED is refused (EPERM), see above;
    - socket(AF_VSOCK, ...) is refused: vsock reaches the hypervisor's host, and no network
      namespace confines it;
    - personality is a query only (0xffffffff, or setting the default PER_LINUX, 0): changing the
      execution domain would switch off ASLR or change syscall semantics under the filter.
  Where the run's cgroup (rewards/run_cgroup.py) does not count its CPU (`cpu_counted` False:
  no cgroup) or bound its memory (`memory_counted` False: no cgroup, or no memory controller),
  one more each, so that the per-process accounting still sees the whole tree:
    - rt_sigaction(SIGCHLD, <any new action>): without a handler or disposition change no
      process can have the kernel reap its children (SIG_IGN, SA_NOCLDWAIT), so every child's CPU
      stays on a zombie or reaches its reaper's cutime (or, orphaned, PID 1's), where the CPU
      watch counts it; querying the action is allowed;
    - memfd_create: its pages belong to no process and, unmapped, no limit of a process sees
      them (SysV shm is bounded by the IPC namespace's shm limits, /tmp and /dev/shm by their
      tmpfs sizes).
  Everything else is allowed. A refusal is an errno, not a kill: the program sees a failed call
  and goes on, and its output is judged as any other."""
  deny = [numbers[n] for n in SECCOMP_DENIED + (() if memory_counted else ("memfd_create",))]
  # Each argument check is a tail of its own that ends in a return; `tails` are laid out after
  # the main chain, which ends with ALLOW.
  tails = {
      "clone": [(_LD, 0, 0, _ARG0), (_JSET, 0, 1, CLONE_NEW_FLAGS), (_RET, 0, 0, SECCOMP_EPERM),
                (_RET, 0, 0, SECCOMP_ALLOW)],
      "socket": [(_LD, 0, 0, _ARG0), (_JEQ, 0, 1, AF_VSOCK), (_RET, 0, 0, SECCOMP_EPERM),
                 (_RET, 0, 0, SECCOMP_ALLOW)],
      "personality": [(_LD, 0, 0, _ARG0), (_JEQ, 2, 0, PERSONALITY_QUERY), (_JEQ, 1, 0, 0),
                      (_RET, 0, 0, SECCOMP_EPERM), (_RET, 0, 0, SECCOMP_ALLOW)],
  }
  if not cpu_counted:     # SIGCHLD with a non-NULL new action (both halves of the pointer) refused
    tails["rt_sigaction"] = [
        (_LD, 0, 0, _ARG0), (_JEQ, 0, 5, SIGCHLD), (_LD, 0, 0, _ARG1), (_JEQ, 0, 2, 0),
        (_LD, 0, 0, _ARG1 + 4), (_JEQ, 1, 0, 0), (_RET, 0, 0, SECCOMP_EPERM),
        (_RET, 0, 0, SECCOMP_ALLOW)]
  head = [(_LD, 0, 0, _ARCH), (_JEQ, 1, 0, numbers["arch"]), (_RET, 0, 0, SECCOMP_KILL),
          (_LD, 0, 0, _NR), (_JGE, 0, 1, 0x40000000), (_RET, 0, 0, SECCOMP_EPERM),
          (_JEQ, 0, 1, numbers["clone3"]), (_RET, 0, 0, SECCOMP_ENOSYS)]
  for nr in deny:
    head += [(_JEQ, 0, 1, nr), (_RET, 0, 0, SECCOMP_EPERM)]
  # One JEQ per tail, jumping over the rest of the chain to where that tail starts.
  names = list(tails)
  chain_end = len(head) + len(names) + 1          # index just past the final ALLOW
  starts, at = {}, chain_end
  for name in names:
    starts[name] = at
    at += len(tails[name])
  for name in names:
    head.append((_JEQ, starts[name] - len(head) - 1, 0, numbers[name]))
  head.append((_RET, 0, 0, SECCOMP_ALLOW))
  for name in names:
    head += tails[name]
  if len(head) > 255:
    raise ValueError("seccomp program too long for 8-bit jumps")
  return head


def base_ro_paths() -> tuple[list[list[str]], list[list[str]]]:
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
