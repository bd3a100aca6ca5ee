"""The program that builds a sandboxed run's private root: run by `python -I -S -c SETUP_SOURCE`
inside the new namespaces (rewards/sandbox.py), as namespace root, before the untrusted program.
"""

# Runs inside the new namespaces, as (namespace) root, before the program: builds the private root
# and execs the program. Python rather than a shell script of mount(8) calls: one process, ~10 ms.
# argv: spec (a Python literal), then the program's argv.
SETUP_SOURCE = r"""
import ctypes, os, sys
# The spec is a literal we wrote (repr); eval without builtins, not json (~20 ms of imports).
spec = eval(sys.argv[1], {"__builtins__": {}}); argv = sys.argv[2:]
libc = ctypes.CDLL(None, use_errno=True)
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
R = spec["mnt"]
mount("tmpfs", R, "tmpfs", NOSUID | NODEV, "size=1m,mode=0755")
for src, dst in spec["ro"]:
  if os.path.isdir(src):
    os.makedirs(R + dst, exist_ok=True)
  else:
    touch(R + dst)
  mount(src, R + dst, None, BIND | REC)
  # A read-only remount must keep the source's locked flags (nosuid, nodev, noexec, atime), or a
  # user namespace gets EPERM.
  keep = os.statvfs(src).f_flag & (NOSUID | NODEV | NOEXEC | 1024 | 2048 | 4096)
  mount(None, R + dst, None, REMOUNT | BIND | RDONLY | NOSUID | keep)
for target, link in spec["links"]:
  os.makedirs(os.path.dirname(R + link), exist_ok=True)
  os.symlink(target, R + link)
os.makedirs(R + spec["work"][1])
mount(spec["work"][0], R + spec["work"][1], None, BIND | NOSUID | NODEV)
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
uid = spec["uid"]
if uid is not None:
  os.setgroups([])
  os.setresgid(uid, uid, uid)
  os.setresuid(uid, uid, uid)
os.chdir(spec["work"][1])
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
