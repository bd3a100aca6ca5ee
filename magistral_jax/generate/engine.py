"""The generation engine: JetStream's Engine contract, written natively in JAX.

JetStream splits serving into
  prefill(params, padded_tokens, true_length) -> prefix   (KV cache of one prompt + first token)
  insert(prefix, decode_state, slot)          -> decode_state
  generate(params, decode_state)              -> (decode_state, result tokens)
over a fixed number of decode slots (`max_concurrent_decodes`); `prefill(..., existing_prefix=
prefix)` continues a cached prefix (JetStream's prefix caching). We keep that contract (so
jetstream_adapter.py can hand this engine to the real orchestrator) and add what RL needs: every
token comes with its fp32 log-prob under the sampling policy (sampling.py), and per-slot PRNG
streams. GeneratorLoop refills in batches (prefill_many, insert_many); the programs that put
prompts into slots, one or many at a time, are prompts.py's.

`generate` is one jitted program per attention window with fixed shapes and shardings and the
decode state donated, so new weights never recompile it; shapes.py bounds every program's shapes.
The engine lives on its own mesh with its own rules (default GENERATOR_RULES: tensor parallel);
`load_params` reshards whatever it is given onto it, in the decode layout (weights.py). The
XLA:CPU settings come in one CpuOptions (xla_cpu.py: the step's dot library, and drain
compaction onto smaller child engines, compaction.py).
"""
from __future__ import annotations

from functools import partial
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from magistral_jax.generate import prompts
from magistral_jax.generate import sampling as S
from magistral_jax.generate import shapes
from magistral_jax.generate.compaction import Compaction, compaction_sizes
from magistral_jax.generate.xla_cpu import CpuOptions, GenerateStep
from magistral_jax.generate.state import (DecodeState, Prefix, Prefixes, ResultTokens,
                                          empty_state, existing_prefix_cache,
                                          state_shardings)
from magistral_jax.generate.weights import Weights
from magistral_jax.model import paged_attention as PA
from magistral_jax.model import transformer as T
from magistral_jax.model.decode_choice import decode_choice
from magistral_jax.model.config import ModelConfig
from magistral_jax.model.kv_cache import page_replicas
from magistral_jax.parallel.sharding import ShardingCtx
from magistral_jax.parallel.config import GENERATOR_RULES

Array = jax.Array


