"""The decoder's building blocks in Flax (linen): RoPE, RMSNorm, attention (with the optional
q/k/v(/o) biases and per-head q/k norm of the Qwen architectures), SwiGLU MLP and the
two scan bodies (training/scoring and decode) that model/transformer.py stacks over layers.

KV cache layouts the attention reads and writes (see model/transformer.py's KVCache): the
stacked cache is one [L, B, K, S, Dh] array per K and V (heads before positions, so a layer's
slice is already in the batch-major layout the attention matmuls read: no transpose per decode
step); the per-layer cache is one array per layer, with each layer's keys stored transposed
([B, K, Dh, S]).
"""
from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from magistral_jax.model.attention import attend, cache_spec, packed_spec
from magistral_jax.model.decode_choice import decode_impl, live_decode
from magistral_jax.model import paged_attention
from magistral_jax.model.config import ModelConfig
from magistral_jax.parallel.sharding import ShardingCtx, constrain

Array = jax.Array


# ----------------------------------------------------------------------------------------------
# RoPE
# ----------------------------------------------------------------------------------------------
def rope_inv_freq(cfg: ModelConfig) -> Array:
  """Inverse frequencies theta^(-2i/Dh), with llama3-style scaling when configured.

  llama3 scaling: wavelengths longer than orig_ctx/low_freq_factor are divided by `factor`,
  shorter than orig_ctx/high_freq_factor are kept, and the band in between is interpolated
  smoothly: (1-s)·f/factor + s·f with s = (orig_ctx/wavelen - low)/(high - low)."""
  dh = cfg.head_dim
  inv_freq = 1.0 / (cfg.rope_theta ** (jnp.arange(0, dh, 2, dtype=jnp.float32) / dh))
  rs = cfg.rope_scaling
  if rs is None:
    return inv_freq
  orig = rs.original_max_position_embeddings
  low_wavelen = orig / rs.low_freq_factor
  high_wavelen = orig / rs.high_freq_factor
  wavelen = 2 * math.pi / inv_freq
  scaled = jnp.where(wavelen > low_wavelen, inv_freq / rs.factor, inv_freq)
  smooth = (orig / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
  smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
  medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
  return jnp.where(medium, smoothed, scaled)


def apply_rope(x: Array, positions: Array, inv_freq: Array) -> Array:
  """x: [B, T, N, Dh], positions: [B, T]. Half-split (rotate_half) layout, as in HF Llama."""
  angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, Dh/2]
  cos = jnp.cos(angles)[:, :, None, :]
  sin = jnp.sin(angles)[:, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


def _write_kv(cache: Array, new: Array, layer, write_index: Array,
              positions_last: bool = False) -> Array:
  """cache[layer, b, :, write_index[b] + t] = new[b, t] for the stacked cache [L, B, K, S, Dh]
  (or cache[b, :, write_index[b] + t] for one layer's cache [B, K, S, Dh] when layer is None;
  or cache[b, :, :, write_index[b] + t] for one layer's transposed keys [B, K, Dh, S] when
  positions_last) and new [B, T, K, Dh]. A scatter rather than a per-slot dynamic_update_slice:
  writes past S are dropped (a DUS would clamp its start and overwrite earlier entries), and a
  scatter into a loop carry or a donated buffer is done in place."""
  b, t = new.shape[:2]
  rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
  cols = write_index[:, None] + jnp.arange(t)[None, :]
  # The advanced indices ([layer,] rows, cols) are split by the K (and Dh) slices, so the indexed
  # block is [B, T, K, Dh]: exactly `new`.
  if positions_last:
    idx = (rows, slice(None), slice(None), cols)
  else:
    idx = (rows, slice(None), cols) if layer is None else (layer, rows, slice(None), cols)
  return cache.at[idx].set(new.astype(cache.dtype), mode="drop", indices_are_sorted=True,
                           unique_indices=True)


# ----------------------------------------------------------------------------------------------
# Modules
# ----------------------------------------------------------------------------------------------
def logical_param(module: nn.Module, name: str, shape, axes, init, dtype):
  """A parameter annotated with its logical axis names (param_logical_axes reads them)."""
  return module.param(name, nn.with_logical_partitioning(init, axes), shape, dtype)


class Kernel(nn.Module):
  """Holds one projection weight as {'kernel': ...}, the layout HF conversion maps onto."""
  shape: tuple
  axes: tuple
  dtype: Any

  @nn.compact
  def __call__(self):
    return logical_param(self, "kernel", self.shape, self.axes, nn.initializers.normal(0.02),
                         self.dtype)


class Projection(nn.Module):
  """An attention projection: {'kernel'} and, when `bias`, a {'bias'} over the kernel's last
  `out_rank` axes (its outputs), the layout HF conversion maps onto. Applies `spec` (an einsum
  of the input and the kernel) in the compute dtype."""
  shape: tuple
  axes: tuple
  cfg: ModelConfig
  out_rank: int
  bias: bool = False

  @nn.compact
  def __call__(self, x, spec: str):
    dt, pdt = self.cfg.jnp_dtype, self.cfg.jnp_param_dtype
    w = logical_param(self, "kernel", self.shape, self.axes, nn.initializers.normal(0.02), pdt)
    y = jnp.einsum(spec, x, w.astype(dt))
    if self.bias:
      b = logical_param(self, "bias", self.shape[-self.out_rank:], self.axes[-self.out_rank:],
                        nn.initializers.zeros, pdt)
      y = y + b.astype(dt)
    return y


class RMSNorm(nn.Module):
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x):
    scale = logical_param(self, "scale", (x.shape[-1],), ("norm",), nn.initializers.ones,
                   self.cfg.jnp_param_dtype)
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.cfg.rms_norm_eps)
    # HF casts back to the input dtype before the scale multiply; keep the same order.
    return scale.astype(self.cfg.jnp_dtype) * xf.astype(self.cfg.jnp_dtype)


