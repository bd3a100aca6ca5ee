"""What the benchmarks share: timing, subprocesses, host facts, flags and the JSON last line.

`time_rounds` (`time_fn`, `time_once`) report the median over `repeats` rounds after `warmup`
calls of the seconds per call; several callables run in turn within a round (`alternate`
reverses the order every other round) so a drifting host slows every side alike. `emit` prints
the JSON object that ends each bench's output. This module does not import jax.
"""
import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Mapping

# The repository (recipes, launchers); `python bench/X.py` imports its siblings from bench/.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def use_cpu_devices(count: int | None = None) -> None:
  """Run jax on the CPU platform (unless JAX_PLATFORMS says otherwise), with `count` simulated
  devices unless XLA_FLAGS already sets a count. Has to run before jax is imported."""
  if "jax" in sys.modules:
    raise RuntimeError("use_cpu_devices() must run before jax is imported")
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  if count and _DEVICE_COUNT_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" {_DEVICE_COUNT_FLAG}={count}").strip()


def argument_parser(doc: str | None, **flags: Any) -> argparse.ArgumentParser:
  """The benches' flag parser: argparse, with the module docstring as the --help text, and a
  --NAME flag per keyword of `flags` (add_flags)."""
  parser = argparse.ArgumentParser(description=doc,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  add_flags(parser, **flags)
  return parser


def add_flags(parser: argparse.ArgumentParser, **defaults: Any) -> None:
  """A --NAME flag per keyword, of its default's type (False: a switch; a type: that type, with
  None as the default; a list: one of its items, the first by default); a (default, help) pair
  gives the flag its help text too."""
  for name, value in defaults.items():
    default, text = value if isinstance(value, tuple) else (value, None)
    kind = (dict(action="store_true") if default is False else
            dict(type=default, default=None) if isinstance(default, type) else
            dict(choices=default, default=default[0]) if isinstance(default, list) else
            dict(type=type(default), default=default))
    parser.add_argument(f"--{name}", help=text, **kind)


def read_json(path: str) -> Any:
  with open(path) as f:
    return json.load(f)


# ---- timing ----------------------------------------------------------------------------------

@dataclasses.dataclass
class Timing:
  """One callable's timing: `rounds` / `cpu_rounds` are wall / process-CPU seconds per call, one
  entry per timed round; `warmup` the wall seconds of each untimed call before them (the first
  includes any compilation); `result` the last call's return value."""
  rounds: list[float] = dataclasses.field(default_factory=list)
  cpu_rounds: list[float] = dataclasses.field(default_factory=list)
  warmup: list[float] = dataclasses.field(default_factory=list)
  result: Any = None

  @property
  def median(self) -> float:
    """The reported statistic: median wall seconds per call over the timed rounds."""
    return float(statistics.median(self.rounds))

  @property
  def cpu_median(self) -> float:
    """Median process-CPU seconds per call (all threads of this process) over the rounds."""
    return float(statistics.median(self.cpu_rounds))


def _wait(x: Any, block: bool) -> Any:
  """Wait for jax's asynchronous dispatch to finish computing `x` (when jax is in use)."""
  jax = sys.modules.get("jax")
  if block and jax is not None:
    jax.block_until_ready(x)
  return x


def time_rounds(fns: Mapping[str, Callable[[], Any]], repeats: int, *, warmup: int = 1,
                calls: int | Mapping[str, int] = 1, alternate: bool = False,
                block: bool = True) -> dict[str, Timing]:
  """Time each callable (see the module docstring for the statistic). `calls`: calls per round,
  one number or one per name. `block`: wait for each round's last result with
  jax.block_until_ready (off for results that are no jax values, where walking a large
  Python structure would be timed too)."""
  if repeats < 1:
    raise ValueError(f"repeats {repeats}: at least one timed round")
  per = calls if isinstance(calls, Mapping) else {k: calls for k in fns}
  if min(per[k] for k in fns) < 1:
    raise ValueError(f"calls {dict(per)}: at least one call per round")
  out = {k: Timing() for k in fns}
  for _ in range(warmup):
    for k, fn in fns.items():
      t = time.perf_counter()
      out[k].result = _wait(fn(), block)
      out[k].warmup.append(time.perf_counter() - t)
  order = list(fns)
  for r in range(repeats):
    for k in (order[::-1] if alternate and r % 2 else order):
      fn, n = fns[k], per[k]
      w, c = time.perf_counter(), time.process_time()
      for _ in range(n):
        res = fn()
      out[k].result = _wait(res, block)
      out[k].rounds.append((time.perf_counter() - w) / n)
      out[k].cpu_rounds.append((time.process_time() - c) / n)
  return out


def time_fn(fn: Callable[[], Any], repeats: int, *, warmup: int = 1, calls: int = 1,
            block: bool = True) -> Timing:
  """`time_rounds` for one callable."""
  return time_rounds({"fn": fn}, repeats, warmup=warmup, calls=calls, block=block)["fn"]


def time_once(fn: Callable[[], Any], block: bool = True) -> tuple[float, Any]:
  """(seconds, result) of a single call with no warm-up: for what runs once by nature (a file
  import, a save) or whose first call is the figure."""
  t = time_fn(fn, 1, warmup=0, block=block)
  return t.median, t.result


class Carry:
  """One state threaded through programs that donate it, `fn(state, *args) -> (state, out)`:
  `step(fn, *args)` is a callable for the timers (returning (state, out)) that continues from
  the latest state, whichever program left it; `state` holds the latest."""

  def __init__(self, state: Any):
    self.state = state

  def step(self, fn: Callable[..., tuple[Any, Any]], *args: Any) -> Callable[[], tuple[Any, Any]]:
    def call():
      self.state, out = fn(self.state, *args)
      return self.state, out
    return call


# ---- subprocesses ----------------------------------------------------------------------------

def run_logged(argv: list[str], log_path: str, *, timeout: float | None = None,
               env: Mapping[str, str] | None = None) -> float:
  """Runs `argv` (a launcher) from the repository root, its stdout and stderr into `log_path`;
  returns its wall seconds. Raises with the log's end if it fails or runs past `timeout`."""
  t = time.perf_counter()
  with open(log_path, "w") as log:
    try:
      rc = subprocess.run(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                          timeout=timeout).returncode
    except subprocess.TimeoutExpired:
      rc = "timeout"
  if rc != 0:
    with open(log_path) as f:
      tail = f.read()[-3000:]
    raise RuntimeError(f"{' '.join(argv)} failed (rc={rc}); the end of {log_path}:\n{tail}")
  return time.perf_counter() - t


def run_phase(name: str, argv: list[str], log_dir: str, timeout: float | None = None,
              done: str | None = None) -> float:
  """Runs a launcher (`argv`, after this interpreter) as a bench's phase, its log in
  log_dir/NAME.log; returns its wall seconds, 0 when `done` (a file it leaves) exists already."""
  if done and os.path.exists(done):
    print(f"== {name}: done before ({done})", flush=True)
    return 0.0
  cmd = [sys.executable] + argv
  print(f"== {name}: {' '.join(cmd)}", flush=True)
  wall = run_logged(cmd, os.path.join(log_dir, f"{name}.log"), timeout=timeout)
  print(f"   {name}: rc=0 in {wall:.0f} s", flush=True)
  return wall


def run_json(argv: list[str], *, env: Mapping[str, str] | None = None,
             timeout: float | None = None) -> dict:
  """Runs a bench (or a part of one) from the repository root, its stderr passing through, and
  returns the JSON object its stdout ends with. Raises with the stdout's end if it fails."""
  p = subprocess.run(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True, timeout=timeout)
  lines = [l for l in p.stdout.splitlines() if l.strip()]
  if p.returncode != 0 or not lines:
    tail = "\n".join(lines[-20:])
    raise RuntimeError(f"{' '.join(argv)} failed (rc={p.returncode}); its stdout ended:\n{tail}")
  return json.loads(lines[-1])


def cluster_main(parser: argparse.ArgumentParser, child: Callable) -> argparse.Namespace | None:
  """The flags, with a hidden --distributed: set on the processes cluster_json starts, where this
  runs child(flags) between multihost.initialize() and finish() and returns None."""
  parser.add_argument("--distributed", action="store_true", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if not args.distributed:
    return args
  from magistral_jax.parallel import multihost
  multihost.initialize()
  child(args)
  multihost.finish()   # process 0 hosts the service: it leaves last


def cluster_json(script: str, num_processes: int, devices_per_process: int, process: int,
                 name: str) -> dict:
  """Runs `script` (with this command's arguments) as `num_processes` local JAX processes of CPU
  devices (launch/local_cluster.py; each gets --distributed) and returns the last JSON object
  process `process` printed; exits naming `name` if the run failed."""
  import io
  from magistral_jax.parallel.local_cluster import run_cluster
  out = io.StringIO()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  rc = run_cluster([os.path.abspath(script)] + sys.argv[1:], num_processes=num_processes,
                   devices_per_process=devices_per_process, grace_s=30, out=out,
                   handle_signals=False)
  text = out.getvalue()
  prefix = f"[p{process}] "
  lines = [l[len(prefix):] for l in text.splitlines() if l.startswith(prefix + "{")]
  if rc != 0 or not lines:
    sys.stderr.write(text[-8000:])
    raise SystemExit(f"{name}: the {num_processes}-process run failed (exit code {rc})")
  return json.loads(lines[-1])


# ---- models and hosts ------------------------------------------------------------------------

def hf_causal_lm(path: str, dtype: str):
  """transformers' model from a GGUF file (its own loader) or an HF directory, as torch `dtype`
  (a name: float32, bfloat16)."""
  import torch
  import transformers
  where = {"gguf_file": os.path.basename(path)} if path.endswith(".gguf") else {}
  return transformers.AutoModelForCausalLM.from_pretrained(
      os.path.dirname(path) if where else path, dtype=getattr(torch, dtype), **where)


def lognormal_lengths(rng, mean: float, size: int, hi: int):
  """Long-tailed lengths (int32): lognormal with sigma 1 and mean `mean`, clipped to [1, hi]."""
  import math
  import numpy as np
  return np.clip(rng.lognormal(math.log(mean) - 0.5, 1.0, size), 1, hi).astype(np.int32)


def proc_status_kb(key: str, pid: int | str = "self") -> int:
  """A figure of /proc/PID/status in kB (VmRSS, VmHWM, ...)."""
  with open(f"/proc/{pid}/status") as f:
    return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))


