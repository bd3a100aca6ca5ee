"""The bytes one device holds at its peak, per role of a run: what run/plan.py adds up.

For a model shape and a validated run config (magistral_jax/config.py validate), what one
device of each role holds at its peak:

  trainer    master weights (model.param_dtype), the optimizer state (AdamW: two moments in the
             param dtype, from the real optimizer's init), the fp32 gradient accumulator of the
             microbatch scan and one microbatch's gradient (train/step.py), the packed batch
             stack, one layer's weights gathered from the FSDP shards (and its unreduced
             gradient), the activations of one microbatch under model.remat, and the chunked
             log-prob head (model.logits_chunk);
  generator  its weight copy in model.serving_param_dtype, a second copy while a pushed update
             waits for a step boundary (generate/loop_weights.py), the decode state (the
             per-layer KV cache of engine.max_concurrent_decodes slots x (max_prefill_length +
             sampling.max_new_tokens) positions in the compute dtype, as generate/state.py
             builds it, or a paged cache's page pools: engine.kv_pages pages, the dense cache's
             worth unless set; and the per-slot vectors), a dense cache's drain compaction (a
             child cache of half the slots beside it: generate/compaction.py), one batched
             prefill and the decode step's logits.

Every array is divided as the run lays it out: parameters by their logical axes
(model.transformer.param_logical_axes) under sharding.trainer_rules / generator_rules on the
trainer / generator mesh, activations and caches by theirs; parallel.sharding.logical_to_spec
decides each division from the mesh's axis sizes alone, so no device is needed. Colocated: one
device holds both roles' bytes. The activation terms follow the model code (model/layers.py,
model/attention.py: which attention implementation the target platform would run, and whether
it keeps a T x T matrix); tests/launch/test_plan.py holds them against XLA's memory analysis of
the compiled train step on CPU and the engine's real decode state.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import optax

from magistral_jax.config import RunConfig
from magistral_jax.model import transformer as tfm
from magistral_jax.model.attention import choose_impl
from magistral_jax.model.config import ModelConfig
from magistral_jax.model.kv_cache import page_replicas
from magistral_jax.parallel.config import MESH_AXES
from magistral_jax.parallel.sharding import is_logical_axes, splits
from magistral_jax.pipeline.generators import paged_kv
from magistral_jax.train.optimizer import make_optimizer


# ---- division by the rules --------------------------------------------------------------------

def mesh_sizes(mesh_shape: dict, num_devices: int) -> dict[str, int]:
  """The mesh's axis sizes as parallel.sharding.make_mesh resolves them (-1 takes the rest)."""
  sizes = {a: int(mesh_shape.get(a, 1)) for a in MESH_AXES}
  free = [a for a, s in sizes.items() if s == -1]
  known = math.prod(s for s in sizes.values() if s != -1)
  if len(free) > 1 or num_devices % known:
    raise ValueError(f"mesh {dict(mesh_shape)} cannot be laid over {num_devices} devices")
  if free:
    sizes[free[0]] = num_devices // known
  if math.prod(sizes.values()) != num_devices:
    raise ValueError(f"mesh {sizes} needs {math.prod(sizes.values())} devices, the slice has "
                     f"{num_devices}")
  return sizes


def shard_elems(shape, axes, rules, sizes: dict[str, int]) -> int:
  """Elements of one device's shard of an array of `shape` with logical `axes` (mesh axes the
  dimension does not divide by are dropped, as logical_to_spec does)."""
  return math.prod(dim // k for dim, k in zip(shape, splits(shape, axes, rules, sizes)))


def _param_tree(model_cfg: ModelConfig):
  return tfm.param_shapes(model_cfg), tfm.param_logical_axes(model_cfg)


def param_shard_bytes(model_cfg: ModelConfig, rules, sizes, dtype) -> int:
  """Bytes of one device's shards of every parameter in `dtype`."""
  shapes, axes = _param_tree(model_cfg)
  per = jax.tree.map(lambda ax, s: shard_elems(s.shape, ax, rules, sizes), axes, shapes,
                     is_leaf=is_logical_axes)
  return sum(jax.tree.leaves(per)) * jnp.dtype(dtype).itemsize


def optimizer_shard_bytes(model_cfg: ModelConfig, tx, rules, sizes) -> int:
  """Bytes of one device's share of tx's state: each param-shaped leaf divided like its
  parameter (train/step.py state_shardings), the rest (counters) whole."""
  shapes, axes = _param_tree(model_cfg)
  shapes = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, model_cfg.jnp_param_dtype),
                        shapes)
  state = jax.eval_shape(tx.init, shapes)
  divisor = jax.tree.map(lambda ax, s: math.prod(s.shape) // max(
      shard_elems(s.shape, ax, rules, sizes), 1), axes, shapes, is_leaf=is_logical_axes)
  per = optax.tree_map_params(
      tx, lambda s, d: math.prod(s.shape) * s.dtype.itemsize // d, state, divisor,
      transform_non_params=lambda s: math.prod(s.shape) * s.dtype.itemsize)
  return int(sum(jax.tree.leaves(per)))


