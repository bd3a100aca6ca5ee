"""What the benchmarks share: timing, host facts, flags and the JSON last line.

`time_rounds` (`time_fn`, `time_once`) report the median over `repeats` rounds after `warmup`
calls of the seconds per call; several callables run in turn within a round (`alternate`
reverses the order every other round) so a drifting host slows every side alike. `emit` prints
the one JSON object that ends each bench's output. Import this module before jax where the
process's devices matter (`use_cpu_devices`); it does not import jax itself.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from typing import Any, Callable, Mapping

# The repository (recipes, launchers); magistral_jax itself is installed (`make setup-test`:
# editable), and `python bench/X.py` imports its siblings (`import common`) from bench/.
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


def argument_parser(doc: str | None) -> argparse.ArgumentParser:
  """The benches' flag parser: argparse, with the module docstring as the --help text."""
  return argparse.ArgumentParser(description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)


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


# ---- host and output -------------------------------------------------------------------------

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


def compiled_memory(compiled) -> tuple[int, int]:
  """(peak bytes, temp bytes) of a compiled program, the peak as run/footprint.py counts it;
  (-1, -1) where the backend gives no memory analysis."""
  from magistral_jax.run.footprint import compiled_peak_bytes
  ma = compiled.memory_analysis()
  if ma is None:
    return -1, -1
  return compiled_peak_bytes(ma), int(ma.temp_size_in_bytes)


# Vendor peaks by a substring of jax's device_kind, first match: dense bf16 matmul TFLOP/s and
# memory bandwidth GB/s (the A100 SXM4 80GB's HBM2e before the other A100s').
VENDOR_PEAKS = (("H200", 989.0, 4800.0), ("H100 PCIe", 756.0, 2000.0), ("H100", 989.0, 3350.0),
                ("A100-SXM4-80GB", 312.0, 2039.0), ("A100", 312.0, 1555.0),
                ("TPU v5p", 459.0, 2765.0), ("TPU v5 lite", 197.0, 819.0),
                ("TPU v5e", 197.0, 819.0), ("TPU v4", 275.0, 1228.0))


def vendor_peak(device_kind: str) -> tuple[float | None, float | None]:
  """(bf16 TFLOP/s, GB/s) of the device kind from VENDOR_PEAKS; (None, None) where unknown."""
  for name, tflops, gbps in VENDOR_PEAKS:
    if name.lower() in device_kind.lower():
      return tflops, gbps
  return None, None


def host_info() -> dict:
  """The host facts the CPU benches report: core count and the load average at the end."""
  try:
    with open("/proc/loadavg") as f:
      load = f.read().split()[:3]
  except OSError:
    load = None
  return {"machine": f"cpu x{os.cpu_count()}", "loadavg": load}


def emit(result: Mapping, ndigits: int | None = None) -> None:
  """Print `result` as one JSON object on one line (a bench's last line of output is one; some
  print per-part lines the same way before it). With `ndigits`, top-level floats are rounded to
  that many digits."""
  if ndigits is not None:
    result = {k: (round(v, ndigits) if isinstance(v, float) else v) for k, v in result.items()}
  print(json.dumps(result), flush=True)
