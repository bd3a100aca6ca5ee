"""The generation engine: JetStream's Engine contract, written natively in JAX.

JetStream splits serving into
  prefill(params, padded_tokens, true_length) -> prefix   (KV cache of one prompt + first token)
  insert(prefix, decode_state, slot)          -> decode_state
  generate(params, decode_state)              -> (decode_state, result tokens)
over a fixed number of decode slots (`max_concurrent_decodes`); `prefill(..., existing_prefix=
prefix)` continues a cached prefix (JetStream's prefix caching: GeneratorLoop's shared_prefix
prefills an RL run's system prompt once per weights version). We keep that contract (so the
optional adapter in jetstream_adapter.py can hand this engine to the real orchestrator) and add
what RL needs: every token comes with its fp32 log-prob under the sampling policy (sampling.py
says which distribution), per-slot PRNG streams, and `resample` so the G samples of a GRPO group
share one prefill.

Batched refill (what GeneratorLoop uses; the contract methods above stay available):
  prefill_many(params, padded [N, bucket], true_lengths [N])  -> Prefixes (N prompt caches)
  insert_many(prefixes, decode_state, slots, rows, keys, ...)  -> decode_state, first tokens
prefill N prompts of one length bucket in one call, and copy them into any number of slots in one
call (several slots may share a row: the G samples of a GRPO group), each slot drawing its first
token from the row's last-position logits with its own PRNG stream.

Compilation: `generate` is one jitted program with fixed shapes, fixed in/out shardings and the
decode state donated, so new weights of the same shapes/shardings never recompile it (one program
per attention window when `attention_windows` > 1: a step attends over the first W cache positions
only, W the smallest window holding every active slot; `precompile` compiles them all). `prefill`
and `insert` compile once per prefill length bucket; `prefill_many` and `insert_many` once per
(bucket, batch size) with batch sizes drawn from the bounded set `prefill_batch_sizes` (powers of
two up to max_prefill_batch), so the number of programs stays small and fixed.

Placement: the engine lives on its own mesh (any subset of devices) with its own rules (default
GENERATOR_RULES: tensor parallel, full weights per tensor-parallel group); `load_params` reshards
whatever it is given (e.g. the trainer's FSDP layout) onto that mesh.

Weights layout: `load_params` returns the params in the model's decode layout
(transformer.to_decode_layout: one array per layer, so a decode step reads each weight once
instead of copying it out of the layer stack first); it accepts stacked or decode-layout params.
Every KV cache the engine holds (decode state, prefixes) is per layer for the same reason
(T.init_cache(per_layer=True): per layer, keys [B, K, Dh, S] and values [B, K, S, Dh]; a layer
of a stacked cache is copied out of the stack every step on XLA:CPU, which made the step grow ~3x
faster with the cache length than the attention itself does).
On the CPU backend the generate step's dot library (YNNPACK or XLA's Eigen path) is picked by timing
both (tune_generate, run by precompile) or, untuned, by the slot-count rule of
generate_compiler_options.
"""
from __future__ import annotations

import bisect
import logging
import time
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from magistral_jax.generate import sampling as S
from magistral_jax.model import transformer as T
from magistral_jax.model.config import ModelConfig
from magistral_jax.parallel.sharding import (GENERATOR_RULES, ShardingCtx, is_logical_axes,
                                             param_shardings)

Array = jax.Array
log = logging.getLogger(__name__)


# The decode step's matmuls are [slots, D] x [D, F]: matrix-vector-like products that stream the
# weights, plus small batched attention products over the KV cache. On XLA:CPU they run either
# through YNNPACK (XLA's default dot fusion) or through XLA's own emitter / Eigen (YNNPACK turned
# off). Which one is faster depends on the host CPU, not only on the shapes:
# - one 2-core host (session 6/9 probes, medians of interleaved rounds): Eigen faster below 32
#   slots (SmolLM2-135M step, batch 8 117 -> 99 ms, batch 16 208 -> 168 ms), YNNPACK from 32 on
#   (1.04-1.11x at 32-64 slots);
# - another 2-core host, with AVX-512 (2026-11-22, the same interleaved A/B of the engine's step):
#   YNNPACK faster at every slot count (Eigen / YNNPACK step time 2.3x at 4 slots, 1.24x at 8,
#   1.14x at 16, 1.3x at 32).
# So the engine measures: with cpu_dot_library="auto" (the default), `tune_generate` (run by
# `precompile`) compiles the step both ways and keeps the faster; until then, and with a fixed
# choice, generate_compiler_options' slot-count rule applies. Only the generate step is
# affected; prefill's [N * bucket, D] matmuls keep the defaults.
CPU_GENERATE_COMPILER_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": ""}
CPU_GENERATE_YNN_MIN_SLOTS = 32
CPU_DOT_LIBRARIES = ("ynnpack", "eigen")


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


class ParamsMismatchError(ValueError):
  """New params whose tree structure or shapes differ from the engine's."""


class NonFiniteError(FloatingPointError):
  """NaN/Inf in params or in the logits of an active slot."""


def _put_rows(a: Array, idx: Array, x: Array) -> Array:
  """a[idx[j]] = x[j] along axis 0; out-of-range indices (the padding convention: index = number
  of slots) are dropped."""
  return a.at[idx].set(x.astype(a.dtype), mode="drop")


def _put_slot(layer_cache: Array, row: Array, slot) -> Array:
  """One layer's keys [slots, K, Dh, S] or values [slots, K, S, Dh] with a prompt's cache row
  ([1, K, Dh, bucket] or [1, K, bucket, Dh]) written at `slot` (positions 0..bucket-1); in place
  when the cache is donated."""
  return jax.lax.dynamic_update_slice(layer_cache, row.astype(layer_cache.dtype), (slot, 0, 0, 0))