# ---- the trainer ------------------------------------------------------------------------------

def _itemsize(dtype) -> int:
  return jnp.dtype(dtype).itemsize


def vocab_pieces(model_cfg: ModelConfig, platform: str) -> int:
  """transformer.vocab_pieces for the target platform (auto: 4 on CPU, 1 elsewhere)."""
  return max(1, min(model_cfg.logits_vocab_pieces or (4 if platform == "cpu" else 1),
                    model_cfg.vocab_size))


def attention_impl(model_cfg: ModelConfig, platform: str, q_len: int, segments: bool = True,
                   self_only: bool = True) -> str:
  """The implementation model/attention.py would pick on `platform` for this call."""
  return choose_impl(model_cfg.attention_impl, platform=platform, dtype=model_cfg.jnp_dtype,
                     head_dim=model_cfg.head_dim, q_len=q_len, kv_len=q_len, segments=segments,
                     self_only=self_only, window=model_cfg.sliding_window,
                     block_q=model_cfg.attention_block_q,
                     capability=9.0 if platform == "cuda" else 0.0)


def _act(shape, axes, rules, sizes, itemsize) -> int:
  return shard_elems(shape, axes, rules, sizes) * itemsize


def layer_activation_bytes(model_cfg: ModelConfig, rows: int, t: int, rules, sizes,
                           platform: str, remat: str) -> dict[str, int]:
  """One layer's share of a microbatch's activations (rows x t tokens over the mesh):
  'saved' (what the backward keeps per layer: under remat 'full' the layer's input only, under
  'dots' also its matmul outputs, under 'none' every residual of the layer) and 'working' (one
  layer's residuals and their cotangents while its backward runs)."""
  c = model_cfg
  dt, f32 = _itemsize(c.dtype), 4
  ab, al = "act_batch", "act_length"
  x = _act((rows, t, c.hidden_size), (ab, al, "act_embed"), rules, sizes, 1)
  q = _act((rows, t, c.num_heads, c.head_dim), (ab, al, "act_heads", None), rules, sizes, 1)
  kv = _act((rows, t, c.num_kv_heads, c.head_dim), (ab, al, "act_kv_heads", None), rules,
            sizes, 1)
  f = _act((rows, t, c.intermediate_size), (ab, al, "act_mlp"), rules, sizes, 1)
  impl = attention_impl(c, platform, t)
  tiles = 0
  if impl == "dense":
    # The [T, S] scores (fp32) and probabilities (compute dtype) per head, and the mask.
    heads_tt = _act((rows, c.num_heads, t, t), (ab, "act_heads", None, None), rules, sizes, 1)
    attn = heads_tt * (f32 + dt) + _act((rows, t, t), (ab, None, None), rules, sizes, 1)
  else:
    # Linear in T: the output and the per-row log-sum-exp (blockwise, flash); the Pallas
    # kernels take the KV heads repeated over their query heads.
    lse = _act((rows, c.num_heads, t), (ab, "act_heads", None), rules, sizes, f32)
    attn = q * dt + lse + (2 * q * dt if impl in ("tpu_flash", "gpu_flash") else 0)
    if impl == "blockwise":
      # Its backward's fp32 tiles (scores, probabilities and their gradients) live in device
      # memory; the kernels keep theirs on chip.
      bq, bk = min(c.attention_block_q, t), min(c.attention_block_k, t)
      tiles = 4 * _act((rows, c.num_heads, bq, bk), (ab, "act_heads", None, None), rules,
                       sizes, f32)
  norms = 2 * (2 * x * f32 + x * dt)             # fp32 input and its normalised output, twice
  # q k v, the attention output, o_proj and down_proj outputs, gate and up outputs
  matmuls = (q + 2 * kv) * dt + q * dt + 2 * x * dt + 2 * f * dt
  # + the transposed keys and values, silu and its product, the residual after attention
  full = x * dt + norms + matmuls + 2 * kv * dt + attn + 2 * f * dt + x * dt
  saved = {"full": x * dt, "dots": x * dt + matmuls, "none": full}[remat]
  # While one layer's backward runs: its residuals (recomputed unless remat is 'none', when they
  # are already counted) and their cotangents, which XLA frees as it goes, plus the attention
  # tiles; a dense attention's [T, S] matrices and their gradients dominate where they exist.
  rest = full - attn
  working = tiles + (rest // 2 if remat == "none" else rest) + (
      3 * attn // 2 if impl == "dense" else attn)
  return {"saved": saved, "working": working, "impl": impl}


def trainer_bytes(run: RunConfig, model_cfg: ModelConfig, platform: str,
                  num_devices: int | None = None, remat: str | None = None) -> dict[str, Any]:
  """Bytes per trainer device (see the module doc), by part; 'mesh' and 'attention' describe
  the layout. `remat` overrides model.remat (the 'without remat' figure)."""
  c, rl = model_cfg, run.rl
  n = run.devices.trainer if num_devices is None else num_devices
  sizes = mesh_sizes(run.devices.trainer_mesh, n)
  rules = run.sharding.trainer_rules
  p, dt = _itemsize(c.param_dtype), _itemsize(c.dtype)
  params = param_shard_bytes(c, rules, sizes, c.param_dtype)
  tx = make_optimizer(run.optimizer)
  rows, t = rl.microbatch_rows, rl.row_len
  # The worst case of collation: one sequence per row, ceil(n_mini / rows) microbatches.
  n_micro = -(-rl.n_mini // rows)
  batch = 8 * n_micro * _act((rows, t), ("act_batch", "act_length"), rules, sizes, 4)
  # One layer's weights and gradient, gathered over the axes that shard 'embed' (FSDP): each
  # weight in the param and compute dtypes, its full gradient before the reduce-scatter; the
  # output head's weight cast to the compute dtype.
  shapes, axes = _param_tree(c)
  unsharded = {k: v for k, v in dict(rules).items() if k != "embed"}
  gather_rules = tuple(unsharded.items())
  layer = sum(shard_elems(s.shape[1:], ax[1:], gather_rules, sizes) for ax, s in zip(
      jax.tree.leaves(axes["layers"], is_leaf=is_logical_axes), jax.tree.leaves(shapes["layers"])))
  head_ax = ("vocab", "embed")
  head = shard_elems((c.vocab_size, c.hidden_size), head_ax, gather_rules, sizes)
  gathered = layer * (2 * p + dt) + head * dt   # the head: its compute-dtype copy
  act = layer_activation_bytes(c, rows, t, rules, sizes, platform, remat or c.remat)
  activations = c.num_layers * act["saved"] + act["working"]
  # Log-prob head: every vocab piece's fp32 logits of one chunk and, in the backward, their
  # gradient; the final norm's residuals and the hidden states' copy
  # cut into chunks (and its cotangent).
  chunk = min(c.logits_chunk, t)
  logits = 2 * _act((rows, chunk, c.vocab_size), ("act_batch", None, "act_vocab"), rules,
                    sizes, 4)
  x = _act((rows, t, c.hidden_size), ("act_batch", "act_length", "act_embed"), rules, sizes, 1)
  head_acts = logits + x * (2 * 4 + dt) + x * (dt + 4) + 4 * _act(
      (rows, t), ("act_batch", "act_length"), rules, sizes, 4)
  parts = {"weights": params,
           "optimizer": optimizer_shard_bytes(c, tx, rules, sizes),
           "gradients": params // p * 4 + params,   # the fp32 accumulator + one microbatch's
           "batch": batch,
           "gathered_layer": gathered,
           "activations": activations + head_acts}
  return {"parts": parts, "total": sum(parts.values()), "mesh": sizes,
          "attention": act["impl"], "rows_per_device": rows // max(1, _dp(rules, sizes, rows)),
          "row_len": t, "remat": remat or c.remat}


def _dp(rules, sizes, rows) -> int:
  return rows // shard_elems((rows,), ("act_batch",), rules, sizes)


# ---- the generators ---------------------------------------------------------------------------

def decode_state_bytes(model_cfg: ModelConfig, slots: int, cache_length: int, rules, sizes,
                       cache_dtype=None) -> dict[str, int]:
  """One device's share of an Engine's DecodeState (generate/state.py): the per-layer KV cache
  (keys [B, K, Dh, S], values [B, K, S, Dh] per layer, in the compute dtype unless
  `cache_dtype`) and the per-slot vectors (lengths, tokens, PRNG keys, active, temperature)."""
  c = model_cfg
  item = _itemsize(cache_dtype or c.dtype)
  k = shard_elems((slots, c.num_kv_heads, c.head_dim, cache_length),
                  ("cache_batch", "act_kv_heads", "head_dim", "cache_length"), rules, sizes)
  v = shard_elems((slots, c.num_kv_heads, cache_length, c.head_dim),
                  ("cache_batch", "act_kv_heads", "cache_length", "head_dim"), rules, sizes)
  b = shard_elems((slots,), ("cache_batch",), rules, sizes)
  return {"kv_cache": c.num_layers * (k + v) * item,
          "slot_vectors": b * (4 + 4 + 2 * 4 + 1 + 4)}


def page_pool_bytes(model_cfg: ModelConfig, pages: int, page_size: int, rules, sizes,
                    cache_dtype=None) -> int:
  """One device's share of a paged KV cache's pools (model/kv_cache.py: [K, pages, page_size, Dh]
  per layer for keys and values, the KV heads split as a per-slot cache's; `pages` each data
  replica's pool, one pool per replica)."""
  c = model_cfg
  pool = shard_elems((c.num_kv_heads, pages * page_replicas(rules, sizes), page_size, c.head_dim),
                     ("act_kv_heads", "cache_pages", None, None), rules, sizes)
  return 2 * c.num_layers * pool * _itemsize(cache_dtype or c.dtype)


def generator_bytes(run: RunConfig, model_cfg: ModelConfig, platform: str,
                    num_devices: int | None = None) -> dict[str, Any]:
  """Bytes per device of one generator (see the module doc), by part."""
  c, e = model_cfg, run.engine
  n = num_devices or (run.devices.trainer if run.devices.colocated
                      else max(run.devices.generators))
  sizes = mesh_sizes(run.devices.generator_mesh, n)
  rules = run.sharding.generator_rules
  dt = _itemsize(c.dtype)
  weights = param_shard_bytes(c, rules, sizes, c.serving_param_dtype)
  slots, cache_length = e.max_concurrent_decodes, e.max_prefill_length + run.sampling.max_new_tokens
  state = decode_state_bytes(c, slots, cache_length, rules, sizes)
  paged = paged_kv(e, run.sampling, platform, sizes.get("data", 1))
  if paged:   # the pool (and a page table per slot) instead of a cache per slot
    state["kv_cache"] = page_pool_bytes(c, paged["kv_pages"], paged["page_size"], rules, sizes)
    state["slot_vectors"] += shard_elems((slots, -(-cache_length // paged["page_size"])),
                                         ("cache_batch", None), rules, sizes) * 4
    compaction = 0   # a table gather: the pools move
  else:
    # Drain compaction (generate/compaction.py) gathers the active slots into a child engine's
    # cache of half the slots, while the full one is kept: the peak of a drain.
    # (Its sizes divide evenly over the slots' shards: compaction.compaction_sizes.)
    data = sizes.get("data", 1)
    half = slots // 2 // data * data
    compaction = decode_state_bytes(c, half, cache_length, rules, sizes)["kv_cache"] \
        if half else 0
  # One batched prefill (generate/engine.py: up to min(slots, 8) prompts): its own cache, one
  # layer's activations, the attention of its implementation, the last positions' logits.
  npf, plen = min(slots, 8), e.max_prefill_length
  pcache = decode_state_bytes(c, npf, plen, rules, sizes)["kv_cache"]
  ab, al = "act_batch", "act_length"
  x = _act((npf, plen, c.hidden_size), (ab, al, "act_embed"), rules, sizes, 1)
  f = _act((npf, plen, c.intermediate_size), (ab, al, "act_mlp"), rules, sizes, 1)
  q = _act((npf, plen, c.num_heads, c.head_dim), (ab, al, "act_heads", None), rules, sizes, 1)
  impl = attention_impl(c, platform, plen, segments=False)
  scores = (_act((npf, c.num_heads, plen, plen), (ab, "act_heads", None, None), rules, sizes,
                 4 + dt) if impl == "dense" else 0)
  prefill = pcache + (4 * x + 3 * f + 3 * q) * dt + 2 * x * 4 + scores
  logits = 3 * _act((slots, c.vocab_size), ("cache_batch", "act_vocab"), rules, sizes, 4)
  parts = {"weights": weights,
           "pending_weights": weights,   # a pushed update, held until the next step boundary
           "kv_cache": state["kv_cache"],
           "drain_compaction": compaction,
           "slot_vectors": state["slot_vectors"],
           "prefill_and_logits": prefill + logits}
  return {"parts": parts, "total": sum(parts.values()), "mesh": sizes, "slots": slots,
          "cache_length": cache_length, "kv_pages": paged.get("kv_pages"),
          "page_size": paged.get("page_size")}



def compiled_peak_bytes(analysis) -> int:
  """A compiled program's peak bytes per device from XLA's memory analysis: its arguments,
  its outputs not aliased to (donated) arguments, and its temporaries."""
  return int(analysis.argument_size_in_bytes + analysis.output_size_in_bytes
             - analysis.alias_size_in_bytes + analysis.temp_size_in_bytes)


def compiled_memory(compiled) -> tuple[int, int]:
  """(peak bytes, temp bytes) per device of a compiled program (compiled_peak_bytes); (-1, -1)
  where the backend gives no memory analysis."""
  analysis = compiled.memory_analysis()
  if analysis is None:
    return -1, -1
  return compiled_peak_bytes(analysis), int(analysis.temp_size_in_bytes)


def slots_that_fit(run, cfg, gen_chips: int, memory_bytes: int, platform: str,
                   positions: float | None = None) -> int:
  """The most decode slots one generator of `gen_chips` chips holds within `memory_bytes` a chip,
  by this module's estimate: a multiple of its data axis, at most the run's
  engine.max_concurrent_decodes; 0 if none fits. positions: the cache positions a slot holds
  (None: the cache as the run's engine allocates it; a number: a paged cache's pages for that
  many positions per slot, e.g. the mean live length)."""
  data = mesh_sizes(run.devices.generator_mesh, gen_chips)["data"]
  cache = run.engine.max_prefill_length + run.sampling.max_new_tokens
  scale = 1.0 if positions is None else positions / cache

  def total(slots: int) -> float:
    r = dataclasses.replace(run, engine=dataclasses.replace(run.engine,
                                                            max_concurrent_decodes=slots))
    g = generator_bytes(r, cfg, platform, gen_chips)
    kv = g["parts"]["kv_cache"]
    if positions is None:
      return g["total"]
    # A cache holding the live positions is a paged one: no drain compaction beside it.
    return g["total"] - kv - g["parts"]["drain_compaction"] + kv * scale

  # Past 8 slots (one batched prefill's prompts) the bytes grow linearly with the slots.
  cap = run.engine.max_concurrent_decodes // data * data
  s1 = data * math.ceil(8 / data)
  t1 = total(s1)
  if t1 <= memory_bytes:
    per_slot = (total(s1 + data) - t1) / data
    n = min(cap, s1 + int((memory_bytes - t1) // per_slot) // data * data)
    # Nearly linear: a dense cache's drain compaction grows in steps. Settle on the exact edge.
    while n > s1 and total(n) > memory_bytes:
      n -= data
    while n + data <= cap and total(n + data) <= memory_bytes:
      n += data
    return n
  return max([s for s in range(data, s1, data) if total(s) <= memory_bytes], default=0)