class Attention(nn.Module):
  """Grouped-query attention with explicit head_dim and an optional sliding window; the core
  (dense, blockwise, cuDNN or Pallas: cfg.attention_impl) is model/attention.py's.
  `from_empty`: a promise that the KV cache holds nothing yet (every slot's length is 0), so the
  new tokens attend only to each other, as in training; the kernels that take only that mask
  then apply to prefill."""
  cfg: ModelConfig
  shard: ShardingCtx | None = None
  from_empty: bool = False

  @nn.compact
  def __call__(self, x, positions, q_segment, kv_cache=None, write_index=None, valid_len=None,
               layer=None, window=None, paged=None):
    cfg, dt = self.cfg, self.cfg.jnp_dtype
    d, h, k, dh = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    qkv_bias = cfg.attention_bias
    x = x.astype(dt)
    q = Projection((d, h, dh), ("embed", "heads", "head_dim"), cfg, 2, qkv_bias,
                   name="q_proj")(x, "btd,dhk->bthk")
    kk = Projection((d, k, dh), ("embed", "kv_heads", "head_dim"), cfg, 2, qkv_bias,
                    name="k_proj")(x, "btd,dhk->bthk")
    v = Projection((d, k, dh), ("embed", "kv_heads", "head_dim"), cfg, 2, qkv_bias,
                   name="v_proj")(x, "btd,dhk->bthk")
    if cfg.qk_norm:   # Qwen3: each head's query and key normalised over head_dim, before RoPE
      q = RMSNorm(cfg, name="q_norm")(q)
      kk = RMSNorm(cfg, name="k_norm")(kk)
    q = constrain(self.shard, q, ("act_batch", "act_length", "act_heads", None))
    inv_freq = rope_inv_freq(cfg)
    q = apply_rope(q, positions, inv_freq)
    kk = apply_rope(kk, positions, inv_freq)

    new_cache, keys_t, out = None, False, None
    if paged is not None:
      # A decode step on a paged cache (kv_cache: this layer's page pools, [K, pages, page_size,
      # Dh]): the new token is written into its slot's page and each slot reads only the pages
      # it has filled (model/paged_attention.py).
      out, ck, cv = paged_attention.decode_step(q[:, 0], kk[:, 0], v[:, 0], *kv_cache, paged,
                                                self.shard)
      out, new_cache = out[:, None], (ck, cv)
    elif kv_cache is not None:
      # Decode: kv_cache is either the whole stacked cache [L, B, K, S, Dh] (the scan carry;
      # `layer` indexes it) or, with layer=None, this layer's own cache (the per-layer cache of
      # the decode layout: keys transposed, [B, K, Dh, S], values [B, K, S, Dh]). Only the T new
      # keys/values are scattered in, at each slot's own offset, so XLA updates the (donated)
      # cache in place; then this layer's keys and values are read for attention over the
      # prefix. From a stacked cache that read is a slice, which XLA:CPU materialises as a copy
      # of the layer's whole cache every step; a per-layer cache is read where it lies.
      ck, cv = kv_cache
      per_layer = layer is None   # a per-layer cache holds its keys transposed
      ck = _write_kv(ck, kk, layer, write_index, positions_last=per_layer)
      cv = _write_kv(cv, v, layer, write_index)
      new_cache = (ck, cv)
    if paged is not None:
      pass   # attended above
    elif kv_cache is None or self.from_empty:
      # Packed training / scoring, or prefill into an empty cache (the new tokens are all there
      # is to attend to): causal within a row, never across segments.
      if kv_cache is not None:   # the values read back from the cache: rounded to its dtype
        kk, v = kk.astype(ck.dtype).astype(dt), v.astype(cv.dtype).astype(dt)
      keys, values = kk.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, K, T, Dh]
      spec = packed_spec(positions, q_segment)
    else:
      keys_t = per_layer
      if per_layer and q.shape[1] == 1 and decode_impl(cfg, q, cv.shape[2]) == "live":
        # A decode step: each slot reads only the positions it has reached (decode_live.py),
        # the new token's own and those before it; the engine's window needs no slice here.
        # A prefill continuing a cached prefix (T > 1) stays with XLA's attention.
        n = jnp.minimum(positions[:, 0] + 1, valid_len)
        out = live_decode(q, ck, cv, n, self.shard)
        if out is None and cfg.decode_attention == "live":
          raise ValueError("decode_attention='live': this mesh splits the query heads and the "
                           "KV heads differently, or a cache's length or head_dim; use 'auto'")
      if out is None:
        keys, values = _read_cache(ck, cv, layer, window, dt)
        spec = cache_spec(positions, valid_len, values.shape[2])
    if out is None:
      out = attend(q, keys, values, spec, cfg, keys_t=keys_t,
                   self_only=kv_cache is None or self.from_empty, shard=self.shard)
    out = constrain(self.shard, out, ("act_batch", "act_length", "act_heads", None))
    y = Projection((h, dh, d), ("heads", "head_dim", "embed"), cfg, 1, cfg.o_proj_bias,
                   name="o_proj")(out, "bthk,hkd->btd")
    return y, new_cache