class Prefix(NamedTuple):
  """One prefilled prompt. cache: per-layer KVCache with batch 1 and the bucket's length;
  logits: [V] fp32 at the last prompt position (kept so group members can draw their own first
  token); token/logprob: the first sampled token; key: the slot's PRNG stream; true_length: prompt
  tokens in the cache."""
  cache: T.KVCache
  logits: Array
  token: Array
  logprob: Array
  key: Array
  true_length: Array


class Prefixes(NamedTuple):
  """N prefilled prompts of one bucket (from prefill_many). cache: per-layer KVCache,
  L x [N, K, Dh, bucket] keys and [N, K, bucket, Dh] values (lengths = true lengths); logits:
  [N, V] fp32 at each prompt's last position; true_length [N].
  No token is drawn yet: insert_many draws one per slot, with that slot's stream."""
  cache: T.KVCache
  logits: Array
  true_length: Array


class DecodeState(NamedTuple):
  """All slots. cache: per-layer KVCache, L x [B, K, Dh, S] keys and [B, K, S, Dh] values;
  tokens [B]: the next input token of each slot (sampled, not yet in the cache); keys [B, 2]:
  per-slot PRNG keys; active [B] bool."""
  cache: T.KVCache
  tokens: Array
  keys: Array
  active: Array


class ResultTokens(NamedTuple):
  """One decode step, per slot: the sampled token, its log-prob, whether the slot was active
  (valid), the slot's sequence length in the cache, and whether its logits were all finite."""
  tokens: Array
  logprobs: Array
  valid: Array
  lengths: Array
  finite: Array


