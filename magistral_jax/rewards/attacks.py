"""Programs that generated code can run to forge a verdict, shared by the hostile sandbox tests
(tests/rewards/test_sandbox_hostile.py) and the soak benchmark (bench/sandbox_soak.py).

SEARCH prints every string the candidate's process can reach (argv, the environment, its files,
every object the garbage collector tracks, every stack frame's globals and locals, other
processes' command lines and environments) on stdout and on every other file descriptor it may
hold. A harness that keeps a "passed" token where the candidate can reach it is forged by it;
ours keeps none there (rewards/code_check.py), so printing it all must never pass. Append an
exit (e.g. `os._exit(0)`) to make it a whole program.
"""

SEARCH = """
import gc, os, sys
found = set(sys.argv) | set(os.environ.values()) | set(os.listdir("."))
for o in gc.get_objects():
  if isinstance(o, str) and len(o) < 200:
    found.add(o)
  elif isinstance(o, dict):
    found.update(v for v in list(o.values()) if isinstance(v, str))
f = sys._getframe()
while f is not None:
  found.update(v for v in list(f.f_globals.values()) + list(f.f_locals.values())
               if isinstance(v, str))
  f = f.f_back
for p in os.listdir("/proc"):
  for name in ("cmdline", "environ"):
    try:
      found.add(open("/proc/%s/%s" % (p, name), "rb").read().decode(errors="replace"))
    except OSError:
      pass
for n in os.listdir("."):
  try:
    found.add(open(n).read())
  except OSError:
    pass
out = "\\n".join(sorted(found))
for fd in range(20):
  try:
    os.write(fd, (out + "\\n").encode())
  except OSError:
    pass
print(out)
"""