class Engine:
  """Slots, a KV cache and three jitted programs (prefill / insert / generate) on one mesh.
  `cpu` (CpuOptions; None = its defaults) holds the XLA:CPU settings; the keywords
  cpu_dot_library / compact_sizes are shorthands for its fields."""

  def __init__(self, cfg: ModelConfig, mesh: Mesh, rules=GENERATOR_RULES, *,
               max_concurrent_decodes: int, max_prefill_length: int, max_decode_length: int,
               sampling: S.SamplingConfig = S.SamplingConfig(),
               prefill_buckets: Sequence[int] | None = None, cache_dtype=None,
               truncate_prompts: bool = False, max_prefill_batch: int | None = None,
               attention_windows: Sequence[int] | int | None = None,
               cpu: CpuOptions | None = None, cpu_dot_library: str | None = None,
               compact_sizes: Sequence[int] | None = None, kv_pages: int | None = None,
               page_size: int = 16, paged_attention: str | None = None):
    if max_concurrent_decodes < 1 or max_prefill_length < 1 or max_decode_length < 1:
      raise ValueError("max_concurrent_decodes, max_prefill_length and max_decode_length must be "
                       f">= 1, got {max_concurrent_decodes}, {max_prefill_length}, "
                       f"{max_decode_length}")
    # A paged KV cache (model/paged_attention.py): pages of page_size positions handed out by
    # the loop (paging.py; page 0 the null page); a decode step reads only the pages its slots
    # filled, so windows have nothing left to do on it; compaction gathers table rows.
    self.kv_pages, self.page_size = (None if kv_pages is None else int(kv_pages)), int(page_size)
    if self.kv_pages is not None:
      if self.kv_pages < 2 or self.page_size < 1:
        raise ValueError(f"a paged KV cache needs kv_pages >= 2 (page 0 is the null page) and "
                         f"page_size >= 1, got {kv_pages} and {page_size}")
      attention_windows = None
    self.cpu = CpuOptions.resolve(cpu, cpu_dot_library, compact_sizes)
    self.cfg, self.mesh, self.rules = cfg, mesh, tuple(rules)
    self.sampling = sampling
    self._slots, self._max_prefill, self._max_decode = (
        int(max_concurrent_decodes), int(max_prefill_length), int(max_decode_length))
    self.cache_length = self._max_prefill + self._max_decode
    self.cache_dtype = jnp.dtype(cache_dtype or cfg.dtype)
    self.truncate_prompts = truncate_prompts
    self.prefill_buckets = shapes.prefill_buckets(prefill_buckets, self._max_prefill)
    # Attention windows (shapes.py, `window_for`): one generate program per window.
    self.attention_windows = shapes.attention_windows(attention_windows, self.cache_length)
    # Decode attention (model/decode_choice.py): "live" reads only the positions each
    # slot has reached, whatever the window, so windows would only add programs.
    self.decode_attention = decode_choice(cfg, cfg.head_dim, 1, self.cache_length, cfg.dtype)
    self.max_pages_per_slot = -(-self.cache_length // self.page_size)
    if self.kv_pages is not None:
      self.decode_attention = "paged"
      self.paged_attention = paged_attention or PA.default_impl(mesh.devices.flat[0].platform)
      if self.paged_attention not in PA.IMPLS:
        raise ValueError(f"paged_attention must be one of {PA.IMPLS}, got {paged_attention!r}")
    if self.decode_attention in ("live", "paged"):
      self.attention_windows = (self.cache_length,)
    # Batched prefill: up to max_prefill_batch prompts per call (default: min(slots, 8), which
    # bounds the activation memory of one call to 8 prompts), in power-of-two batch sizes.
    self.prefill_batch_sizes = shapes.prefill_batch_sizes(
        min(self._slots, 8) if max_prefill_batch is None else int(max_prefill_batch))
    self.recompute_buckets = shapes.recompute_buckets(self.prefill_buckets, self._max_prefill,
                                                      self.cache_length)
    self.shard = ShardingCtx(mesh, self.rules)
    self._weights = Weights(cfg, mesh, self.rules)
    self.param_shardings = self._weights.param_shardings
    self.decode_param_shardings = self._weights.decode_param_shardings

    rep = NamedSharding(mesh, P())
    # One pool of kv_pages pages per data replica (model/kv_cache.py), for its slots (paging.py).
    self.page_replicas = page_replicas(self.shard.rules, dict(mesh.shape))
    empty = partial(empty_state, cfg, self._slots, self.cache_length, self.cache_dtype, None
                    if self.kv_pages is None else (self.kv_pages * self.page_replicas,
                                                   self.page_size))
    self.state_shardings = state_shardings(self.shard, jax.eval_shape(empty))

    self.platform = mesh.devices.flat[0].platform
    # The attention window (argument 2) is static: one program per window. Its dot library on CPU
    # is what xla_cpu.tune_engine chooses (the only thing tuning changes in an engine).
    self.generate_step = GenerateStep(lambda options: jax.jit(
        self._generate_impl,
        in_shardings=(self.decode_param_shardings, self.state_shardings),
        out_shardings=(self.state_shardings, ResultTokens(*([rep] * 5))), donate_argnums=(1,),
        static_argnums=(2,), compiler_options=options),
        self.platform, self._slots, self.cpu.dot_library)
    # Compaction: the child engines share everything but the slot count, and compact no further.
    child_kw = dict(rules=rules, max_prefill_length=max_prefill_length,
                    max_decode_length=max_decode_length, sampling=sampling,
                    prefill_buckets=prefill_buckets, cache_dtype=cache_dtype,
                    truncate_prompts=truncate_prompts, max_prefill_batch=max_prefill_batch,
                    attention_windows=self.attention_windows, kv_pages=kv_pages,
                    page_size=page_size, paged_attention=paged_attention,
                    cpu=CpuOptions(self.cpu.dot_library, compact_sizes=()))
    slot_shards = self._slots // self.state_shardings.tokens.shard_shape((self._slots,))[0]
    if self.kv_pages is not None and self.page_replicas != slot_shards:
      raise ValueError(f"the page pools split over {self.page_replicas} replicas and the slots "
                       f"over {slot_shards}: the rules for 'cache_pages' and 'cache_batch' must "
                       "name the same mesh axes, and the slots divide over them")
    # A paged drain is a table gather: down to a sixteenth of the slots (dense: a half, a
    # quarter); none with a pool per replica (a gather would move slots from their pages).
    sizes = self.cpu.compact_sizes
    if self.kv_pages is not None and self.page_replicas > 1:
      sizes = ()
    elif sizes is None and self.kv_pages is not None:
      sizes = [self._slots >> i for i in range(1, 5) if self._slots >> i >= 1]
    self._compaction = Compaction(
        self._slots, compaction_sizes(sizes, self._slots, slot_shards),
        self.state_shardings,
        lambda n: Engine(self.cfg, self.mesh, max_concurrent_decodes=n, **child_kw))
    self.compact_sizes = self._compaction.sizes
    # Putting prompts into slots (prompts.py), with what each program needs of this engine.
    model = dict(cfg=cfg, shard=self.shard, cache_dtype=self.cache_dtype,
                 cache_length=self.cache_length)
    self._prefill = jax.jit(partial(prompts.prefill_one, sampling=sampling, **model),
                            out_shardings=None)
    self._insert = jax.jit(prompts.insert_one, out_shardings=self.state_shardings,
                           donate_argnums=(1,), static_argnames=("cache_only",))
    self._extend = jax.jit(partial(prompts.extend_one, sampling=sampling, **model),
                           out_shardings=(self.state_shardings, rep, rep), donate_argnums=(1,))
    self._init = jax.jit(empty, out_shardings=self.state_shardings)
    self._prefill_many = jax.jit(partial(prompts.prefill_rows, **model))
    self._insert_many = jax.jit(partial(prompts.insert_rows, sampling=sampling),
                                out_shardings=(self.state_shardings, rep, rep),
                                donate_argnums=(1,))
    self._set_active = jax.jit(lambda st, a: st._replace(active=a),
                               out_shardings=self.state_shardings, donate_argnums=(0,))
    self._set_pages = jax.jit(lambda st, t: st._replace(cache=st.cache._replace(page_table=t)),
                              out_shardings=self.state_shardings, donate_argnums=(0,))

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
    "generate" counts the programs of every dot library compiled so far (two after tuning),
    "compact" the child engines' generate / set_active programs, the gathers and the scatter."""
    counts = {name: getattr(self, f"_{name}")._cache_size()
              for name in ("prefill", "insert", "set_active", "prefill_many", "insert_many")}
    counts["generate"] = self.generate_step.cache_size()
    counts["compact"] = self._compaction.cache_size()
    return counts

  # ---- CPU dot-library tuning (xla_cpu.tune_engine sets generate_step's choice) ------------
  @property
  def generate_library(self) -> str | None:
    """The CPU dot library of the generate step in use (None off CPU)."""
    return self.generate_step.library

  @property
  def generate_tuning(self) -> dict | None:
    """What xla_cpu.tune_generate measured: {"chosen", "step_ms": {library: median ms}}, or
    None."""
    return self.generate_step.tuning

  # ---- params --------------------------------------------------------------------------------
  def load_params(self, params) -> Any:
    """Validates params (structure, shapes, finiteness) and puts them on the engine's mesh in
    cfg.serving_param_dtype and the decode layout (weights.py)."""
    return self._weights.load(params)

  @property
  def param_dtype(self):
    """The dtype the engine holds its weights in (cfg.serving_param_dtype)."""
    return self._weights.dtype

  def cast_params(self, params) -> Any:
    """`params` cast to the engine's weight dtype where they are (one jitted program on their
    own devices), e.g. the trainer's fp32 master weights to bf16 before a push moves them."""
    return self._weights.cast(params)

  # ---- decode state --------------------------------------------------------------------------
  def init_decode_state(self, *args, **kwargs) -> DecodeState:
    del args, kwargs  # JetStream passes an rng; slot keys come with each prefix instead.
    return self._init()

  def precompile(self, params, buckets: Sequence[int] | None = None, tune: bool = True,
                 existing_prefix: Prefix | None = None) -> None:
    """Compiles every program a run uses (shapes.precompile), so a timed or latency-sensitive
    run compiles nothing later; with `tune` it first picks the generate step's dot library
    (xla_cpu.tune_engine). `params` as returned by load_params. With `existing_prefix` (the
    shared prefix a GeneratorLoop continues) the programs that continue it are compiled too."""
    shapes.precompile(self, params, buckets or self.prefill_buckets, tune, existing_prefix)

  # ---- prompts -------------------------------------------------------------------------------
  def bucket_for(self, n: int, buckets: Sequence[int] | None = None) -> int:
    """The smallest of `buckets` (default: prefill_buckets) holding n tokens."""
    return shapes.smallest_fitting(buckets or self.prefill_buckets, n,
                                   "tokens exceed the largest bucket,")

  def pad_prompt(self, tokens: Sequence[int], buckets: Sequence[int] | None = None,
                 truncate: bool | None = None):
    """Validates a prompt and right-pads it to its bucket: (padded int32 [bucket], true_length,
    truncated). Too long -> ValueError, or with truncate_prompts=True the *last*
    max_prefill_length tokens are kept (the end of a chat prompt is what conditions the answer)
    and truncated=True is reported (`truncate` overrides the engine's setting)."""
    return shapes.pad_prompt(tokens, buckets or self.prefill_buckets, self.cfg.vocab_size,
                             self.truncate_prompts if truncate is None else truncate)

  # ---- prefill / insert / generate (prompts.py) ---------------------------------------------
  def prefill(self, params, padded_tokens, true_length, *, temperature: float, rng=None,
              existing_prefix=None) -> Prefix:
    """KV cache of one prompt (padded to a bucket) and its first token, sampled at the
    request's `temperature` (carried by the Prefix into its slot). `rng` (a uint32[2] PRNG key)
    seeds the slot stream this prefix will carry into `insert`.
    `existing_prefix` (a Prefix from an earlier prefill: JetStream's prefix caching) makes the
    tokens a continuation of that prompt: they are written after its cache, attend to it, and
    the returned Prefix holds the whole prompt (its true_length counts both parts)."""
    padded_tokens = jnp.asarray(padded_tokens, jnp.int32).reshape(-1)
    if not 1 <= int(true_length) <= padded_tokens.shape[0]:
      raise ValueError(f"true_length={int(true_length)} outside [1, {padded_tokens.shape[0]}]")
    key = jax.random.PRNGKey(0) if rng is None else jnp.asarray(rng, jnp.uint32)
    prefix = () if existing_prefix is None else existing_prefix_cache(
        existing_prefix, int(true_length), self.cfg, self._max_prefill)
    return self._prefill(params, padded_tokens, jnp.asarray(true_length, jnp.int32), key,
                         prompts.checked_temperature(temperature, "prefill"), *prefix)

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
    # Only the cache is kept: the slot keeps its token, stream and temperature (passed here so
    # the recompute draws at the slot's own).
    prefix = self._prefill(params, jnp.asarray(padded), jnp.asarray(n, jnp.int32),
                           jnp.zeros((2,), jnp.uint32), decode_state.temperature[slot])
    return self._insert(prefix, decode_state, jnp.asarray(slot, jnp.int32), cache_only=True)

  def extend(self, params, decode_state: DecodeState, slot: int, tokens: Sequence[int],
             length: int) -> tuple[DecodeState, Array, Array]:
    """Continues the live sequence in `slot` (donating decode_state), whose first `length`
    cache positions are kept as they are, with `tokens` (the slot's pending token, then what a
    tool returned: prompts.extend_one), and draws its next token: (state, token, log-prob). A
    paged slot must hold the pages of length + len(tokens) + 1 positions."""
    padded, n, _ = self.pad_prompt(tokens, self.recompute_buckets)
    if length < 1 or length + n > self.cache_length:
      raise ValueError(f"slot {slot}: {length} cached + {n} new positions do not fit the cache "
                       f"of {self.cache_length}")
    return self._extend(params, decode_state, jnp.asarray(slot, jnp.int32), jnp.asarray(padded),
                        jnp.asarray(n, jnp.int32), jnp.asarray(length, jnp.int32))

  # ---- batched prefill / insert (used by GeneratorLoop) ---------------------------------------
  def split_batch(self, n: int) -> list[int]:
    """Splits n prompts into calls of sizes from prefill_batch_sizes (largest first, no padding
    rows; at most log2(max_prefill_batch) + n // max_prefill_batch calls)."""
    return shapes.split_batch(n, self.prefill_batch_sizes)

  def prefill_many(self, params, padded_tokens, true_lengths, existing_prefix=None) -> Prefixes:
    """KV caches and last-position logits of N prompts padded to one bucket, in one call.
    N must be one of prefill_batch_sizes (see split_batch) so compilations stay bounded.
    With `existing_prefix` (a Prefix from `prefill`, e.g. a system prompt every request starts
    with) the N rows are continuations of that one prompt: its cache is copied into every row
    and only the new tokens go through the model (the rows' caches are min(Pp + bucket,
    cache_length) long, Pp the prefix's bucket; true_length counts the prefix)."""
    padded_tokens, true_lengths = shapes.check_prefill_batch(
        padded_tokens, true_lengths, self.prefill_batch_sizes, self.recompute_buckets)
    prefix = () if existing_prefix is None else existing_prefix_cache(
        existing_prefix, int(true_lengths.max()), self.cfg, self._max_prefill)
    return self._prefill_many(params, padded_tokens, true_lengths, *prefix)

  def insert_many(self, prefixes: Prefixes, decode_state: DecodeState, slots, rows, keys,
                  sample_index, active, *, temperature: float
                  ) -> tuple[DecodeState, Array, Array]:
    """Copies prefix rows `rows[j]` into slots `slots[j]` (several slots may share a row) in one
    call, donating decode_state. Entry j's slot stream is fold_in(keys[j], sample_index[j]) and
    its first token is drawn from the row's logits at position true_length with that stream.
    `active` [slots] bool becomes the new activity mask (so frees and inserts are one call).
    `temperature` (the requests', given by the caller) is the entries' sampling temperature,
    for their first token and, kept in their slots, for every later one: an input of the
    program, so loops sampling at different temperatures share this engine's programs.
    Returns (decode_state, first tokens [max_concurrent_decodes], their log-probs): entry j's
    are at index j; entries past len(slots) are padding."""
    m = len(slots)
    slots, rows, keys, sample_index = shapes.pad_inserts(
        slots, rows, keys, sample_index, self._slots, prefixes.logits.shape[0])
    return self._insert_many(prefixes, decode_state, slots, rows, keys, sample_index,
                             np.int32(m), np.asarray(active, bool),
                             prompts.checked_temperature(temperature, "insert_many"))

  def _generate_impl(self, params, state: DecodeState, bound: int):
    active = state.active
    if self.kv_pages is not None:   # what it reads follows the live pages, whatever the bound
      read = dict(paged=self.paged_attention)
    else:
      read = dict(window=bound if bound < self.cache_length else None)
    hidden, cache = T.decode(params, self.cfg, state.tokens[:, None], state.cache, self.shard,
                             num_new=active.astype(jnp.int32), **read)
    lg = T.logits(params, self.cfg, hidden[:, 0])
    finite = jnp.all(jnp.isfinite(lg), axis=-1)
    # The sampled token will sit at position cache.lengths (the stream's key is folded with it).
    tok, lp = S.sample(lg, state.keys, cache.lengths, self.sampling, state.temperature)
    tok = jnp.where(active, tok, state.tokens)
    new_state = state._replace(cache=cache, tokens=tok)
    return new_state, ResultTokens(tok, lp, active, cache.lengths, finite)

  def generate(self, params, decode_state: DecodeState, window: int | None = None):
    """One decode step for every slot (inactive slots compute but do not advance). `window`
    (default: the whole cache) bounds the cache positions a dense cache's step attends to: one of attention_windows, above every active slot's cache length (window_for
    gives the smallest such window), or its token is computed from a truncated prefix. A paged
    cache's step reads the pages its slots hold, whatever the window."""
    if self.kv_pages is not None:
      window = self.cache_length
    if window is None:
      window = self.cache_length
    elif window not in self.attention_windows:
      raise ValueError(f"attention window {window} is not one of {self.attention_windows}")
    return self.generate_step.fn(params, decode_state, int(window))

  def set_pages(self, decode_state: DecodeState, page_table) -> DecodeState:
    """The paged cache's page table [slots, max_pages_per_slot] (the loop's, paging.py)."""
    return self._set_pages(decode_state, jnp.asarray(page_table, jnp.int32))

  def window_for(self, positions: int) -> int:
    """The smallest attention window covering `positions` cache positions (the largest
    active cache length + 1: the step writes the pending token at position length)."""
    return shapes.smallest_fitting(self.attention_windows, positions,
                                   "positions exceed the cache length,")

  def set_active(self, decode_state: DecodeState, active) -> DecodeState:
    """Frees (False) or keeps (True) slots; a freed slot stops advancing until re-inserted."""
    return self._set_active(decode_state, jnp.asarray(active, bool))

  # ---- compaction (compaction.py) ------------------------------------------------------------
  def compact_size(self, n_active: int) -> int | None:
    """The smallest compaction size that holds n_active slots (None: none is smaller)."""
    return self._compaction.size_for(n_active)

  def compact_engine(self, n: int) -> "Engine":
    """The n-slot engine that compacted states run on (built once, shares this mesh)."""
    return self._compaction.child(n)

  def compact(self, decode_state: DecodeState, slots, size: int | None = None) -> DecodeState:
    """Gathers `slots` of decode_state into a new decode state of compact_engine(size)."""
    return self._compaction.compact(decode_state, slots, size)

  def expand(self, decode_state: DecodeState, small: DecodeState, slots) -> DecodeState:
    """Writes row i of a compacted state back into slot slots[i] of decode_state (donated)."""
    return self._compaction.expand(decode_state, small, slots)