def default_windows(cache_length: int, n: int, multiple: int = 16) -> tuple[int, ...]:
  """n attention windows that halve from the whole cache down: S, S/2, ..., S/2^(n-1) (rounded
  up to `multiple` positions). n = 1: dense attention over the whole cache every step. Halving,
  not even spacing: on XLA:CPU a window's slice of the cache is copied before the products, so a
  window near the cache length can cost more than the dense step (measured: 1536 of 2048
  positions 0.81x the dense step's speed, 1024 1.19x, 512 1.76x; BENCHMARKS.md)."""
  if n < 1:
    raise ValueError(f"the number of attention windows must be >= 1, got {n}")
  ws = {min(cache_length, -(-cache_length // 2 ** i // multiple) * multiple) for i in range(n)}
  return tuple(sorted(ws))


def default_buckets(max_prefill_length: int, smallest: int = 16) -> tuple[int, ...]:
  """Powers of two from `smallest` up to max_prefill_length (always included)."""
  out, b = [], smallest
  while b < max_prefill_length:
    out.append(b)
    b *= 2
  out.append(max_prefill_length)
  return tuple(out)


class Engine:
  """Slots, a KV cache and three jitted programs (prefill / insert / generate) on one mesh."""

  def __init__(self, cfg: ModelConfig, mesh: Mesh, rules=GENERATOR_RULES, *,
               max_concurrent_decodes: int, max_prefill_length: int, max_decode_length: int,
               sampling: S.SamplingConfig = S.SamplingConfig(),
               prefill_buckets: Sequence[int] | None = None, cache_dtype=None,
               truncate_prompts: bool = False, max_prefill_batch: int | None = None,
               cpu_dot_library: str = "auto", compact_sizes: Sequence[int] | None = None,
               attention_windows: Sequence[int] | int | None = None):
    if max_concurrent_decodes < 1 or max_prefill_length < 1 or max_decode_length < 1:
      raise ValueError("max_concurrent_decodes, max_prefill_length and max_decode_length must be "
                       f">= 1, got {max_concurrent_decodes}, {max_prefill_length}, "
                       f"{max_decode_length}")
    self.cfg, self.mesh, self.rules = cfg, mesh, tuple(rules)
    self.sampling = sampling
    self._slots = int(max_concurrent_decodes)
    self._max_prefill = int(max_prefill_length)
    self._max_decode = int(max_decode_length)
    self.cache_length = self._max_prefill + self._max_decode
    self.cache_dtype = jnp.dtype(cache_dtype or cfg.dtype)
    self.truncate_prompts = truncate_prompts
    buckets = sorted(set(prefill_buckets or default_buckets(self._max_prefill)))
    if buckets[-1] < self._max_prefill:
      buckets.append(self._max_prefill)
    if buckets[0] < 1 or buckets[-1] > self._max_prefill:
      raise ValueError(f"prefill_buckets {buckets} must lie in [1, max_prefill_length="
                       f"{self._max_prefill}]")
    self.prefill_buckets = tuple(buckets)
    # Attention windows (see `window_for`): a generate step attends over the first W cache
    # positions, W the smallest window holding every active slot; one program per window.
    if attention_windows is None or isinstance(attention_windows, (int, np.integer)):
      windows = default_windows(self.cache_length, int(attention_windows or 1))
    else:
      windows = sorted({int(w) for w in attention_windows} | {self.cache_length})
      if windows[0] < 1 or windows[-1] > self.cache_length:
        raise ValueError(f"attention_windows {list(attention_windows)} must lie in [1, "
                         f"cache length {self.cache_length}]")
    self.attention_windows = tuple(windows)
    # Batched prefill: up to max_prefill_batch prompts per call (default: min(slots, 8), which
    # bounds the activation memory of one call to 8 prompts), in power-of-two batch sizes.
    mpb = min(self._slots, 8) if max_prefill_batch is None else int(max_prefill_batch)
    if mpb < 1:
      raise ValueError(f"max_prefill_batch must be >= 1, got {mpb}")
    sizes, n = [], 1
    while n < mpb:
      sizes.append(n)
      n *= 2
    self.prefill_batch_sizes = tuple(sizes + [mpb])
    # KV recompute (the ablation) re-prefills whole sequences, so it needs buckets up to S.
    self.recompute_buckets = self.prefill_buckets + tuple(
        b for b in default_buckets(self.cache_length, 2 * self._max_prefill)
        if b > self._max_prefill)
    self.shard = ShardingCtx(mesh, self.rules)

    shapes = T.param_shapes(cfg)
    self._param_shapes = shapes
    axes = T.param_logical_axes(cfg)
    # param_shardings: the stacked layout (what a trainer pushes, resharded onto this mesh);
    # decode_param_shardings: the layout the programs below take (see the module docstring).
    self.param_shardings = param_shardings(axes, mesh, self.rules, shapes)
    self._treedef = jax.tree.structure(shapes)
    self._decode_param_shapes = T.decode_layout_tree(shapes, cfg.num_layers)
    self.decode_param_shardings = param_shardings(
        T.decode_layout_tree(axes, cfg.num_layers), mesh, self.rules, self._decode_param_shapes)
    self._decode_treedef = jax.tree.structure(self._decode_param_shapes)
    rep = NamedSharding(mesh, P())
    state_shapes = jax.eval_shape(self._init_state)
    cax = T.cache_logical_axes(per_layer=cfg.num_layers)
    cache_sh = jax.tree.map(lambda ax, s: self.shard.sharding(ax, s.shape), cax,
                            state_shapes.cache, is_leaf=is_logical_axes)
    batch = self.shard.sharding(("cache_batch",), (self._slots,))
    self.state_shardings = DecodeState(cache_sh, batch, self.shard.sharding(
        ("cache_batch", None), (self._slots, 2)), batch)
    result_sh = ResultTokens(*([rep] * 5))

    # The generate step: one jitted program per CPU dot library (see generate_compiler_options);
    # `_generate` is the one in use.
    self.platform = mesh.devices.flat[0].platform
    if cpu_dot_library not in ("auto",) + CPU_DOT_LIBRARIES:
      raise ValueError(f"cpu_dot_library must be 'auto' or one of {CPU_DOT_LIBRARIES}, got "
                       f"{cpu_dot_library!r}")
    self.cpu_dot_library = cpu_dot_library
    self._result_sh = result_sh
    self._generate_jits: dict[str | None, Any] = {}
    self.generate_library = None if self.platform != "cpu" else (
        default_dot_library(self._slots) if cpu_dot_library == "auto" else cpu_dot_library)
    self._generate = self._generate_jit(self.generate_library)
    self.generate_tuning: dict | None = None
    # Compaction (see `compact`): smaller slot counts the active slots can be gathered into when
    # few are left. Default: half and a quarter of the slots; each must divide evenly over the
    # mesh axes that shard the slots.
    self._engine_kw = dict(rules=rules, max_prefill_length=max_prefill_length,
                           max_decode_length=max_decode_length, sampling=sampling,
                           prefill_buckets=prefill_buckets, cache_dtype=cache_dtype,
                           truncate_prompts=truncate_prompts, max_prefill_batch=max_prefill_batch,
                           cpu_dot_library=cpu_dot_library, compact_sizes=(),
                           attention_windows=self.attention_windows)
    if compact_sizes is None:
      compact_sizes = [n for n in (self._slots // 2, self._slots // 4) if n >= 1]
    shards = self._slots // batch.shard_shape((self._slots,))[0]   # slot shards over the mesh
    sizes = sorted({int(n) for n in compact_sizes}, reverse=True)
    for n in sizes:
      if not 1 <= n < self._slots:
        raise ValueError(f"compact_sizes {list(compact_sizes)} must lie in [1, "
                         f"{self._slots - 1}]")
    self.compact_sizes = tuple(n for n in sizes if n % shards == 0)
    self._children: dict[int, Engine] = {}
    self._gathers: dict[int, Any] = {}
    self._scatter = jax.jit(self._scatter_impl, out_shardings=self.state_shardings,
                            donate_argnums=(0,))
    self._prefill = jax.jit(self._prefill_impl, out_shardings=None)
    self._insert = jax.jit(self._insert_impl, out_shardings=self.state_shardings,
                           donate_argnums=(1,), static_argnames=("cache_only",))
    self._resample = jax.jit(self._resample_impl)
    self._init = jax.jit(self._init_state, out_shardings=self.state_shardings)
    self._prefill_many = jax.jit(self._prefill_many_impl)
    self._insert_many = jax.jit(self._insert_many_impl,
                                out_shardings=(self.state_shardings, rep, rep),
                                donate_argnums=(1,))
    self._set_active = jax.jit(lambda st, a: st._replace(active=a),
                               out_shardings=self.state_shardings, donate_argnums=(0,))
    all_finite = lambda tree: jnp.all(jnp.stack([jnp.all(jnp.isfinite(x))
                                                 for x in jax.tree.leaves(tree)]))
    self._all_finite = jax.jit(all_finite)
    # Stacked -> decode layout and the finiteness check in one program (one read of the weights).
    self._to_decode = jax.jit(lambda p: (T.to_decode_layout(p), all_finite(p)),
                              out_shardings=(self.decode_param_shardings, rep))

  # ---- JetStream Engine properties -----------------------------------------------------------
  @property
  def max_concurrent_decodes(self) -> int:
    return self._slots

  @property
  def max_prefill_length(self) -> int:
    return self._max_prefill

  @property
  def max_decode_length(self) -> int:
    return self._max_decode

  @property
  def samples_per_slot(self) -> int:
    return 1

  def compile_counts(self) -> dict[str, int]:
    """How many programs each jitted entry point has compiled (for no-recompile checks);
    "generate" counts the programs of every dot library compiled so far (two after tuning)."""
    counts = {name: getattr(self, f"_{name}")._cache_size()
              for name in ("prefill", "insert", "resample", "set_active", "prefill_many",
                           "insert_many")}
    counts["generate"] = sum(f._cache_size() for f in self._generate_jits.values())
    # Compaction: the smaller engines' generate / set_active programs, gathers and the scatter.
    children = [c.compile_counts() for c in self._children.values()]
    counts["compact"] = (self._scatter._cache_size()
                         + sum(f._cache_size() for f in self._gathers.values())
                         + sum(c["generate"] + c["set_active"] for c in children))
    return counts

  def _generate_jit(self, library: str | None):
    if library not in self._generate_jits:
      # The attention window (argument 2) is static: one program per window.
      self._generate_jits[library] = jax.jit(
          self._generate_impl,
          in_shardings=(self.decode_param_shardings, self.state_shardings),
          out_shardings=(self.state_shardings, self._result_sh), donate_argnums=(1,),
          static_argnums=(2,),
          compiler_options=generate_compiler_options(self.platform, self._slots, library))
    return self._generate_jits[library]

  def tune_generate(self, params, rounds: int = 3, steps: int = 2) -> dict | None:
    """Times the generate step with each CPU dot library and keeps the faster one (CPU only,
    and only with cpu_dot_library="auto"; returns None otherwise). Both programs run on a
    scratch decode state with every slot active, alternating, `rounds` times `steps` steps each
    after one warm-up step; the choice is the lower median. Returns and keeps (as
    `generate_tuning`) {"chosen", "step_ms": {library: median ms}}. `params` as returned by
    load_params."""
    if self.platform != "cpu" or self.cpu_dot_library != "auto":
      return None
    jits = {lib: self._generate_jit(lib) for lib in CPU_DOT_LIBRARIES}
    state = self.set_active(self.init_decode_state(), np.ones((self._slots,), bool))
    times: dict[str, list[float]] = {lib: [] for lib in jits}
    w = self.cache_length   # timed at the full window
    for lib, f in jits.items():  # compile and warm up
      state, res = f(params, state, w)
      jax.block_until_ready(res)
    for r in range(rounds):
      for lib in (CPU_DOT_LIBRARIES if r % 2 == 0 else CPU_DOT_LIBRARIES[::-1]):
        t0 = time.perf_counter()
        for _ in range(steps):
          state, res = jits[lib](params, state, w)
        jax.block_until_ready(res)
        times[lib].append((time.perf_counter() - t0) / steps * 1e3)
    med = {lib: float(np.median(t)) for lib, t in times.items()}
    best = min(med, key=med.get)
    self.generate_library, self._generate = best, jits[best]
    self.generate_tuning = {"chosen": best, "step_ms": med}
    log.info("generate step on CPU, %d slots: %s; %s chosen", self._slots,
             ", ".join(f"{k} {v:.1f} ms" for k, v in med.items()), best)
    return self.generate_tuning

  def tune(self, params) -> dict | None:
    """tune_generate for this engine and for each of its compact (drain) engines; returns this
    engine's tuning (None off CPU or with a fixed cpu_dot_library). Compiles both step programs
    of each engine, and nothing else."""
    out = self.tune_generate(params)
    for n in self.compact_sizes:
      self.compact_engine(n).tune_generate(params)
    return out

  # ---- params --------------------------------------------------------------------------------
  def check_params(self, params) -> None:
    """Raises ParamsMismatchError unless `params` has the engine's tree structure and shapes
    (stacked, or in the decode layout)."""
    treedef = jax.tree.structure(params)
    if treedef == self._decode_treedef:
      ref_shapes = self._decode_param_shapes
    elif treedef == self._treedef:
      ref_shapes = self._param_shapes
    else:
      raise ParamsMismatchError(
          f"params tree structure differs from the engine's: got {treedef}, expected "
          f"{self._treedef} (stacked) or its decode layout")
    bad = []
    for (path, x), ref in zip(jax.tree_util.tree_leaves_with_path(params),
                              jax.tree.leaves(ref_shapes)):
      if tuple(np.shape(x)) != tuple(ref.shape):
        bad.append(f"{jax.tree_util.keystr(path)}: {tuple(np.shape(x))} != {tuple(ref.shape)}")
    if bad:
      raise ParamsMismatchError("params shapes differ from the engine's: " + "; ".join(bad))

  def load_params(self, params) -> Any:
    """Validates params (structure, shapes, finiteness) and puts them on the engine's mesh in
    cfg.param_dtype, resharding from whatever sharding they come in, in the decode layout (see
    the module docstring). Stacked params are resharded as they are, then split per layer on
    this mesh, in the same program as the finiteness check."""
    self.check_params(params)
    decode = T.is_decode_layout(params)
    ref = self._decode_param_shapes if decode else self._param_shapes
    params = jax.tree.map(lambda x, r: jnp.asarray(x, r.dtype) if x.dtype != r.dtype else x,
                          params, ref)
    if decode:
      params = jax.device_put(params, self.decode_param_shardings)
      finite = self._all_finite(params)
    else:
      params, finite = self._to_decode(jax.device_put(params, self.param_shardings))
    if not bool(finite):
      raise NonFiniteError("params contain NaN or Inf; refusing to generate with them")
    return params

  # ---- decode state --------------------------------------------------------------------------
  def _init_state(self) -> DecodeState:
    cache = T.init_cache(self.cfg, self._slots, self.cache_length, self.cache_dtype,
                         per_layer=True)
    return DecodeState(cache, jnp.zeros((self._slots,), jnp.int32),
                       jnp.zeros((self._slots, 2), jnp.uint32),
                       jnp.zeros((self._slots,), bool))

  def init_decode_state(self, *args, **kwargs) -> DecodeState:
    del args, kwargs  # JetStream passes an rng; slot keys come with each prefix instead.
    return self._init()

  def precompile(self, params, buckets: Sequence[int] | None = None, tune: bool = True,
                 existing_prefix: Prefix | None = None) -> None:
    """Compiles prefill_many / insert_many for every (bucket, batch size), generate and
    set_active, on a scratch decode state, so a timed or latency-sensitive run compiles nothing
    later; with `tune` (and cpu_dot_library="auto" on CPU) it first picks the generate step's
    dot library by timing both (tune_generate). `params` as returned by load_params. With
    `existing_prefix` (a shared prefix the loop continues: GeneratorLoop shared_prefix) the
    programs that continue it are compiled too, for every bucket the rest of a prompt fits."""
    if tune:
      self.tune(params)
    state = self.init_decode_state()
    buckets = buckets or self.prefill_buckets
    runs = [(b, None) for b in buckets]
    if existing_prefix is not None:   # the buckets a rest of at most max_prefill - P tokens takes
      room = self._max_prefill - int(np.asarray(existing_prefix.true_length))
      runs += [(b, existing_prefix) for b in buckets if 0 < room and b <= self.bucket_for(room)]
    for b, prefix in runs:
      for n in self.prefill_batch_sizes:
        pre = self.prefill_many(params, np.ones((n, b), np.int32), np.ones((n,), np.int32),
                                prefix)
        state, _, _ = self.insert_many(pre, state, [0], [0], np.zeros((1, 2), np.uint32), [0],
                                       np.zeros((self._slots,), bool))
    for w in self.attention_windows:
      state, _ = self.generate(params, state, w)
    state = self.set_active(state, np.zeros((self._slots,), bool))
    for n in self.compact_sizes:  # the drain's programs: gather, smaller step, scatter back
      child = self.compact_engine(n)
      small = self.compact(state, [0], n)
      for w in child.attention_windows:
        small, _ = child.generate(params, small, w)
      small = child.set_active(small, np.zeros((n,), bool))
      state = self.expand(state, small, [0])
    jax.block_until_ready(state)

  # ---- prompts -------------------------------------------------------------------------------
  def bucket_for(self, n: int, buckets: Sequence[int] | None = None) -> int:
    buckets = buckets or self.prefill_buckets
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
      raise ValueError(f"sequence of {n} tokens exceeds the largest bucket {buckets[-1]}")
    return buckets[i]

  def pad_prompt(self, tokens: Sequence[int], buckets: Sequence[int] | None = None,
                 truncate: bool | None = None):
    """Validates a prompt and right-pads it to its bucket: (padded int32 [bucket], true_length,
    truncated). Too long -> ValueError, or with truncate_prompts=True the *last*
    max_prefill_length tokens are kept (the end of a chat prompt is what conditions the answer)
    and truncated=True is reported (`truncate` overrides the engine's setting)."""
    truncate = self.truncate_prompts if truncate is None else truncate
    tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
    if tokens.size == 0:
      raise ValueError("empty prompt: at least one token is needed to condition generation")
    if tokens.min() < 0 or tokens.max() >= self.cfg.vocab_size:
      raise ValueError(f"prompt token ids must lie in [0, {self.cfg.vocab_size}); got "
                       f"min {tokens.min()}, max {tokens.max()}")
    truncated = False
    limit = (buckets or self.prefill_buckets)[-1]
    if tokens.size > limit:
      if not truncate:
        raise ValueError(f"prompt has {tokens.size} tokens, more than max_prefill_length="
                         f"{limit}; shorten it or build the engine with truncate_prompts=True")
      log.warning("truncating a %d-token prompt to its last %d tokens", tokens.size, limit)
      tokens, truncated = tokens[-limit:], True
    b = self.bucket_for(tokens.size, buckets)
    padded = np.zeros((b,), np.int32)
    padded[:tokens.size] = tokens
    return padded, int(tokens.size), truncated

  # ---- prefill / insert / generate -----------------------------------------------------------
  def _start_cache(self, n: int, b: int, prefix_cache=None, prefix_length=None) -> T.KVCache:
    """The per-layer cache a prefill of n prompts padded to b tokens writes into: empty, of
    length b; or, continuing an existing prefix (one prompt's cache, positions [0, P) real of
    its Pp), that prefix copied into every row, lengths P, and room for b more positions
    (length min(Pp + b, cache_length): positions past it are padding, whose writes drop)."""
    if prefix_cache is None:
      return T.init_cache(self.cfg, n, b, self.cache_dtype, per_layer=True)
    pp = prefix_cache.v[0].shape[2]
    length = min(pp + b, self.cache_length)

    def grow(x, axis):   # [1, ...] -> [n, ...], padded with zeros to `length` positions on axis
      x = jnp.broadcast_to(x.astype(self.cache_dtype), (n,) + x.shape[1:])
      return jnp.pad(x, [(0, length - pp) if a == axis else (0, 0) for a in range(x.ndim)])
    return T.KVCache(tuple(grow(k, 3) for k in prefix_cache.k),
                     tuple(grow(v, 2) for v in prefix_cache.v),
                     jnp.broadcast_to(prefix_length.astype(jnp.int32), (n,)))

  def _prefill_impl(self, params, padded_tokens, true_length, key, prefix_cache=None,
                    prefix_length=None):
    b = padded_tokens.shape[0]
    cache = self._start_cache(1, b, prefix_cache, prefix_length)
    hidden, cache = T.decode(params, self.cfg, padded_tokens[None], cache, self.shard,
                             num_new=true_length[None])
    last = jax.lax.dynamic_index_in_dim(hidden[0], true_length - 1, keepdims=False)
    lg = T.logits(params, self.cfg, last)
    # The whole prompt's length (prefix included) is the position folded into the slot stream,
    # so a prompt continued from a cached prefix draws what its full prefill would.
    full = cache.lengths[0]
    tok, lp = S.sample(lg[None], key[None], full[None], self.sampling)
    return Prefix(cache, lg, tok[0], lp[0], key, full)

  def _check_existing_prefix(self, existing_prefix, longest: int):
    """(cache, true length) of a prefix to continue, validated: one prompt's, and the prompt it
    starts plus `longest` new tokens must fit max_prefill_length."""
    if not isinstance(existing_prefix, (Prefix, Prefixes)):
      raise TypeError(f"existing_prefix must be a Prefix from prefill(), got "
                      f"{type(existing_prefix).__name__}")
    cache = existing_prefix.cache
    n_rows = cache.v[0].shape[0]
    p = np.asarray(existing_prefix.true_length).reshape(-1)
    if n_rows != 1 or p.size != 1:
      raise ValueError(f"existing_prefix must hold one prompt's cache, got {n_rows} rows")
    if len(cache.k) != self.cfg.num_layers or cache.v[0].shape[1:] != (
        self.cfg.num_kv_heads, cache.v[0].shape[2], self.cfg.head_dim):
      raise ValueError("existing_prefix's cache does not match this engine's model")
    if int(p[0]) + longest > self._max_prefill:
      raise ValueError(f"existing prefix of {int(p[0])} tokens + {longest} new tokens exceeds "
                       f"max_prefill_length={self._max_prefill}")
    return cache, jnp.asarray(p[0], jnp.int32)

  def prefill(self, params, padded_tokens, true_length, *, rng=None, existing_prefix=None
              ) -> Prefix:
    """KV cache of one prompt (padded to a bucket) and its first sampled token. `rng` (a
    uint32[2] PRNG key) seeds the slot stream this prefix will carry into `insert`.
    `existing_prefix` (a Prefix from an earlier prefill: JetStream's prefix caching) makes the
    tokens a continuation of that prompt: they are written after its cache, attend to it, and
    the returned Prefix holds the whole prompt (its true_length counts both parts)."""
    padded_tokens = jnp.asarray(padded_tokens, jnp.int32).reshape(-1)
    if not 1 <= int(true_length) <= padded_tokens.shape[0]:
      raise ValueError(f"true_length={int(true_length)} outside [1, {padded_tokens.shape[0]}]")
    key = jax.random.PRNGKey(0) if rng is None else jnp.asarray(rng, jnp.uint32)
    prefix = () if existing_prefix is None else self._check_existing_prefix(
        existing_prefix, int(true_length))
    return self._prefill(params, padded_tokens, jnp.asarray(true_length, jnp.int32), key,
                         *prefix)

  def _resample_impl(self, prefix: Prefix, key):
    tok, lp = S.sample(prefix.logits[None], key[None], prefix.true_length[None], self.sampling)
    return prefix._replace(token=tok[0], logprob=lp[0], key=key)

  def resample(self, prefix: Prefix, rng) -> Prefix:
    """The same prompt cache with a new slot stream and a first token drawn with it: how one
    prefill serves the G samples of a GRPO group."""
    return self._resample(prefix, jnp.asarray(rng, jnp.uint32))

  def _insert_impl(self, prefix: Prefix, state: DecodeState, slot, cache_only=False):
    put = lambda big, row: _put_slot(big, row, slot)
    cache = T.KVCache(tuple(map(put, state.cache.k, prefix.cache.k)),
                      tuple(map(put, state.cache.v, prefix.cache.v)),
                      state.cache.lengths.at[slot].set(prefix.true_length))
    if cache_only:
      return state._replace(cache=cache)
    return DecodeState(cache, state.tokens.at[slot].set(prefix.token),
                       state.keys.at[slot].set(prefix.key), state.active.at[slot].set(True))

  def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int) -> DecodeState:
    """Copies a prefix into `slot` (donating decode_state) and activates it."""
    if not 0 <= int(slot) < self._slots:
      raise ValueError(f"slot {slot} outside [0, {self._slots})")
    return self._insert(prefix, decode_state, jnp.asarray(slot, jnp.int32))

  def refresh_slot(self, params, decode_state: DecodeState, slot: int,
                   sequence: Sequence[int]) -> DecodeState:
    """Recomputes the KV cache of an in-flight slot from its tokens (prompt + generated, except
    the pending input token) under `params`; tokens, keys and activity are kept. Only used by
    the recompute-on-update ablation: the paper keeps the stale cache."""
    padded, n, _ = self.pad_prompt(sequence, self.recompute_buckets)
    prefix = self._prefill(params, jnp.asarray(padded), jnp.asarray(n, jnp.int32),
                           jnp.zeros((2,), jnp.uint32))
    return self._insert(prefix, decode_state, jnp.asarray(slot, jnp.int32), cache_only=True)

  # ---- batched prefill / insert (used by GeneratorLoop) ---------------------------------------
  def _prefill_many_impl(self, params, padded_tokens, true_lengths, prefix_cache=None,
                         prefix_length=None):
    n, b = padded_tokens.shape
    cache = self._start_cache(n, b, prefix_cache, prefix_length)
    hidden, cache = T.decode(params, self.cfg, padded_tokens, cache, self.shard,
                             num_new=true_lengths)
    last = jnp.take_along_axis(hidden, (true_lengths - 1)[:, None, None], axis=1)[:, 0]
    return Prefixes(cache, T.logits(params, self.cfg, last), cache.lengths)

  def split_batch(self, n: int) -> list[int]:
    """Splits n prompts into calls of sizes from prefill_batch_sizes (largest first, no padding
    rows; at most log2(max_prefill_batch) + n // max_prefill_batch calls)."""
    out = []
    for size in sorted(self.prefill_batch_sizes, reverse=True):
      while n >= size:
        out.append(size)
        n -= size
    return out

  def prefill_many(self, params, padded_tokens, true_lengths, existing_prefix=None) -> Prefixes:
    """KV caches and last-position logits of N prompts padded to one bucket, in one call.
    N must be one of prefill_batch_sizes (see split_batch) so compilations stay bounded.
    With `existing_prefix` (a Prefix from `prefill`, e.g. a system prompt every request starts
    with) the N rows are continuations of that one prompt: its cache is copied into every row
    and only the new tokens go through the model (the rows' caches are min(Pp + bucket,
    cache_length) long, Pp the prefix's bucket; true_length counts the prefix)."""
    padded_tokens = np.asarray(padded_tokens, np.int32)
    true_lengths = np.asarray(true_lengths, np.int32).reshape(-1)
    if padded_tokens.ndim != 2 or padded_tokens.shape[0] != true_lengths.shape[0]:
      raise ValueError(f"prefill_many wants padded_tokens [N, bucket] and true_lengths [N], got "
                       f"{padded_tokens.shape} and {true_lengths.shape}")
    n, b = padded_tokens.shape
    if n not in self.prefill_batch_sizes:
      raise ValueError(f"prefill_many batch of {n} prompts is not one of "
                       f"{self.prefill_batch_sizes}; split it with split_batch")
    if b not in self.recompute_buckets:
      raise ValueError(f"prefill_many padded length {b} is not a bucket of {self.prefill_buckets}")
    if true_lengths.min() < 1 or true_lengths.max() > b:
      raise ValueError(f"true_lengths {true_lengths.tolist()} outside [1, {b}]")
    prefix = () if existing_prefix is None else self._check_existing_prefix(
        existing_prefix, int(true_lengths.max()))
    return self._prefill_many(params, padded_tokens, true_lengths, *prefix)

  def _insert_many_impl(self, prefixes: Prefixes, state: DecodeState, slots, rows, keys,
                        sample_index, count, active):
    # Draw every entry's first token from its row's logits with its own stream (the key for
    # sample i of a request is fold_in(request_key, i), as `resample` would have it).
    slot_keys = jax.vmap(jax.random.fold_in)(keys, sample_index)
    lg = prefixes.logits[rows]
    true_len = prefixes.true_length[rows]
    tok, lp = S.sample(lg, slot_keys, true_len, self.sampling)

    def copy_one(i, kv):
      # Entries past `count` are padding and never run; each real one copies one prompt cache
      # (per layer, keys [1, K, Dh, bucket] and values [1, K, bucket, Dh]) into its slot in
      # place (the state is donated).
      def put(big, small):
        row = jax.lax.dynamic_slice_in_dim(small, rows[i], 1, axis=0)
        return _put_slot(big, row, slots[i])
      k, v = kv
      return (tuple(map(put, k, prefixes.cache.k)), tuple(map(put, v, prefixes.cache.v)))

    k, v = jax.lax.fori_loop(0, count, copy_one, (state.cache.k, state.cache.v))
    # Padding entries carry slot index = number of slots: out of range, so these writes drop.
    put = lambda a, x: _put_rows(a, slots, x)
    cache = T.KVCache(k, v, put(state.cache.lengths, true_len))
    new = DecodeState(cache, put(state.tokens, tok), put(state.keys, slot_keys), active)
    return new, tok, lp

  def insert_many(self, prefixes: Prefixes, decode_state: DecodeState, slots, rows, keys,
                  sample_index, active) -> tuple[DecodeState, Array, Array]:
    """Copies prefix rows `rows[j]` into slots `slots[j]` (several slots may share a row) in one
    call, donating decode_state. Entry j's slot stream is fold_in(keys[j], sample_index[j]) and
    its first token is drawn from the row's logits at position true_length with that stream.
    `active` [slots] bool becomes the new activity mask (so frees and inserts are one call).
    Returns (decode_state, first tokens [max_concurrent_decodes], their log-probs): entry j's
    are at index j; entries past len(slots) are padding."""
    m = len(slots)
    if not 1 <= m <= self._slots:
      raise ValueError(f"insert_many got {m} entries, want 1..{self._slots}")
    slots = np.asarray(slots, np.int32)
    rows = np.asarray(rows, np.int32)
    n = prefixes.logits.shape[0]
    self._check_slots("insert_many", slots)
    if rows.shape != (m,) or rows.min() < 0 or rows.max() >= n:
      raise ValueError(f"insert_many rows {rows.tolist()} must be {m} indices in [0, {n})")
    # Pad to a fixed number of entries so one program serves any number of inserts.
    pad = self._slots - m
    slots = np.concatenate([slots, np.full((pad,), self._slots, np.int32)])
    rows = np.concatenate([rows, np.zeros((pad,), np.int32)])
    keys = np.concatenate([np.asarray(keys, np.uint32).reshape(m, 2),
                           np.zeros((pad, 2), np.uint32)])
    sample_index = np.concatenate([np.asarray(sample_index, np.int32).reshape(m),
                                   np.zeros((pad,), np.int32)])
    return self._insert_many(prefixes, decode_state, slots, rows, keys, sample_index,
                             np.int32(m), np.asarray(active, bool))

  def _generate_impl(self, params, state: DecodeState, window: int):
    active = state.active
    hidden, cache = T.decode(params, self.cfg, state.tokens[:, None], state.cache, self.shard,
                             num_new=active.astype(jnp.int32),
                             window=window if window < self.cache_length else None)
    lg = T.logits(params, self.cfg, hidden[:, 0])
    finite = jnp.all(jnp.isfinite(lg), axis=-1)
    # The sampled token will sit at position cache.lengths (the stream's key is folded with it).
    tok, lp = S.sample(lg, state.keys, cache.lengths, self.sampling)
    tok = jnp.where(active, tok, state.tokens)
    new_state = DecodeState(cache, tok, state.keys, active)
    return new_state, ResultTokens(tok, lp, active, cache.lengths, finite)

  def generate(self, params, decode_state: DecodeState, window: int | None = None):
    """One decode step for every slot (inactive slots compute but do not advance). `window`
    (one of attention_windows; default: the whole cache) bounds the cache positions attended
    to: every active slot's cache length must be below it (window_for gives the smallest such
    window), or its token is computed from a truncated prefix."""
    if window is None:
      window = self.cache_length
    elif window not in self.attention_windows:
      raise ValueError(f"attention window {window} is not one of {self.attention_windows}")
    return self._generate(params, decode_state, int(window))

  def window_for(self, positions: int) -> int:
    """The smallest attention window covering `positions` cache positions (the largest
    active cache length + 1: the step writes the pending token at position length)."""
    i = bisect.bisect_left(self.attention_windows, positions)
    if i == len(self.attention_windows):
      raise ValueError(f"{positions} positions exceed the cache length {self.cache_length}")
    return self.attention_windows[i]

  def set_active(self, decode_state: DecodeState, active) -> DecodeState:
    """Frees (False) or keeps (True) slots; a freed slot stops advancing until re-inserted."""
    return self._set_active(decode_state, jnp.asarray(active, bool))

  # ---- compaction ----------------------------------------------------------------------------
  # A step costs about the same however many slots are active (every slot computes), so when
  # only a few sequences are left (the drain at the end of a batch), running them on fewer slots
  # is cheaper: on a 2-core CPU the SmolLM2-135M step takes ~0.75x the time at half the slots and
  # ~0.64x at a quarter. `compact` gathers the active slots into the decode state of a smaller
  # engine (compact_engine(n): same config and mesh, n slots, its own compiled step);
  # `expand` writes them back. GeneratorLoop does both at step boundaries. Each sequence keeps
  # its cache, tokens, PRNG stream and length, so the tokens are the ones the full-size step
  # would have produced (to fp32 rounding of a different batch shape).
  def _check_slots(self, what: str, slots: np.ndarray) -> None:
    if slots.size and (slots.min() < 0 or slots.max() >= self._slots
                       or len(set(slots.tolist())) != slots.size):
      raise ValueError(f"{what} slots {slots.tolist()} must be distinct, in [0, {self._slots})")

  def compact_size(self, n_active: int) -> int | None:
    """The smallest compaction size that holds n_active slots (None: none is smaller than the
    engine's own slot count)."""
    fits = [n for n in self.compact_sizes if n >= n_active]
    return min(fits) if fits else None

  def compact_engine(self, n: int) -> "Engine":
    """The n-slot engine that compacted states run on (built once, shares this mesh)."""
    if n not in self.compact_sizes:
      raise ValueError(f"{n} is not one of compact_sizes {self.compact_sizes}")
    if n not in self._children:
      self._children[n] = Engine(self.cfg, self.mesh, max_concurrent_decodes=n,
                                 **self._engine_kw)
    return self._children[n]

  def _gather_impl(self, state: DecodeState, idx, valid) -> DecodeState:
    take = lambda a: jnp.take(a, idx, axis=0)
    cache = T.KVCache(tuple(map(take, state.cache.k)), tuple(map(take, state.cache.v)),
                      take(state.cache.lengths))
    return DecodeState(cache, take(state.tokens), take(state.keys), take(state.active) & valid)

  def _scatter_impl(self, state: DecodeState, small: DecodeState, idx) -> DecodeState:
    put = lambda a, x: _put_rows(a, idx, x)
    cache = T.KVCache(tuple(map(put, state.cache.k, small.cache.k)),
                      tuple(map(put, state.cache.v, small.cache.v)),
                      put(state.cache.lengths, small.cache.lengths))
    return DecodeState(cache, put(state.tokens, small.tokens), put(state.keys, small.keys),
                       put(state.active, small.active))

  def compact(self, decode_state: DecodeState, slots, size: int | None = None) -> DecodeState:
    """Gathers slots `slots` of decode_state into a new decode state of compact_engine(size)
    (default size: compact_size(len(slots))), in that order; the rows past len(slots) are
    inactive. decode_state is left as it is (expand writes the slots back)."""
    slots = np.asarray(slots, np.int32).reshape(-1)
    n = self.compact_size(len(slots)) if size is None else size
    if n is None or n not in self.compact_sizes or not 1 <= len(slots) <= n:
      raise ValueError(f"cannot compact {len(slots)} slots into one of {self.compact_sizes}"
                       + (f" (size {size} asked)" if size is not None else ""))
    self._check_slots("compact", slots)
    if n not in self._gathers:
      self._gathers[n] = jax.jit(self._gather_impl,
                                 out_shardings=self.compact_engine(n).state_shardings)
    idx = np.zeros((n,), np.int32)
    idx[:len(slots)] = slots
    return self._gathers[n](decode_state, idx, np.arange(n) < len(slots))

  def expand(self, decode_state: DecodeState, small: DecodeState, slots) -> DecodeState:
    """Writes row i of a compacted state back into slot slots[i] of decode_state (donated), as
    `compact` took them; rows with slots[i] = -1 (sequences that finished meanwhile) and rows
    past len(slots) are not written. Returns the full-size state."""
    slots = np.asarray(slots, np.int32).reshape(-1)
    n = small.tokens.shape[0]
    if len(slots) > n:
      raise ValueError(f"expand slots {slots.tolist()}: more than the {n} rows of the compacted "
                       "state")
    self._check_slots("expand", slots[slots != -1])
    idx = np.full((n,), self._slots, np.int32)   # out of range: the scatter drops these rows
    idx[:len(slots)] = np.where(slots >= 0, slots, self._slots)
    return self._scatter(decode_state, small, idx)
