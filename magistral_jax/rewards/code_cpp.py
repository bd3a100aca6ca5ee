"""C++ solutions: compiled with g++ inside the sandbox, against a precompiled <bits/stdc++.h>
built once per flag set."""
from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import tempfile

from magistral_jax.rewards.code_result import VerifierFault, write_source
from magistral_jax.rewards.sandbox import PRIVATE_FS, Sandbox
from magistral_jax.rewards.sandbox_limits import Limits

CXX_FLAGS = ("-std=c++20", "-O2", "-pipe")


@functools.lru_cache(maxsize=None)
def _gxx_version() -> str:
  return subprocess.run(["g++", "--version"], capture_output=True, text=True).stdout.split("\n")[0]


_pch_dirs: dict = {}


def precompiled_header_dir(flags: tuple[str, ...] = CXX_FLAGS) -> str | None:
  """A directory holding `bits/stdc++.h.gch` built with `flags` (built once, then reused).

  g++ looks for `<name>.gch` in each include directory before the header itself, so `-I<dir>`
  is enough. The build runs unsandboxed: its input is the system header, not model output.
  """
  if flags in _pch_dirs:
    return _pch_dirs[flags]
  key = hashlib.sha1(("|".join(flags) + _gxx_version()).encode()).hexdigest()[:12]
  root = os.path.join(tempfile.gettempdir(), "magistral_jax_pch", key)
  gch = os.path.join(root, "bits", "stdc++.h.gch")
  if not os.path.exists(gch):
    try:
      deps = subprocess.run(["g++", *flags, "-x", "c++", "-M", "-"], input="#include <bits/stdc++.h>\n",
                            capture_output=True, text=True, timeout=60).stdout
      header = next(t for t in deps.split() if t.endswith("bits/stdc++.h"))
      os.makedirs(os.path.dirname(root), exist_ok=True)
      tmp = tempfile.mkdtemp(dir=os.path.dirname(root))
      os.makedirs(os.path.join(tmp, "bits"))
      r = subprocess.run(["g++", *flags, "-x", "c++-header", header, "-o",
                          os.path.join(tmp, "bits", "stdc++.h.gch")], capture_output=True, timeout=120)
      if r.returncode != 0:
        raise RuntimeError(r.stderr.decode(errors="replace")[:500])
      os.chmod(tmp, 0o755)
      try:
        os.rename(tmp, root)      # atomic: concurrent builders keep whichever lands first
      except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    except (StopIteration, RuntimeError, OSError, subprocess.SubprocessError):
      _pch_dirs[flags] = None
      return None
  _pch_dirs[flags] = root
  return root


def compile_cpp(sandbox: Sandbox, workdir: str, source: str, timeout_s: float,
                use_pch: bool = True) -> tuple[bool, str]:
  """Compiles `source` to `workdir/prog` inside the sandbox. Returns (ok, message)."""
  write_source(os.path.join(workdir, "prog.cpp"), source)
  argv = ["g++", *CXX_FLAGS]
  pch = precompiled_header_dir() if use_pch else None
  binds = []
  if pch:
    # The header dir is bound read-only into the private root (the host's /tmp is not there).
    inside = "/pch" if sandbox.isolation in PRIVATE_FS else pch
    binds.append((pch, inside))
    argv.append(f"-I{inside}")
  argv += ["prog.cpp", "-o", "prog"]
  # tmp_mb: g++ keeps its temporaries in the private /tmp (little with -pipe). timeout_s is CPU
  # seconds per compiler process, so load cannot fail an honest compile; the wall-clock backstop
  # behind it is a verifier fault (VerifierFault) unless the compiler used its CPU or sat idle.
  limits = Limits(cpu_s=timeout_s, memory_mb=2048, file_size_mb=256, nproc=16, nofile=256,
                  max_output_bytes=1 << 20, tmp_mb=256)
  r = sandbox.run(argv, workdir, limits, ro_binds=binds, inputs=[], writable=True)
  if r.fault:
    raise VerifierFault(f"compile: {r.fault}")
  if r.timed_out:
    return False, f"compile timed out ({r.cpu_s:.1f}s CPU of {timeout_s:g}s)"
  if r.returncode != 0:
    return False, "compile error: " + r.stderr.decode(errors="replace")[:300]
  return True, ""