def stream_bandwidth(device, nbytes: int, reps: int = 5) -> dict:
  """Streaming bandwidth of `device` in GB/s: a sum over an nbytes fp32 array (read) and an
  in-place scale of it (read + write); stream_GBps is the faster (on CPU the sum runs on one
  core, the scale on all)."""
  import jax
  import jax.numpy as jnp
  n = nbytes // 4
  x = jax.jit(lambda: jnp.arange(n, dtype=jnp.float32) * 1e-9,
              out_shardings=jax.sharding.SingleDeviceSharding(device))()
  c = jax.device_put(jnp.float32(1.0), device)
  total = jax.jit(jnp.sum)
  scale = jax.jit(lambda x, c: x * c, donate_argnums=0)   # in place: no fresh pages per call
  t_read = time_fn(lambda: total(x), reps).median
  carry = Carry(x)
  del x
  t_copy = time_fn(carry.step(lambda x: (scale(x, c), None)), reps).median
  del carry
  read, copy = 4 * n / t_read / 1e9, 2 * 4 * n / t_copy / 1e9
  return {"array_bytes": 4 * n, "read_GBps": read, "copy_GBps": copy,
          "stream_GBps": max(read, copy)}


def compile_timed(jitted, *args) -> tuple[Any, float]:
  """(`jitted` compiled for `args`, the seconds its lowering and compilation took)."""
  seconds, program = time_once(lambda: jitted.lower(*args).compile(), block=False)
  return program, seconds


def host_info() -> dict:
  """The host facts the CPU benches report: core count and the load average at the end."""
  try:
    with open("/proc/loadavg") as f:
      load = f.read().split()[:3]
  except OSError:
    load = None
  return {"machine": f"cpu x{os.cpu_count()}", "loadavg": load}


def emit(result: Mapping, ndigits: int | None = None) -> None:
  """Print `result` as one JSON object on one line (a bench's last line), top-level floats
  rounded to `ndigits` digits where given."""
  if ndigits is not None:
    result = {k: (round(v, ndigits) if isinstance(v, float) else v) for k, v in result.items()}
  print(json.dumps(result), flush=True)
