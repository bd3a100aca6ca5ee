"""What XLA:CPU needs that the accelerators do not, in one place. Each piece is here because a
benchmark measured it at 1.2x or more on the CPU path (BENCHMARKS.md); off CPU the callers use
jax's own (sampling.py) or the defaults.

1. The sampler's primitives (sampling.sample picks them on CPU, by lax.platform_dependent):
   - `truncate`: top-k / top-p thresholds by bisection over the logits' values, in blocks of
     rows, instead of a sort of the vocabulary (bench/sampling.py: 5-59x at V = 49,152);
   - `draw`: inverse CDF over blocks of probabilities with one uniform per row, instead of
     Gumbel-max's V random numbers (13x);
   - `argmax`: two plain reductions over blocks, instead of XLA:CPU's (value, index) pair
     reduction.
2. The generate step's dot library (CpuOptions, GenerateStep, tune_engine). The decode step's
   matmuls are [slots, D] x [D, F]: matrix-vector-like products that stream the weights, plus
   small batched attention products over the KV cache. On XLA:CPU they run either through
   YNNPACK (XLA's default dot fusion) or through XLA's own emitter / Eigen (YNNPACK turned off),
   and which one is faster depends on the host CPU, not only on the shapes (docs/design_notes.md):
   on one host Eigen was faster below 32 slots and YNNPACK from 32 on; on another, with AVX-512,
   YNNPACK was faster at every slot count. So with dot_library="auto" (the default) tune_engine
   (run by Engine.precompile, and by a run's generators with engine.tune) compiles the step both
   ways and keeps the faster (GenerateStep.tune; a paged engine's with its slots holding pages,
   tuning_state); until then, and with a fixed choice,
   generate_compiler_options' slot-count rule applies. Only the generate step is affected;
   prefill's [N * bucket, D] matmuls keep the defaults. Off CPU the dot library is ignored.
3. Thresholds: drain compaction's sizes (CpuOptions.compact_sizes; compaction.py: a step costs
   about the same however many slots are active on XLA:CPU, so the drain runs on fewer slots)
   and the cache length from which engine.kv_cache="auto" pages on CPU (PAGED_MIN_POSITIONS_CPU).
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from magistral_jax.generate.paging import LoopPages

log = logging.getLogger(__name__)
Array = jax.Array

# engine.kv_cache="auto" on CPU: the shortest cache (prompt + completion positions) paged; a
# shorter one costs a CPU step less dense (BENCHMARKS.md, "Paged KV cache", has both ends, not
# the crossover).
PAGED_MIN_POSITIONS_CPU = 2048


# ---- 1. the sampler's primitives --------------------------------------------------------------

def _order_keys(x: Array) -> Array:
  """int32 keys that sort like the float32 values x (-0.0 just below +0.0; no NaN expected)."""
  i = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
  return jnp.where(i < 0, i ^ jnp.int32(0x7FFFFFFF), i)


def _from_order_keys(k: Array) -> Array:
  return jax.lax.bitcast_convert_type(jnp.where(k < 0, k ^ jnp.int32(0x7FFFFFFF), k), jnp.float32)


def _smallest_value_where(lg: Array, below: Callable[[Array], Array]) -> Array:
  """Per row of lg [..., V]: the smallest value t of the row such that below(t) holds, for a
  predicate below(t [..., 1]) -> bool [...] that is monotone (once true, true for every larger
  t) and only changes at values of the row. Found by bisection over the float32 order (at most
  32 rounds of one [..., V] pass each) instead of a sort; returns [..., 1]."""
  lo = _order_keys(jnp.min(lg, axis=-1, keepdims=True))
  hi = _order_keys(jnp.max(lg, axis=-1, keepdims=True))

  def body(_, bounds):
    lo, hi = bounds
    mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)   # floor((lo + hi) / 2) without overflow
    ok = below(_from_order_keys(mid))[..., None]
    return jnp.where(ok, lo, mid + 1), jnp.where(ok, mid, hi)

  _, hi = jax.lax.fori_loop(0, 32, body, (lo, hi))
  return _from_order_keys(hi)


TRUNCATE_BLOCK_ROWS = 8
# Up to this k the k-th largest logit comes from lax.top_k (a partial selection, faster than
# bisection for a small k and slower for a large one on CPU: docs/design_notes.md); above it, by
# bisection. Either way every token tied with the k-th value is kept.
TOP_K_SELECT_MAX = 256


def truncate(lg: Array, top_k: int, top_p: float) -> Array:
  """Masks (to -inf) the tokens outside the top-k and outside the top-p nucleus.

  top-k keeps every token whose logit is >= the k-th largest (ties at the k-th value are all
  kept). top-p then keeps the smallest set of most likely tokens whose mass reaches top_p: a
  token is kept while the mass of the tokens strictly more likely than it is < top_p (so the
  most likely token always is, and tied tokens go together), with the probabilities
  renormalised over the top-k set when top_k is on (over the k selected values for
  k <= TOP_K_SELECT_MAX, so a tie at the k-th value counts once per selected copy there).

  Without a small top-k, the nucleus edge (and the k-th value for k > TOP_K_SELECT_MAX) is found
  by bisection over the logits' values (_smallest_value_where), not by sorting the vocabulary:
  at V = 49152 and 16 rows a full sort cost more than the rest of a SmolLM2 decode step on CPU.
  Only the mass sums differ from a sort-based nucleus (a masked sum instead of a sorted cumsum),
  so a token whose preceding mass lies within float32 rounding of top_p may fall on the other
  side."""
  if top_k == 0 and top_p >= 1.0:
    return lg
  v = lg.shape[-1]
  rows = math.prod(lg.shape[:-1])
  if rows > 2 * TRUNCATE_BLOCK_ROWS and rows % TRUNCATE_BLOCK_ROWS == 0:
    # Blocks of rows, one after another, so each block's logits and probabilities stay in cache
    # across the bisection's passes (faster on CPU: docs/design_notes.md).
    blocks = lg.reshape(rows // TRUNCATE_BLOCK_ROWS, TRUNCATE_BLOCK_ROWS, v)
    return jax.lax.map(lambda b: _truncate_rows(b, top_k, top_p), blocks).reshape(lg.shape)
  return _truncate_rows(lg, top_k, top_p)


def _truncate_rows(lg: Array, top_k: int, top_p: float) -> Array:
  v = lg.shape[-1]
  if 0 < top_k <= min(TOP_K_SELECT_MAX, v - 1):
    # XLA's partial top-k selection is cheaper for a small k; the nucleus then needs only the k
    # selected values (sorted: a cumsum gives the mass before each). (jnp.min, not the last
    # element: a slice of lax.top_k's output made XLA:CPU sort the whole row.)
    vals = jax.lax.top_k(lg, top_k)[0]
    edge = jnp.min(vals, axis=-1, keepdims=True)
    if top_p < 1.0:
      probs = jax.nn.softmax(vals, axis=-1)
      before = jnp.cumsum(probs, axis=-1) - probs
      edge = jnp.min(jnp.where(before < top_p, vals, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(lg >= edge, lg, -jnp.inf)
  if 0 < top_k < v:   # the k-th value: the smallest value with fewer than k logits above it
    kth = _smallest_value_where(lg, lambda t: jnp.sum(lg > t, axis=-1) < top_k)
    lg = jnp.where(lg >= kth, lg, -jnp.inf)
  if top_p < 1.0:
    probs = jax.nn.softmax(lg, axis=-1)
    # The smallest kept logit: the smallest value with less than top_p of mass strictly above.
    edge = _smallest_value_where(
        lg, lambda t: jnp.sum(jnp.where(lg > t, probs, 0.0), axis=-1) < top_p)
    lg = jnp.where(lg >= edge, lg, -jnp.inf)
  return lg


ARGMAX_BLOCK = 1024


def argmax(lg: Array) -> Array:
  """jnp.argmax(lg, -1) for lg [B, V] (the first index of the row's largest value), as two small
  reductions: the largest value of each block of ARGMAX_BLOCK logits, the first block holding
  the row's largest, then the argmax inside that block. XLA:CPU lowers a flat argmax over V to a
  (value, index) pair reduction, many times slower than these two plain reductions and a
  noticeable share of a small model's greedy decode step (docs/design_notes.md). Blocks
  past V are padded with -inf, which the flat argmax of a row that is all -inf also never picks
  over index 0. A row holding a NaN gets some index in [0, V), not necessarily jnp.argmax's
  (XLA:CPU's block max may skip the NaN); its log-prob is NaN, which the decode step's and the
  loop's finiteness checks stop on. Returns int32 [B]."""
  b, v = lg.shape
  if v <= ARGMAX_BLOCK:
    return jnp.argmax(lg, axis=-1).astype(jnp.int32)
  nb = -(-v // ARGMAX_BLOCK)
  if nb * ARGMAX_BLOCK != v:
    lg = jnp.pad(lg, ((0, 0), (0, nb * ARGMAX_BLOCK - v)), constant_values=-jnp.inf)
  blocks = lg.reshape(b, nb, ARGMAX_BLOCK)
  blk = jnp.argmax(jnp.max(blocks, axis=-1), axis=-1)
  inner = jnp.take_along_axis(blocks, blk[:, None, None], axis=1)[:, 0]
  return jnp.minimum(blk * ARGMAX_BLOCK + jnp.argmax(inner, axis=-1), v - 1).astype(jnp.int32)


DRAW_BLOCK = 256


def draw(keys: Array, lg: Array) -> Array:
  """One token per row of lg [B, V] (fp32 logits, -inf = excluded) from softmax(lg), by inverse
  CDF with one uniform per row: u * total falls in one block of DRAW_BLOCK probabilities (found
  from the cumulative block sums) and then on one token of that block (from the block's own
  cumulative sums). An exact categorical draw up to the fp32 rounding of those partial sums, and
  a token of probability 0 is never drawn. jax.random.categorical (Gumbel-max) draws V random
  numbers per row instead, an order of magnitude slower on CPU at SmolLM2's V
  (docs/design_notes.md). keys: [B] typed PRNG keys. Returns int32 [B]."""
  b, v = lg.shape
  nb = -(-v // DRAW_BLOCK)
  p = jax.nn.softmax(lg, axis=-1)
  if nb * DRAW_BLOCK != v:
    p = jnp.pad(p, ((0, 0), (0, nb * DRAW_BLOCK - v)))
  p = p.reshape(b, nb, DRAW_BLOCK)
  cum_blocks = jnp.cumsum(p.sum(-1), axis=-1)                            # [B, nb], inclusive
  target = jax.vmap(lambda k: jax.random.uniform(k, ()))(keys) * cum_blocks[:, -1]
  blk = jnp.minimum(jnp.sum(cum_blocks <= target[:, None], axis=-1), nb - 1)
  before = jnp.take_along_axis(cum_blocks, jnp.maximum(blk - 1, 0)[:, None], axis=-1)[:, 0]
  before = jnp.where(blk > 0, before, 0.0)
  inner = jnp.take_along_axis(p, blk[:, None, None], axis=1)[:, 0]      # [B, DRAW_BLOCK]
  idx = jnp.sum(jnp.cumsum(inner, axis=-1) <= (target - before)[:, None], axis=-1)
  # Rounding can put the target past the block's own sum: take its last nonzero token then.
  last = DRAW_BLOCK - 1 - jnp.argmax((inner > 0)[:, ::-1], axis=-1)
  return (blk * DRAW_BLOCK + jnp.minimum(idx, last)).astype(jnp.int32)


# ---- 2. the generate step's dot library ----------------------------------------------------------


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

  def tune(self, params, scratch_state: Callable[[int], Any], window: int, rounds: int = 3,
           steps: int = 2) -> dict | None:
    """Times the step with each CPU dot library and keeps the faster one (only when tunable;
    returns None otherwise). Both programs run on scratch_state(n) (every slot active; n: the
    steps run on it), alternating, `rounds` times `steps` steps each after one warm-up step; the
    choice is the lower median. Returns and keeps {"chosen", "step_ms": {library: median ms}}."""
    if not self.tunable:
      return None
    jits = {lib: self.jit(lib) for lib in CPU_DOT_LIBRARIES}
    state = scratch_state(len(jits) * (1 + rounds * steps))
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
  state with every slot active (GenerateStep.tune, on tuning_state). `params` as returned by
  load_params."""
  return engine.generate_step.tune(params, lambda n: tuning_state(engine, n), engine.cache_length,
                                   rounds, steps)


def tuning_state(engine, steps: int):
  """A scratch decode state to time `steps` generate steps on: every slot active. A dense step
  reads every slot's whole cache whatever it holds; a paged one reads what its slots hold, so
  here each slot holds an equal share of its pool's pages (the KV memory the engine was given),
  up to the cache length, less `steps`: the timing then counts the attention over them, which
  the dot library also computes (at no live position the weights alone would decide, and the
  library faster for them alone can be the slower for a run's steps)."""
  slots = engine.max_concurrent_decodes
  state = engine.set_active(engine.init_decode_state(), np.ones((slots,), bool))
  if engine.kv_pages is None:
    return state
  pages = LoopPages(engine, engine.set_pages)
  per_replica = slots // engine.page_replicas
  share = min(engine.cache_length, (engine.kv_pages - 1) // per_replica * engine.page_size)
  for slot in range(slots):
    pages.hold(slot, share)
  state = pages.sync(state)
  lengths = np.full((slots,), max(0, share - steps - 1), np.int32)
  return state._replace(cache=state.cache._replace(
      lengths=jax.device_put(lengths, state.cache.lengths.sharding)))


def tune_engine(engine, params) -> dict | None:
  """tune_generate for `engine` and each of its compact (drain) engines; returns the engine's
  tuning. Compiles both step programs of each engine, and nothing else."""
  out = tune_generate(engine, params)
  for n in engine.compact_sizes:
    tune_generate(engine.compact_engine(n), params)
  return out
