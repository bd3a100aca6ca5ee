"""Attention implementations against the dense reference: blockwise (packed rows, caches, the
model's logits, gradients and prefill), the accelerator kernels' calls, the dispatch, and the
blockwise path's linear memory."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from magistral_jax.model import attention as A
from magistral_jax.model import transformer as T
from magistral_jax.model.blockwise_attention import blockwise_attention
from magistral_jax.model.config import ModelConfig

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2}


def _packed_rows(b, t, rng):
  """Segment ids (several sequences per row, padding 0 at the end of row 0) and positions that
  restart with every segment."""
  seg = np.ones((b, t), np.int32)
  seg[0, t // 4:t // 2], seg[0, t // 2:3 * t // 4], seg[0, 3 * t // 4:] = 2, 3, 0
  seg[1:, 2 * t // 3:] = 2
  pos = np.zeros((b, t), np.int32)
  for r in range(b):
    for i in range(1, t):
      pos[r, i] = 0 if seg[r, i] != seg[r, i - 1] else pos[r, i - 1] + 1
  return jnp.asarray(seg), jnp.asarray(pos)


def _qkv(rng, b, t, s, h, k, dh, dtype):
  q = jnp.asarray(rng.randn(b, t, h, dh), dtype)
  keys = jnp.asarray(rng.randn(b, k, s, dh), dtype)
  values = jnp.asarray(rng.randn(b, k, s, dh), dtype)
  return q, keys, values


def _outputs_and_grads(fn, q, keys, values, ct):
  out, vjp = jax.vjp(fn, q, keys, values)
  return (out,) + vjp(ct)


def _assert_close(got, want, dtype):
  for g, w in zip(got, want):
    g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
    assert np.max(np.abs(g - w)) <= TOL[dtype] * max(1.0, np.max(np.abs(w)))


@pytest.mark.parametrize("dtype,window,heads,blocks", [
    (jnp.float32, None, (4, 2), (8, 16)),
    (jnp.float32, 5, (8, 2), (16, 8)),    # sliding window, GQA ratio 4
    (jnp.bfloat16, None, (4, 2), (16, 8)),
    (jnp.bfloat16, 7, (4, 4), (8, 8)),    # no grouping
])
def test_blockwise_equals_dense_on_packed_rows(dtype, window, heads, blocks):
  """Several segments per row, padding, T = 37 (a multiple of no block): outputs and the
  gradients of q, k and v."""
  rng = np.random.RandomState(0)
  h, k = heads
  q, keys, values = _qkv(rng, 2, 37, 37, h, k, 8, dtype)
  spec = A.packed_spec(*_packed_rows(2, 37, rng)[::-1])
  ct = jnp.asarray(rng.randn(*q.shape), dtype)
  dense = _outputs_and_grads(
      lambda q, k, v: A.dense_attention(q, k, v, A.dense_mask(spec, window), False),
      q, keys, values, ct)
  blockwise = _outputs_and_grads(
      lambda q, k, v: blockwise_attention(q, k, v, spec, window=window, block_q=blocks[0],
                                          block_k=blocks[1]), q, keys, values, ct)
  assert all(x.dtype == dtype for x in blockwise)
  _assert_close(blockwise, dense, dtype)


@pytest.mark.parametrize("keys_t,window", [(False, None), (True, None), (True, 6)])
def test_blockwise_equals_dense_over_a_cache(keys_t, window):
  """Prefill continuing cached prefixes of different lengths (0, 5, 13): new tokens at
  positions lengths + t over a 32-position cache whose tail past each slot's length holds
  junk."""
  rng = np.random.RandomState(1)
  q, keys, values = _qkv(rng, 3, 9, 32, 4, 2, 8, jnp.float32)
  lengths = jnp.asarray([0, 5, 13], jnp.int32)
  spec = A.cache_spec(lengths[:, None] + jnp.arange(9), lengths + 9, 32)
  if keys_t:
    keys = keys.swapaxes(-1, -2)
  dense = A.dense_attention(q, keys, values, A.dense_mask(spec, window), keys_t)
  blockwise = blockwise_attention(q, keys, values, spec, window=window, block_q=4, block_k=8,
                                  keys_t=keys_t)
  _assert_close([blockwise], [dense], jnp.float32)


def _tiny(**kw):
  base = dict(vocab_size=101, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
              num_kv_heads=2, head_dim=8, attention_block_q=8, attention_block_k=16)
  base.update(kw)
  return ModelConfig(**base)


def _logits_and_grads(cfg, params, tokens, pos, seg, shard=None):
  """The model's logits on packed rows and the gradient of their tokens' log-probs."""
  def loss(p):
    h = T.hidden_states(p, cfg, tokens, pos, seg, shard=shard)
    return jnp.sum(T.token_logprobs(p, cfg, h, jnp.roll(tokens, -1, 1)) * (seg > 0))
  return jax.jit(lambda p: (T.forward_logits(p, cfg, tokens, pos, seg, shard=shard),
                            jax.grad(loss)(p)))(params)


def _assert_model_close(got, want):
  (lg_g, g_g), (lg_w, g_w) = got, want
  assert np.max(np.abs(np.asarray(lg_g) - np.asarray(lg_w))) < 1e-4
  for a, b in zip(jax.tree.leaves(g_g), jax.tree.leaves(g_w)):
    assert np.max(np.abs(np.asarray(a) - np.asarray(b))) < 1e-4 * max(1.0, np.max(np.abs(b)))


@pytest.mark.parametrize("window,remat", [(None, "none"), (6, "full")])
def test_model_logits_and_gradients_blockwise_equal_dense(window, remat):
  rng = np.random.RandomState(2)
  seg, pos = _packed_rows(2, 37, rng)
  tokens = jnp.asarray(rng.randint(0, 101, (2, 37)))
  dense_cfg = _tiny(sliding_window=window, attention_impl="dense", remat=remat)
  params = T.init_params(dense_cfg, jax.random.PRNGKey(0))
  _assert_model_close(
      _logits_and_grads(dense_cfg.replace(attention_impl="blockwise"), params, tokens, pos, seg),
      _logits_and_grads(dense_cfg, params, tokens, pos, seg))


def test_blockwise_forward_on_2x4_mesh_equals_unsharded():
  from magistral_jax.parallel.sharding import ShardingCtx, make_mesh, param_shardings
  cfg = _tiny(num_kv_heads=4, attention_impl="blockwise")
  params = T.init_params(cfg, jax.random.PRNGKey(0))
  rng = np.random.RandomState(6)
  seg, pos = _packed_rows(4, 37, rng)
  tokens = jnp.asarray(rng.randint(0, 101, (4, 37)))
  ref = T.forward_logits(params, cfg.replace(attention_impl="dense"), tokens, pos, seg)
  shard = ShardingCtx(make_mesh({"fsdp": 2, "tensor": 4}))
  sharded = jax.device_put(params, param_shardings(T.param_logical_axes(cfg), shard.mesh,
                                                   shapes_tree=params))
  rows = shard.sharding(("act_batch", None))
  fwd = jax.jit(lambda p, t, q, s: T.forward_logits(p, cfg, t, q, s, shard=shard))
  got = fwd(sharded, *(jax.device_put(x, rows) for x in (tokens, pos, seg)))
  np.testing.assert_allclose(got, ref, atol=1e-4)


@pytest.mark.parametrize("window", [None, 9])
def test_prefill_and_continued_prefill_blockwise_equal_dense(window):
  """A prompt prefilled from an empty cache, then continued from its cached prefix (the
  engine's prefix caching), in the decode layout with per-layer caches: the logits of every
  new token under blockwise equal dense, and from_empty changes nothing."""
  rng = np.random.RandomState(3)
  first = jnp.asarray(rng.randint(0, 101, (2, 19)))
  more = jnp.asarray(rng.randint(0, 101, (2, 21)))
  dense_cfg = _tiny(sliding_window=window, attention_impl="dense")
  params = T.to_decode_layout(T.init_params(dense_cfg, jax.random.PRNGKey(1)))

  def run(cfg, from_empty):
    cache = T.init_cache(cfg, 2, 48, per_layer=True)
    h1, cache = T.decode(params, cfg, first, cache, num_new=jnp.asarray([19, 14]),
                         from_empty=from_empty)
    h2, cache = T.decode(params, cfg, more, cache)
    return T.logits(params, cfg, h1), T.logits(params, cfg, h2)

  ref = run(dense_cfg, False)
  for cfg, from_empty in [(dense_cfg, True), (dense_cfg.replace(attention_impl="blockwise"), True),
                          (dense_cfg.replace(attention_impl="blockwise"), False)]:
    got = run(cfg, from_empty)
    for g, r in zip(got, ref):
      assert np.max(np.abs(np.asarray(g) - np.asarray(r))) < 1e-4


def _choose(requested="auto", **kw):
  args = dict(platform="cpu", dtype=jnp.bfloat16, head_dim=128, q_len=4096, kv_len=4096,
              segments=False, self_only=True, window=None, block_q=512)
  args.update(kw)
  return A.choose_impl(requested, **args)


def test_choose_impl_per_platform_and_mask():
  # CPU: dense while the queries fit one block (decode, short rows), blockwise beyond.
  assert _choose() == "blockwise"
  assert _choose(q_len=512, kv_len=512) == "dense"
  assert _choose(q_len=1, kv_len=32768, self_only=False) == "dense"
  assert _choose(q_len=2048, kv_len=4096, self_only=False) == "blockwise"
  # NVIDIA GPU: cuDNN flash for one sequence per row among its own tokens, in half precision.
  assert _choose(platform="cuda") == "cudnn"
  assert _choose(platform="cuda", q_len=100, kv_len=100) == "cudnn"
  assert _choose(platform="cuda", segments=True) == "cudnn"               # packed layout (sm90+)
  # Packed rows cuDNN's packed layout does not take (before Hopper, past 8K tokens): the
  # gpu_flash kernel, in half precision, where it compiles.
  assert _choose(platform="cuda", segments=True, capability=8.0) == "gpu_flash"
  assert _choose(platform="cuda", segments=True, q_len=16384, kv_len=16384) == "gpu_flash"
  assert _choose(platform="cuda", segments=True, q_len=16384, kv_len=16384,
                 flash_compiles=False) == "blockwise"
  assert _choose(platform="cuda", segments=True, q_len=16384, kv_len=16384,
                 dtype=jnp.float32) == "blockwise"
  assert _choose(platform="cuda", segments=True, q_len=16100, kv_len=16100) == "blockwise"
  assert _choose(platform="cuda", segments=True, q_len=16384, kv_len=16384,
                 head_dim=96) == "blockwise"
  assert _choose(platform="cuda", segments=True, capability=8.0, window=1024) == "blockwise"
  assert _choose(platform="cuda", capability=8.0) == "cudnn"
  assert _choose(platform="cuda", self_only=False, kv_len=8192) == "blockwise"  # cached prefix
  assert _choose(platform="cuda", dtype=jnp.float32) == "blockwise"
  assert _choose(platform="cuda", head_dim=256) == "blockwise"
  assert _choose(platform="cuda", window=1024) == "blockwise"
  assert _choose(platform="cuda", window=4096) == "cudnn"                 # never bites
  assert _choose(platform="rocm") == "blockwise"
  # TPU: the Pallas flash kernel, segment ids included, T a multiple of 128.
  assert _choose(platform="tpu", segments=True) == "tpu_flash"
  assert _choose(platform="tpu", q_len=4000, kv_len=4000) == "blockwise"
  assert _choose(platform="tpu", window=1024) == "blockwise"
  assert _choose(platform="tpu", self_only=False) == "blockwise"
  assert _choose(platform="tpu", q_len=1, kv_len=4096, self_only=False) == "dense"
  # Explicit choices: dense and blockwise always; a kernel where it applies, else blockwise.
  assert _choose("dense", platform="cuda") == "dense"
  assert _choose("blockwise", platform="tpu", q_len=1, kv_len=1) == "blockwise"
  assert _choose("cudnn") == "blockwise"
  assert _choose("cudnn", platform="cuda") == "cudnn"
  assert _choose("tpu_flash", platform="cuda") == "blockwise"
  # The Pallas GPU kernel when asked for, at any length that is a multiple of its block and in
  # any precision; auto only for packed rows.
  assert _choose("gpu_flash", platform="cuda", segments=True, q_len=32768,
                 kv_len=32768) == "gpu_flash"
  assert _choose(platform="cuda", segments=True, q_len=32768, kv_len=32768) == "gpu_flash"
  assert _choose(platform="cuda", q_len=32768, kv_len=32768) == "cudnn"
  assert _choose("gpu_flash", platform="cuda", dtype=jnp.float32) == "gpu_flash"
  assert _choose("gpu_flash", platform="cuda", flash_compiles=False) == "gpu_flash"
  assert _choose("gpu_flash", platform="cuda", head_dim=256) == "blockwise"
  assert _choose("gpu_flash", platform="cuda", q_len=4000, kv_len=4000) == "blockwise"
  assert _choose("gpu_flash", platform="cuda", window=1024) == "blockwise"
  assert _choose("gpu_flash", platform="cuda", self_only=False) == "blockwise"
  assert _choose("gpu_flash") == "blockwise"
  assert _choose("gpu_flash", platform="tpu") == "blockwise"
  with pytest.raises(ValueError, match="attention_impl"):
    _choose("flash")
  with pytest.raises(ValueError, match="attention_impl"):
    ModelConfig(attention_impl="flash")


def test_cudnn_call_has_the_dense_mask():
  """The cuDNN path's jax.nn.dot_product_attention call (layout, causal mask, GQA), run with
  its XLA implementation: a CPU cannot run cuDNN."""
  rng = np.random.RandomState(4)
  q, keys, values = _qkv(rng, 2, 24, 24, 8, 2, 16, jnp.float32)
  spec = A.packed_spec(jnp.broadcast_to(jnp.arange(24), (2, 24)), None)
  want = A.dense_attention(q, keys, values, A.dense_mask(spec, None), False)
  got = A.cudnn_attention(q, keys, values, implementation="xla")
  _assert_close([got], [want], jnp.float32)


def test_segment_layout_lists_each_run():
  seg = jnp.asarray([[1, 1, 1, 2, 2, 3, 0, 0],     # three sequences and a padding tail
                     [1, 1, 1, 1, 1, 1, 1, 1],     # one sequence filling the row
                     [0, 0, 0, 0, 0, 0, 0, 0]])    # all padding
  lengths, offsets, fits = A.segment_layout(seg, 4)
  np.testing.assert_array_equal(lengths, [[3, 2, 1, 2], [8, -1, -1, -1], [8, -1, -1, -1]])
  np.testing.assert_array_equal(offsets, [[0, 3, 5, 6, -1], [0, -1, -1, -1, -1],
                                          [0, -1, -1, -1, -1]])
  assert bool(fits)
  assert not bool(A.segment_layout(seg, 3)[2])     # row 0 has 4 runs


def _layout_reference_kernel(q, k, v, lengths, offsets):
  """What cuDNN's packed layout means, computed densely from (lengths, offsets) alone:
  [B, T, H, Dh] q, [B, T, K, Dh] k/v; causal within each listed segment."""
  t = q.shape[1]
  idx = jnp.arange(t)
  def row_ids(ln, off):   # segment number of each position (-1: in no segment)
    inside = (idx[None, :] >= off[:-1, None]) & (idx[None, :] < (off[:-1] + ln)[:, None]) \
        & (ln[:, None] >= 0)
    return jnp.where(inside.any(0), jnp.argmax(inside, 0), -1)
  ids = jax.vmap(row_ids)(lengths, offsets)
  mask = (ids[:, :, None] == ids[:, None, :]) & (ids[:, :, None] >= 0) \
      & (idx[:, None] >= idx[None, :])[None]
  return A.dense_attention(q, k.swapaxes(1, 2), v.swapaxes(1, 2), mask, False)


@pytest.mark.parametrize("lengths", [[40, 30, 50, 8], [128]])
def test_cudnn_packed_layout_has_the_packed_mask(lengths):
  """The packed cuDNN path's layout (segment runs as offsets and lengths) gives the attention of
  the model's packed mask: run with a reference kernel that reads only the layout, since a CPU
  cannot run cuDNN. Outputs and gradients, the padding tail included."""
  rng = np.random.RandomState(5)
  t = 128
  seg = np.zeros((2, t), np.int32)
  pos = np.zeros((2, t), np.int32)
  o = 0
  for i, n in enumerate(lengths, start=1):
    seg[0, o:o + n], pos[0, o:o + n] = i, np.arange(n)
    o += n
  seg[1] = 1
  pos[1] = np.arange(t)
  q, keys, values = _qkv(rng, 2, t, t, 4, 2, 16, jnp.float32)
  spec = A.packed_spec(jnp.asarray(pos), jnp.asarray(seg))
  want_fn = lambda q, k, v: A.dense_attention(q, k, v, A.dense_mask(spec, None), False)
  got_fn = lambda q, k, v: A.cudnn_packed_attention(
      q, k, v, spec.q_seg, lambda: want_fn(q, k, v), kernel=_layout_reference_kernel)
  ct = jnp.asarray(rng.randn(*q.shape), jnp.float32)
  real = jnp.asarray(seg > 0)[:, :, None, None]    # padding rows: own segment, not compared
  got = _outputs_and_grads(got_fn, q, keys, values, ct * real)
  want = _outputs_and_grads(want_fn, q, keys, values, ct * real)
  _assert_close([got[0] * real] + list(got[1:]), [want[0] * real] + list(want[1:]), jnp.float32)
  assert np.all(np.isfinite(np.asarray(got[0])))


def test_cudnn_packed_overflow_takes_the_fallback():
  """A row with more segments than the layout's slots runs the fallback, not a wrong mask."""
  t = 16   # 2 slots per row
  seg = jnp.asarray(np.repeat(np.arange(1, 5), 4)[None])   # 4 segments
  q, keys, values = _qkv(np.random.RandomState(6), 1, t, t, 2, 1, 8, jnp.float32)
  boom = lambda *a: jnp.full(q.shape, jnp.nan, q.dtype)
  got = A.cudnn_packed_attention(q, keys, values, seg, lambda: jnp.ones_like(q), kernel=boom)
  np.testing.assert_array_equal(got, np.ones(q.shape, np.float32))


@pytest.mark.parametrize("sharded", [False, True])
def test_tpu_flash_call_has_the_dense_mask(sharded):
  """The Pallas TPU kernel, run in its interpreter on CPU: packed segments, GQA; and under a
  2x4 mesh through the shard_map wrapper."""
  from jax.experimental.pallas import tpu as pltpu
  from magistral_jax.parallel.sharding import ShardingCtx, make_mesh
  rng = np.random.RandomState(5)
  q, keys, values = _qkv(rng, 2, 128, 128, 4, 2, 16, jnp.float32)
  seg, pos = _packed_rows(2, 128, rng)
  want = A.dense_attention(q, keys, values, A.dense_mask(A.packed_spec(pos, seg), None), False)
  shard = ShardingCtx(make_mesh({"data": 2, "tensor": 4})) if sharded else None
  with pltpu.force_tpu_interpret_mode():
    got = jax.jit(lambda q, k, v, s: A.tpu_flash_attention(q, k, v, s, shard))(
        q, keys, values, seg)
  _assert_close([got], [want], jnp.float32)


@pytest.mark.parametrize("sharded", [False, True])
def test_gpu_flash_call_has_the_dense_mask(sharded):
  """Our Pallas GPU kernel (forward and backward), run in Pallas's interpreter on CPU: packed
  segments with a padding tail, GQA; and under a 2x4 mesh through the shard_map wrapper (2 KV
  heads over 4 head shards: repeated over their groups first). The loss never reads the
  padding tail, so its cotangent is zero there."""
  from magistral_jax.parallel.sharding import ShardingCtx, make_mesh
  rng = np.random.RandomState(7)
  q, keys, values = _qkv(rng, 2, 128, 128, 4, 2, 16, jnp.float32)
  seg, pos = _packed_rows(2, 128, rng)
  mask = A.dense_mask(A.packed_spec(pos, seg), None)
  shard = ShardingCtx(make_mesh({"data": 2, "tensor": 4})) if sharded else None
  want_fn = lambda q, k, v: A.dense_attention(q, k, v, mask, False)
  got_fn = jax.jit(lambda q, k, v: A.gpu_flash_attention(q, k, v, seg, shard, interpret=True))
  ct = jnp.asarray(rng.randn(*q.shape), jnp.float32) * (seg > 0)[:, :, None, None]
  got = _outputs_and_grads(got_fn, q, keys, values, ct)
  want = _outputs_and_grads(want_fn, q, keys, values, ct)
  _assert_close(got, want, jnp.float32)


@pytest.mark.parametrize("sharded", [False, True])
def test_model_with_gpu_flash_equals_dense(sharded, monkeypatch):
  """attention_impl="gpu_flash" through the model (as the trainer runs it on a GPU, here on a
  CPU that says it is one, the kernel in Pallas's interpreter): the logits and the gradient of
  the packed rows' log-probs equal dense attention's; sharded, under a 2x4 mesh."""
  import functools
  from magistral_jax.parallel.sharding import ShardingCtx, make_mesh, param_shardings
  monkeypatch.setattr(A, "platform", lambda: "cuda")
  calls = []
  kernel = functools.partial(A.gpu_flash_attention, interpret=True)
  monkeypatch.setattr(A, "gpu_flash_attention", lambda *a: calls.append(a[4]) or kernel(*a))
  rng = np.random.RandomState(8)
  seg, pos = _packed_rows(2, 128, rng)
  tokens = jnp.asarray(rng.randint(0, 101, (2, 128)))
  cfg = _tiny(num_kv_heads=4 if sharded else 2, head_dim=16, attention_impl="gpu_flash")
  params = T.init_params(cfg, jax.random.PRNGKey(0))
  shard = ShardingCtx(make_mesh({"fsdp": 2, "tensor": 4})) if sharded else None
  want = _logits_and_grads(cfg.replace(attention_impl="dense"), params, tokens, pos, seg)
  if sharded:
    params = jax.device_put(params, param_shardings(T.param_logical_axes(cfg), shard.mesh,
                                                    shapes_tree=params))
  got = _logits_and_grads(cfg, params, tokens, pos, seg, shard)
  assert calls and all(c is shard for c in calls)   # the kernel ran, not a fallback
  _assert_model_close(got, want)


@pytest.mark.parametrize("compiles", [True, False])
def test_auto_takes_gpu_flash_for_long_packed_rows_where_it_compiles(compiles, monkeypatch):
  """auto on an NVIDIA GPU (here a CPU that says it is one, an A100: cuDNN's packed layout
  needs Hopper) sends a packed bf16 row to the gpu_flash kernel once its compile check passes,
  and to blockwise where it fails; either way the attention is the packed mask's. The check
  runs only where auto would take the kernel."""
  import functools
  monkeypatch.setattr(A, "platform", lambda: "cuda")
  monkeypatch.setattr(A, "cuda_capability", lambda: 8.0)
  checks, calls = [], []
  monkeypatch.setattr(A, "gpu_flash_compiles", lambda *a: checks.append(a) or compiles)
  kernel = functools.partial(A.gpu_flash_attention, interpret=True)
  monkeypatch.setattr(A, "gpu_flash_attention", lambda *a: calls.append(1) or kernel(*a))
  rng = np.random.RandomState(9)
  q, keys, values = _qkv(rng, 2, 128, 128, 4, 2, 16, jnp.bfloat16)
  seg, pos = _packed_rows(2, 128, rng)
  spec = A.packed_spec(pos, seg)
  cfg = _tiny(head_dim=16, dtype="bfloat16")
  got = A.attend(q, keys, values, spec, cfg)
  want = A.dense_attention(q, keys, values, A.dense_mask(spec, None), False)
  _assert_close([got], [want], jnp.bfloat16)
  assert checks == [(16, "bfloat16")] and bool(calls) == compiles
  A.attend(q[:, :1], keys, values, A.cache_spec(pos[:, :1], jnp.asarray([1, 1]), 128), cfg,
           self_only=False)
  assert len(checks) == 1                          # decode: no kernel, no check


def test_gpu_flash_compile_check_fails_on_cpu_and_says_why(caplog):
  A.gpu_flash_compiles.cache_clear()
  try:
    with caplog.at_level("WARNING"):
      assert not A.gpu_flash_compiles(16, "bfloat16")
    assert "does not compile here" in caplog.text and "blockwise" in caplog.text
  finally:
    A.gpu_flash_compiles.cache_clear()


def test_training_memory_grows_linearly_with_blockwise_attention():
  """Compiled temporaries of the model's gradient at T = 512 and 2048 (blocks of 128): about 4x
  with blockwise attention, about 16x with dense. The gradient of the scan over layers is what
  matters: there the masks' inputs are loop invariants that partial evaluation would hoist into
  one [T, S] mask."""
  def temp_bytes(impl, t):
    cfg = _tiny(attention_impl=impl, attention_block_q=128, attention_block_k=128)
    params = T.init_params(cfg, jax.random.PRNGKey(0))
    rows = jax.ShapeDtypeStruct((1, t), jnp.int32)
    grad = jax.grad(lambda p, tok, pos, seg: jnp.sum(T.hidden_states(p, cfg, tok, pos, seg)))
    return jax.jit(grad).lower(params, rows, rows, rows).compile().memory_analysis(
    ).temp_size_in_bytes

  ratio = {impl: temp_bytes(impl, 2048) / temp_bytes(impl, 512) for impl in ("blockwise", "dense")}
  assert ratio["blockwise"] < 5 and ratio["dense"] > 10, ratio
