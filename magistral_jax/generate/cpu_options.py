"""Engine settings that pay on XLA:CPU, in one options object (CpuOptions), and the generate
step's dot-library choice they drive.

The decode step's matmuls are [slots, D] x [D, F]: matrix-vector-like products that stream the
weights, plus small batched attention products over the KV cache. On XLA:CPU they run either
through YNNPACK (XLA's default dot fusion) or through XLA's own emitter / Eigen (YNNPACK turned
off), and which one is faster depends on the host CPU, not only on the shapes (interleaved A/B
medians of the engine's step; docs/design_notes.md):
- on one host Eigen was faster below 32 slots and YNNPACK from 32 on;
- on another, with AVX-512, YNNPACK was faster at every slot count.
So the engine measures: with dot_library="auto" (the default) tune_engine (run by
Engine.precompile, and by a run's generators with engine.tune) compiles the step both ways and
keeps the faster (GenerateStep.tune); until then, and with a fixed choice,
generate_compiler_options' slot-count rule applies. Only the generate step is affected;
prefill's [N * bucket, D] matmuls keep the defaults. Off CPU the dot library is ignored.

Drain compaction (compaction.py) is the other setting: a step costs about the same however many
slots are active on XLA:CPU, so the drain at the end of a batch runs on fewer slots.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np

log = logging.getLogger(__name__)

CPU_GENERATE_COMPILER_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": ""}
CPU_GENERATE_YNN_MIN_SLOTS = 32
CPU_DOT_LIBRARIES = ("ynnpack", "eigen")


@dataclasses.dataclass(frozen=True)
class CpuOptions:
  """dot_library: "auto" (time both on CPU, see the module docstring), "ynnpack" or "eigen";
  ignored off CPU. compact_sizes: the smaller slot counts the drain's active slots can be
  gathered into (compaction.py; default half and a quarter of the slots, () = no compaction;
  applied on every platform, measured to pay on XLA:CPU)."""
  dot_library: str = "auto"
  compact_sizes: Sequence[int] | None = None

  def __post_init__(self):
    if self.dot_library not in ("auto",) + CPU_DOT_LIBRARIES:
      raise ValueError(f"cpu_dot_library must be 'auto' or one of {CPU_DOT_LIBRARIES}, got "
                       f"{self.dot_library!r}")

  @classmethod
  def resolve(cls, cpu: "CpuOptions | None", dot_library: str | None,
              compact_sizes: Sequence[int] | None) -> "CpuOptions":
    """The options an Engine runs with: `cpu`, or one built from the Engine keywords
    cpu_dot_library / compact_sizes (shorthands for its fields), not both."""
    if cpu is None:
      return cls("auto" if dot_library is None else dot_library, compact_sizes)
    if dot_library is not None or compact_sizes is not None:
      raise ValueError("pass either cpu=CpuOptions(...) or cpu_dot_library / compact_sizes")
    return cpu


def default_dot_library(slots: int) -> str:
  """The CPU dot library the generate step uses before (or without) tuning."""
  return "ynnpack" if slots >= CPU_GENERATE_YNN_MIN_SLOTS else "eigen"


def generate_compiler_options(platform: str, slots: int, library: str | None = None
                              ) -> dict | None:
  """XLA compiler options for a generate step over `slots` slots on `platform`. On CPU,
  `library` ("ynnpack" or "eigen"; None = default_dot_library(slots)) picks the dot library;
  other platforms keep the defaults."""
  if platform != "cpu":
    return None
  library = library or default_dot_library(slots)
  if library not in CPU_DOT_LIBRARIES:
    raise ValueError(f"CPU dot library must be one of {CPU_DOT_LIBRARIES}, got {library!r}")
  return CPU_GENERATE_COMPILER_OPTIONS if library == "eigen" else None


class GenerateStep:
  """An engine's jitted generate step, one program per CPU dot library compiled so far: `fn` is
  the one in use, `library` its dot library (None off CPU), `tuning` what `tune` measured."""

  def __init__(self, jit_with: Callable[[dict | None], Any], platform: str, slots: int,
               dot_library: str):
    self._jit_with = jit_with   # compiler options -> the jitted step
    self._jits: dict[str | None, Any] = {}
    self.platform, self.slots = platform, slots
    self.tunable = platform == "cpu" and dot_library == "auto"
    self.library = None if platform != "cpu" else (
        default_dot_library(slots) if dot_library == "auto" else dot_library)
    self.fn = self.jit(self.library)
    self.tuning: dict | None = None

  def jit(self, library: str | None):
    """The step compiled with dot library `library`."""
    if library not in self._jits:
      self._jits[library] = self._jit_with(
          generate_compiler_options(self.platform, self.slots, library))
    return self._jits[library]

  def cache_size(self) -> int:
    """Programs compiled over every dot library."""
    return sum(f._cache_size() for f in self._jits.values())

  def tune(self, params, scratch_state: Callable[[], Any], window: int, rounds: int = 3,
           steps: int = 2) -> dict | None:
    """Times the step with each CPU dot library and keeps the faster one (only when tunable;
    returns None otherwise). Both programs run on scratch_state() (every slot active),
    alternating, `rounds` times `steps` steps each after one warm-up step; the choice is the
    lower median. Returns and keeps {"chosen", "step_ms": {library: median ms}}."""
    if not self.tunable:
      return None
    jits = {lib: self.jit(lib) for lib in CPU_DOT_LIBRARIES}
    state = scratch_state()
    times: dict[str, list[float]] = {lib: [] for lib in jits}
    for lib, f in jits.items():  # compile and warm up
      state, res = f(params, state, window)
      jax.block_until_ready(res)
    for r in range(rounds):
      for lib in (CPU_DOT_LIBRARIES if r % 2 == 0 else CPU_DOT_LIBRARIES[::-1]):
        t0 = time.perf_counter()
        for _ in range(steps):
          state, res = jits[lib](params, state, window)
        jax.block_until_ready(res)
        times[lib].append((time.perf_counter() - t0) / steps * 1e3)
    med = {lib: float(np.median(t)) for lib, t in times.items()}
    best = min(med, key=med.get)
    self.library, self.fn = best, jits[best]
    self.tuning = {"chosen": best, "step_ms": med}
    log.info("generate step on CPU, %d slots: %s; %s chosen", self.slots,
             ", ".join(f"{k} {v:.1f} ms" for k, v in med.items()), best)
    return self.tuning


def tune_generate(engine, params, rounds: int = 3, steps: int = 2) -> dict | None:
  """Times `engine`'s generate step with each CPU dot library and keeps the faster one (CPU only,
  and only with dot library "auto"; returns None otherwise), at the full window on a scratch
  state with every slot active (GenerateStep.tune). `params` as returned by load_params."""
  slots = engine.max_concurrent_decodes
  return engine.generate_step.tune(
      params, lambda: engine.set_active(engine.init_decode_state(), np.ones((slots,), bool)),
      engine.cache_length, rounds, steps)


def tune_engine(engine, params) -> dict | None:
  """tune_generate for `engine` and each of its compact (drain) engines; returns the engine's
  tuning. Compiles both step programs of each engine, and nothing else."""
  out = tune_generate(engine, params)
  for n in engine.compact_sizes:
    tune_generate(engine.compact_engine(n), params)
  return out
