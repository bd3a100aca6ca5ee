"""The policy: a Mistral/Llama/Qwen-family decoder in Flax (linen), and its functional API.

Layers (model/layers.py) are stacked with `nn.scan`, so every layer parameter has a leading
'layers' axis, the compiled program holds one layer body (fast compiles), and the KV cache is one
[L, B, K, S, Dh] array per K and V (heads before positions, so a layer's slice is already in the
batch-major layout the attention matmuls read: no transpose per decode step). For decoding there
is also a per-layer form of both (`to_decode_layout`, `init_cache(per_layer=True)`): one array
per layer, so a step reads weights and cache where they lie instead of XLA:CPU copying each
layer's slice out of the stack, with each layer's keys stored transposed ([B, K, Dh, S]); the
generation engine uses it.

Two call modes share the same weights:
  (a) `hidden_states` / `token_logprobs`: training and scoring over packed rows. `positions` drive
      RoPE and `segment_ids` keep packed sequences from attending to each other (0 = padding).
      Log-probs of given targets are computed in sequence chunks, so the fp32 [B, T, V] logits
      are never all live at once (in the forward or, thanks to a checkpointed chunk body, in the
      backward).
  (b) `decode`: append T >= 1 tokens per slot to a KV cache with per-slot lengths (kv_cache.py).
      The engine's prefill is decode from an empty cache; its generate step is decode with
      T = 1, on a per-slot cache or on a paged one (one token per slot).

Params are a plain nested dict (see `param_logical_axes` for the layout and axis names):
  embed/embedding (V, D); layers/{attn_norm,mlp_norm}/scale (L, D);
  layers/attn/{q,k,v}_proj/kernel (L, D, H|K, Dh); layers/attn/o_proj/kernel (L, H, Dh, D);
  with cfg.attention_bias layers/attn/{q,k,v}_proj/bias (L, H|K, Dh), with cfg.o_proj_bias
  layers/attn/o_proj/bias (L, D), with cfg.qk_norm layers/attn/{q,k}_norm/scale (L, Dh);
  layers/mlp/{gate,up}_proj/kernel (L, D, F); layers/mlp/down_proj/kernel (L, F, D);
  final_norm/scale (D,); lm_head/kernel (D, V) unless embeddings are tied.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from magistral_jax.model import paged_attention
from magistral_jax.model.config import ModelConfig
from magistral_jax.model.kv_cache import (KVCache, PagedKVCache, cache_logical_axes,  # noqa: F401
                                          init_cache, init_paged_cache, is_per_layer_cache,
                                          paged_cache_logical_axes, stack_cache, unstack_cache)
from magistral_jax.model.layers import (DecodeLayer, DecoderLayer, RMSNorm, embed_tokens,
                                        logical_param)
from magistral_jax.parallel.sharding import ShardingCtx, is_logical_axes, param_shardings

Array = jax.Array


class Transformer(nn.Module):
  """Embedding -> L scanned decoder layers -> final RMSNorm. Returns hidden states; the output
  projection is applied by `logits` / `token_logprobs` so it can be chunked."""
  cfg: ModelConfig
  shard: ShardingCtx | None = None
  from_empty: bool = False   # decode into an empty cache (see layers.Attention)

  @nn.compact
  def __call__(self, tokens, positions, segment_ids=None, cache=None, write_index=None,
               valid_len=None):
    cfg = self.cfg
    emb = logical_param(self, "embedding", (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"),
                        nn.initializers.normal(1.0), cfg.jnp_param_dtype)
    if not cfg.tie_word_embeddings:
      # Declared here so init creates it; used through _head_matmul().
      logical_param(self, "lm_head", (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"),
                    nn.initializers.normal(0.02), cfg.jnp_param_dtype)
    x = embed_tokens(emb, tokens, cfg, self.shard)

    if cache is not None:
      stack = nn.scan(
          DecodeLayer, variable_axes={"params": 0}, split_rngs={"params": True},
          in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast),
          length=cfg.num_layers, metadata_params={nn.PARTITION_NAME: "layers"})
      (x, ck, cv), _ = stack(cfg, self.shard, self.from_empty, name="layers")(
          (x, *cache), jnp.arange(cfg.num_layers), positions, write_index, valid_len)
      return RMSNorm(cfg, name="final_norm")(x), (ck, cv)

    layer = DecoderLayer
    if cfg.remat != "none":
      policy = (jax.checkpoint_policies.dots_with_no_batch_dims_saveable
                if cfg.remat == "dots" else None)
      layer = nn.remat(DecoderLayer, prevent_cse=False, policy=policy)
    stack = nn.scan(
        layer, variable_axes={"params": 0}, split_rngs={"params": True},
        in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast),
        length=cfg.num_layers, metadata_params={nn.PARTITION_NAME: "layers"})
    x, new_cache = stack(cfg, self.shard, name="layers")(
        x, cache, positions, segment_ids, write_index, valid_len)
    x = RMSNorm(cfg, name="final_norm")(x)
    return x, new_cache


# Linen nests params as {'embedding': ...} at top level; we expose the documented layout.
def _to_module_params(params):
  p = dict(params)
  out = {"embedding": p["embed"]["embedding"], "layers": p["layers"],
         "final_norm": p["final_norm"]}
  if "lm_head" in p:
    out["lm_head"] = p["lm_head"]["kernel"]
  return {"params": out}


def _from_module_params(variables):
  v = variables["params"]
  out = {"embed": {"embedding": v["embedding"]}, "layers": v["layers"],
         "final_norm": v["final_norm"]}
  if "lm_head" in v:
    out["lm_head"] = {"kernel": v["lm_head"]}
  return out


# ----------------------------------------------------------------------------------------------
# Functional API
# ----------------------------------------------------------------------------------------------
def _abstract_boxed(cfg: ModelConfig):
  model = Transformer(cfg)
  tokens = jnp.zeros((1, 1), jnp.int32)
  return jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), tokens, tokens))


def init_params(cfg: ModelConfig, rng: Array) -> dict:
  """Random params (normal(0.02) projections, unit norms)."""
  tokens = jnp.zeros((1, 1), jnp.int32)
  variables = Transformer(cfg).init(rng, tokens, tokens)
  return _from_module_params(nn.meta.unbox(variables))


def param_logical_axes(cfg: ModelConfig) -> dict:
  """Tree (same structure as params) of logical axis-name tuples for every parameter."""
  specs = nn.get_partition_spec(_abstract_boxed(cfg))
  specs = jax.tree.map(lambda s: tuple(s), specs, is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec))
  return _from_module_params(specs)


def param_shapes(cfg: ModelConfig) -> dict:
  """Tree of ShapeDtypeStructs for the params (no allocation)."""
  return _from_module_params(nn.meta.unbox(_abstract_boxed(cfg)))


def params_on(cfg: ModelConfig, mesh, rules) -> dict:
  """Tree of each parameter's NamedSharding on `mesh` by `rules` (its logical axes; a dimension
  a mesh axis does not divide stays whole): where a loader or the trainer puts it."""
  return param_shardings(param_logical_axes(cfg), mesh, rules, shapes_tree=param_shapes(cfg))


def hidden_states(params, cfg: ModelConfig, tokens, positions=None, segment_ids=None,
                  shard: ShardingCtx | None = None) -> Array:
  """Packed training/scoring forward: [B, T] tokens -> [B, T, D] final hidden states."""
  if positions is None:
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
  x, _ = Transformer(cfg, shard).apply(_to_module_params(params), tokens, positions, segment_ids)
  return x


def _head_matmul(params, cfg: ModelConfig, hidden: Array, lo: int = 0, hi: int | None = None):
  """fp32 logits of vocab entries [lo, hi) from hidden [..., D]. A tied embedding [V, D] is
  contracted on D directly (its rows [lo, hi) are contiguous), never transposed."""
  x = hidden.astype(cfg.jnp_dtype)
  if cfg.tie_word_embeddings:
    e = params["embed"]["embedding"][lo:hi].astype(cfg.jnp_dtype)
    return jnp.einsum("...d,vd->...v", x, e).astype(jnp.float32)
  w = params["lm_head"]["kernel"][:, lo:hi].astype(cfg.jnp_dtype)
  return jnp.einsum("...d,dv->...v", x, w).astype(jnp.float32)


def logits(params, cfg: ModelConfig, hidden: Array) -> Array:
  """Full fp32 logits [..., V]. Prefer `token_logprobs` for training (chunked)."""
  return _head_matmul(params, cfg, hidden)


def forward_logits(params, cfg: ModelConfig, tokens, positions=None, segment_ids=None,
                   shard: ShardingCtx | None = None) -> Array:
  return logits(params, cfg, hidden_states(params, cfg, tokens, positions, segment_ids, shard))


def vocab_pieces(cfg: ModelConfig) -> list[tuple[int, int]]:
  """The [lo, hi) vocab ranges the log-prob head works on (cfg.logits_vocab_pieces; 0 = auto:
  4 on the CPU backend, 1 elsewhere). On CPU, XLA runs the pieces' independent matmul and
  logsumexp ops on different cores, where one [T, V] logsumexp would run on a single core
  (docs/design_notes.md). On accelerators one piece keeps a
  vocab-sharded head free of resharding."""
  n = cfg.logits_vocab_pieces or (4 if jax.default_backend() == "cpu" else 1)
  n = max(1, min(n, cfg.vocab_size))
  v = cfg.vocab_size
  return [(j * v // n, (j + 1) * v // n) for j in range(n)]


def token_logprobs(params, cfg: ModelConfig, hidden: Array, targets: Array,
                   temperature: float = 1.0, with_entropy: bool = False):
  """log π(target_t | ·) for every position, from hidden states [B, T, D] and targets [B, T].

  π is softmax(logits / temperature) (temperature 1.0 = the raw policy); the generator computes its
  sampled-token log-probs from the same logits formula (lg / T - logsumexp, fp32), so π_old and
  π_θ are the same quantity.
  The sequence is processed in chunks of cfg.logits_chunk with a checkpointed body, so the fp32
  logits of only one chunk are live at a time, and the entropy (when requested) comes from the
  same logits pass rather than a second one. Within a chunk the vocab is split into
  `vocab_pieces(cfg)` ranges whose logsumexps are combined exactly (log Σ_j exp(lse_j)); the
  target's logit is read from the piece that holds it.
  Returns logprobs [B, T] (and entropy [B, T] if with_entropy)."""
  b, t, d = hidden.shape
  chunk = min(cfg.logits_chunk, t)
  n = -(-t // chunk)
  pad = n * chunk - t
  pieces = vocab_pieces(cfg)
  h = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0))).reshape(b, n, chunk, d).swapaxes(0, 1)
  y = jnp.pad(targets, ((0, 0), (0, pad))).reshape(b, n, chunk).swapaxes(0, 1)

  @jax.checkpoint
  def body(hc, yc):
    lgs, lses, target = [], [], jnp.zeros(yc.shape, jnp.float32)
    for lo, hi in pieces:
      lg = _head_matmul(params, cfg, hc, lo, hi) / temperature
      lgs.append(lg)
      lses.append(jax.nn.logsumexp(lg, axis=-1))
      at = jnp.take_along_axis(lg, jnp.clip(yc - lo, 0, hi - lo - 1)[..., None], axis=-1)[..., 0]
      target = jnp.where((yc >= lo) & (yc < hi), at, target)
    lse = lses[0] if len(pieces) == 1 else jax.nn.logsumexp(jnp.stack(lses, -1), axis=-1)
    lp = target - lse
    if not with_entropy:
      return lp, jnp.zeros_like(lp)
    # H = Σ_v p_v · (lse - lg_v), summed piece by piece: every term is >= 0, so a peaked
    # distribution with large logits does not lose its entropy to lse - Σ p·lg cancellation.
    ent = sum(jnp.sum(jnp.exp(lg - lse[..., None]) * (lse[..., None] - lg), axis=-1)
              for lg in lgs)
    return lp, ent

  lp, ent = jax.lax.map(lambda xs: body(*xs), (h, y))
  lp = lp.swapaxes(0, 1).reshape(b, n * chunk)[:, :t]
  if not with_entropy:
    return lp
  return lp, ent.swapaxes(0, 1).reshape(b, n * chunk)[:, :t]


# ----------------------------------------------------------------------------------------------
# Decode layout: one array per layer
# ----------------------------------------------------------------------------------------------
# The stacked layout (a leading 'layers' axis, read by nn.scan) suits training: one layer body in
# the program, fast compiles. A decode step, though, is a matrix-vector product per weight, bound
# by how fast the weights stream from memory; and on XLA:CPU the scan's per-layer dynamic slice of
# a stacked weight is a copy, so every weight is read, written and read again each step
# (most of a small model's step: docs/design_notes.md). In the decode layout
# params['layers'] is a tuple of per-layer trees (the same arrays without the leading axis);
# `decode` unrolls the layers over them and every weight is read once per step. The generation
# engine holds its weights this way (converted once per load / weight push).
def is_decode_layout(params) -> bool:
  return isinstance(params["layers"], (tuple, list))


def to_decode_layout(params) -> dict:
  """Stacked params -> decode layout (params['layers'] a tuple of per-layer trees). Copies each
  layer out of the stack (inside jit: one program, outputs laid out by its out_shardings)."""
  if is_decode_layout(params):
    return params
  n = jax.tree.leaves(params["layers"])[0].shape[0]
  out = dict(params)
  out["layers"] = tuple(jax.tree.map(lambda x, l=l: x[l], params["layers"]) for l in range(n))
  return out


def to_stacked_layout(params) -> dict:
  """Decode layout -> the stacked layout (the inverse of to_decode_layout)."""
  if not is_decode_layout(params):
    return params
  out = dict(params)
  out["layers"] = jax.tree.map(lambda *xs: jnp.stack(xs), *params["layers"])
  return out


def decode_layout_tree(stacked_tree, num_layers: int) -> dict:
  """Maps a stacked-layout tree of per-leaf metadata (logical axes, ShapeDtypeStructs) to the
  decode layout: each leaf loses its leading 'layers' entry, repeated for every layer."""
  def drop(x):
    if isinstance(x, jax.ShapeDtypeStruct):
      return jax.ShapeDtypeStruct(x.shape[1:], x.dtype)
    return tuple(x)[1:]
  out = dict(stacked_tree)
  per_layer = jax.tree.map(drop, stacked_tree["layers"], is_leaf=is_logical_axes)
  out["layers"] = tuple(per_layer for _ in range(num_layers))
  return out


def _decode_unrolled(params, cfg, tokens, positions, cache, valid, shard, window=None,
                     from_empty=False, paged=None):
  """Transformer.__call__ in decode mode over decode-layout params: the same embedding, layer
  module and final norm, with the layer loop unrolled over per-layer weights."""
  carry = (embed_tokens(params["embed"]["embedding"], tokens, cfg, shard), cache.k, cache.v)
  for l, layer_params in enumerate(params["layers"]):
    carry, _ = DecodeLayer(cfg, shard, from_empty).apply(
        {"params": layer_params}, carry, l, positions, cache.lengths, valid, window, paged)
  x, k, v = carry
  return RMSNorm(cfg).apply({"params": params["final_norm"]}, x), (k, v)


def decode(params, cfg: ModelConfig, tokens: Array, cache: KVCache,
           shard: ShardingCtx | None = None, num_new: Array | None = None,
           window: int | None = None, from_empty: bool = False,
           paged: str | None = None):
  """Appends `tokens` [B, T] to each slot at its own offset cache.lengths[b] and returns
  (hidden [B, T, D], new cache). Token t of slot b sits at position lengths[b] + t.
  `params` may be stacked or in the decode layout (to_decode_layout; the faster one to decode
  with on CPU); the results are the same.

  `num_new` [B] (default T) says how many of the T tokens are real per slot: the new lengths are
  lengths + num_new, so padding written past a prompt's true length is overwritten later (this is
  how a padded prefill sets a slot to its true length).

  `window` (a static int, decode-layout params only) restricts attention to the first `window`
  cache positions: a step then reads that much of every slot's cache instead of all of it. The
  caller must keep lengths[b] + T <= window for every slot whose output it uses (others read a
  truncated prefix, which is harmless when their output is dropped); the new keys and values are
  written into the whole cache as usual. The generation engine picks the smallest of its
  attention windows that holds its active slots (Engine.window_for).

  `from_empty` (static) promises that the cache holds nothing yet (every length 0), as in a
  prefill from scratch: the tokens then attend only to each other, with the masks of the
  training forward, which the accelerators' flash kernels take (model/attention.py). The
  results are those without it."""
  b, t = tokens.shape
  positions = cache.lengths[:, None] + jnp.arange(t)[None, :]
  valid = cache.lengths + t
  if isinstance(cache, PagedKVCache):
    return _decode_paged(params, cfg, tokens, cache, shard, num_new, paged)
  if window is not None and not 1 <= window:
    raise ValueError(f"attention window must be >= 1, got {window}")
  if is_decode_layout(params):
    if is_per_layer_cache(cache):
      cache = cache._replace(k=tuple(cache.k), v=tuple(cache.v))
    else:
      window = None   # a stacked cache is read whole (this path is for tests and tools)
    x, (k, v) = _decode_unrolled(params, cfg, tokens, positions, cache, valid, shard, window,
                                 from_empty)
  else:
    if window is not None:
      raise ValueError("an attention window needs decode-layout params (to_decode_layout)")
    per_layer = is_per_layer_cache(cache)
    stacked = stack_cache(cache)
    x, (k, v) = Transformer(cfg, shard, from_empty).apply(
        _to_module_params(params), tokens, positions, None, (stacked.k, stacked.v),
        cache.lengths, valid)
    if per_layer:
      pl = unstack_cache(KVCache(k, v, cache.lengths))
      k, v = pl.k, pl.v
  new_len = cache.lengths + (t if num_new is None else num_new)
  return x, KVCache(k, v, new_len.astype(jnp.int32))


def _decode_paged(params, cfg: ModelConfig, tokens: Array, cache: PagedKVCache, shard,
                  num_new: Array | None, paged: str | None):
  """`decode` of one token per slot on a PagedKVCache; `paged`: the attention's implementation
  (paged_attention.IMPLS). A slot with num_new 0 (idle) writes nowhere it owns and reads
  nothing."""
  b, t = tokens.shape
  if t != 1 or not is_decode_layout(params) or paged is None:
    raise ValueError("a paged KV cache takes decode steps only: one token per slot, "
                     "decode-layout params and paged=<one of paged_attention.IMPLS>")
  if cfg.sliding_window is not None and cfg.sliding_window < cache.page_table.shape[1] * \
      cache.k[0].shape[2]:
    raise ValueError(f"a paged KV cache attends to every live position; sliding_window="
                     f"{cfg.sliding_window} is shorter than a slot's pages")
  live = jnp.ones((b,), bool) if num_new is None else num_new > 0
  step = paged_attention.PagedStep(cache.page_table, jnp.where(live, cache.lengths, -1),
                                   jnp.where(live, cache.lengths + 1, 0), paged)
  positions = cache.lengths[:, None]
  x, (k, v) = _decode_unrolled(params, cfg, tokens, positions, cache, cache.lengths + 1, shard,
                               paged=step)
  new_len = cache.lengths + live.astype(jnp.int32)
  return x, cache._replace(k=k, v=v, lengths=new_len)


def decode_logits(params, cfg: ModelConfig, tokens, cache: KVCache, shard=None, num_new=None):
  x, cache = decode(params, cfg, tokens, cache, shard, num_new)
  return logits(params, cfg, x), cache