def _read_cache(ck, cv, layer, window, dt):
  """This layer's keys and values for XLA's decode attention: a per-layer cache (layer None)
  where it lies, cut to the engine's attention window, or the layer's slice of a stacked one."""
  if layer is None:
    keys, values = ck.astype(dt), cv.astype(dt)
    if window is not None and window < values.shape[2]:
      # Attend over the first `window` positions only (see `decode`): the caller keeps every
      # slot's new positions below it, so the rest of the cache is masked anyway.
      keys, values = keys[..., :window], values[:, :, :window]
    return keys, values
  return (jax.lax.dynamic_index_in_dim(ck, layer, keepdims=False).astype(dt),
          jax.lax.dynamic_index_in_dim(cv, layer, keepdims=False).astype(dt))


class MLP(nn.Module):
  """SwiGLU: down(silu(gate(x)) * up(x))."""
  cfg: ModelConfig
  shard: ShardingCtx | None = None

  @nn.compact
  def __call__(self, x):
    cfg, dt = self.cfg, self.cfg.jnp_dtype
    pdt = cfg.jnp_param_dtype
    d, f = cfg.hidden_size, cfg.intermediate_size
    wg = Kernel((d, f), ("embed", "mlp"), pdt, name="gate_proj")()
    wu = Kernel((d, f), ("embed", "mlp"), pdt, name="up_proj")()
    wd = Kernel((f, d), ("mlp", "embed"), pdt, name="down_proj")()
    x = x.astype(dt)
    hidden = jax.nn.silu(x @ wg.astype(dt)) * (x @ wu.astype(dt))
    hidden = constrain(self.shard, hidden, ("act_batch", "act_length", "act_mlp"))
    return hidden @ wd.astype(dt)


class DecoderLayer(nn.Module):
  """One pre-norm block; the scan body. carry = residual stream, xs = this layer's KV cache."""
  cfg: ModelConfig
  shard: ShardingCtx | None = None

  @nn.compact
  def __call__(self, x, layer_cache, positions, segment_ids, write_index, valid_len):
    h, new_cache = Attention(self.cfg, self.shard, name="attn")(
        RMSNorm(self.cfg, name="attn_norm")(x), positions, segment_ids, layer_cache,
        write_index, valid_len)
    x = x + h
    x = x + MLP(self.cfg, self.shard, name="mlp")(RMSNorm(self.cfg, name="mlp_norm")(x))
    x = constrain(self.shard, x, ("act_batch", "act_length", "act_embed"))
    return x, new_cache


class DecodeLayer(nn.Module):
  """The decode-mode scan body: same submodules (so the same params) as DecoderLayer, but the
  carry holds the whole stacked KV cache next to the residual stream and xs is the layer index,
  so each layer writes only its new entries into the cache (see Attention, also for
  `from_empty`)."""
  cfg: ModelConfig
  shard: ShardingCtx | None = None
  from_empty: bool = False

  @nn.compact
  def __call__(self, carry, layer, positions, write_index, valid_len, window=None, paged=None):
    x, ck, cv = carry
    attn = Attention(self.cfg, self.shard, self.from_empty, name="attn")
    xn = RMSNorm(self.cfg, name="attn_norm")(x)
    if isinstance(ck, tuple):   # per-layer cache (unrolled decode): `layer` is a Python int
      h, (k_l, v_l) = attn(xn, positions, None, (ck[layer], cv[layer]), write_index, valid_len,
                           window=window, paged=paged)
      ck = ck[:layer] + (k_l,) + ck[layer + 1:]
      cv = cv[:layer] + (v_l,) + cv[layer + 1:]
    else:
      h, (ck, cv) = attn(xn, positions, None, (ck, cv), write_index, valid_len, layer)
    x = x + h
    x = x + MLP(self.cfg, self.shard, name="mlp")(RMSNorm(self.cfg, name="mlp_norm")(x))
    x = constrain(self.shard, x, ("act_batch", "act_length", "act_embed"))
    return (x, ck, cv), None


def embed_tokens(embedding, tokens, cfg: ModelConfig, shard):
  """Token embedding lookup in the compute dtype, laid out as an activation."""
  x = jnp.take(embedding, tokens, axis=0).astype(cfg.jnp_dtype)
  return constrain(shard, x, ("act_batch", "act_length", "act_embed"))
