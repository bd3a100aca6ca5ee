"""The block-sparse Pallas GPU flash kernel (model/flash_sparse.py), run in Pallas's interpreter
on CPU: its outputs and gradients against dense attention on packed rows, which tiles it visits
against the tiles the packed mask leaves non-empty, and that it lowers to Triton."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from magistral_jax.model import attention as A
from magistral_jax.model import flash_sparse as FS
from tests.model.test_attention import TOL, _assert_close
from tests.model.test_attention import _outputs_and_grads as _fwd_bwd

T = 128
SMALL = FS.Blocks(q=32, k=16, bwd_q=16, bwd_k=32)   # many blocks at T = 128


def _segments(lengths, t=T):
  """Segment ids of sequences of these lengths, the rest of the row padding (id 0)."""
  seg = np.zeros(t, np.int32)
  o = 0
  for i, n in enumerate(lengths, start=1):
    seg[o:o + n] = i
    o += n
  return seg


# Row layouts: sequences crossing block boundaries with a padding tail; one sequence filling the
# row; many short ones (lengths 1 to 9); the padding tail alone after one sequence.
LAYOUTS = [_segments([10, 40, 5, 33, 20]), _segments([T]),
           _segments([1, 9, 3, 7, 2, 8, 5, 5, 1, 1, 4, 6] * 4), _segments([50])]


def _positions(seg):
  pos = np.zeros_like(seg)
  for r in range(seg.shape[0]):
    for i in range(1, seg.shape[1]):
      pos[r, i] = 0 if seg[r, i] != seg[r, i - 1] else pos[r, i - 1] + 1
  return pos


def _dense_fn(seg):
  mask = A.dense_mask(A.packed_spec(jnp.asarray(_positions(seg)), jnp.asarray(seg)), None)
  return lambda q, k, v: A.dense_attention(q, k, v, mask, False)


def _inputs(rng, b, h, k, d, dtype):
  q = jnp.asarray(rng.randn(b, T, h, d), dtype)
  keys = jnp.asarray(rng.randn(b, k, T, d), dtype)
  values = jnp.asarray(rng.randn(b, k, T, d), dtype)
  return q, keys, values, jnp.asarray(rng.randn(b, T, h, d), dtype)


@pytest.mark.parametrize("dtype,heads,blocks,skip", [
    (jnp.float32, (4, 2), SMALL, True),            # GQA 2
    (jnp.float32, (2, 2), SMALL, False),           # the whole causal triangle, masked
    (jnp.bfloat16, (4, 1), FS.Blocks(q=64, k=32, bwd_q=32, bwd_k=64), True),   # GQA 4
])
def test_flash_sparse_equals_dense(dtype, heads, blocks, skip):
  """Outputs and the gradients of q, k and v on every layout in LAYOUTS (two rows per call),
  one compiled kernel for all of them."""
  rng = np.random.RandomState(0)
  h, k = heads
  q, keys, values, ct = _inputs(rng, 2, h, k, 16, dtype)
  run = jax.jit(lambda q, k, v, seg, ct: _fwd_bwd(
      lambda q, k, v: FS.flash_attention(q, k, v, seg, skip=skip, blocks=blocks,
                                         interpret=True), q, k, v, ct))
  for rows in (LAYOUTS[:2], LAYOUTS[2:]):
    seg = np.stack(rows)
    got = run(q, keys, values, jnp.asarray(seg), ct)
    want = _fwd_bwd(_dense_fn(seg), q, keys, values, ct)
    assert all(x.dtype == dtype for x in got)
    _assert_close(got, want, dtype)


def test_one_sequence_per_row_without_segments():
  rng = np.random.RandomState(1)
  q, keys, values, _ = _inputs(rng, 1, 2, 1, 32, jnp.float32)
  got = FS.flash_attention(q, keys, values, None, blocks=SMALL, interpret=True)
  want = _dense_fn(np.ones((1, T), np.int32))(q, keys, values)
  _assert_close([got], [want], jnp.float32)


def test_segment_runs():
  seg = jnp.asarray([[1, 1, 2, 2, 2, 3, 0, 0], [5, 5, 5, 5, 5, 5, 5, 5]])
  runs, first, end = FS.segment_runs(seg)
  np.testing.assert_array_equal(runs, [[1, 1, 2, 2, 2, 3, 4, 4], [1] * 8])
  np.testing.assert_array_equal(first, [[0, 0, 2, 2, 2, 5, 6, 6], [0] * 8])
  np.testing.assert_array_equal(end, [[2, 2, 5, 5, 5, 6, 8, 8], [8] * 8])


def _nonempty_tiles(seg, bq, bk):
  """[T / bq, T / bk]: the tiles in which the packed mask keeps some (query, key) pair."""
  mask = np.asarray(A.dense_mask(A.packed_spec(jnp.asarray(_positions(seg[None])),
                                               jnp.asarray(seg[None])), None))[0]
  t = seg.shape[0]
  return mask.reshape(t // bq, bq, t // bk, bk).any(axis=(1, 3))


@pytest.mark.parametrize("bq,bk", [(32, 16), (16, 32), (16, 16)])
def test_visited_tiles_are_exactly_the_nonempty_ones(bq, bk):
  """With skipping, each query block visits exactly the key blocks where some of its queries
  see some key (forward, dq), and each key block exactly the query blocks that see it (dk, dv);
  without, the whole causal triangle."""
  rng = np.random.RandomState(2)
  layouts = LAYOUTS + [_segments(rng.randint(1, 30, 20)) for _ in range(3)]
  for seg in layouts:
    need = _nonempty_tiles(seg, bq, bk)
    per_q, per_k = FS.tile_counts(jnp.asarray(seg[None]), bq, bk, skip=True)
    np.testing.assert_array_equal(per_q[0], need.sum(1))
    np.testing.assert_array_equal(per_k[0], need.sum(0))
    causal = _nonempty_tiles(np.ones(T, np.int32), bq, bk)
    per_q, per_k = FS.tile_counts(jnp.asarray(seg[None]), bq, bk, skip=False)
    np.testing.assert_array_equal(per_q[0], causal.sum(1))
    np.testing.assert_array_equal(per_k[0], causal.sum(0))


def test_skipping_saves_the_tiles_of_many_short_sequences():
  """A 32K row of 25 sequences (the bench's row), 128 x 64 forward tiles: under a twentieth of
  the causal triangle's tiles are visited."""
  t = 32768
  lengths = np.full(25, t // 25)
  seg = jnp.asarray(_segments(lengths, t)[None])
  skip = int(FS.tile_counts(seg, 128, 64, True)[0].sum())
  full = int(FS.tile_counts(seg, 128, 64, False)[0].sum())
  assert full == sum(2 * (i + 1) for i in range(t // 128))
  assert skip < full / 20, (skip, full)


def test_the_kernel_counts_the_tiles_it_visits():
  """The forward kernel's own loop trip counts (an extra output) equal tile_counts, with and
  without skipping."""
  seg = jnp.asarray(np.stack([LAYOUTS[0], LAYOUTS[2]]))
  q, keys, values, _ = _inputs(np.random.RandomState(3), 2, 2, 1, 16, jnp.float32)
  for skip in (True, False):
    got = FS.visited_key_blocks(q, keys, values, seg, skip=skip, blocks=SMALL, interpret=True)
    want = FS.tile_counts(seg, SMALL.q, SMALL.k, skip)[0]
    np.testing.assert_array_equal(got, np.broadcast_to(np.asarray(want)[:, None], got.shape))
  assert int(got.sum()) > int(FS.visited_key_blocks(q, keys, values, seg, blocks=SMALL,
                                                    interpret=True).sum())


def test_lowers_to_triton():
  """The forward and both backward kernels lower to Triton calls for an NVIDIA GPU at the 1B
  model's attention shape (bf16, head_dim 64, GQA 4, default blocks): what Pallas's lowering
  checks (power-of-2 shapes, supported primitives) holds before a GPU compiles it."""
  s = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
  def fwd_bwd(q, k, v, seg, ct):
    return _fwd_bwd(lambda q, k, v: FS.flash_attention(q, k, v, seg), q, k, v, ct)
  text = jax.jit(fwd_bwd).trace(s(1, 256, 8, 64), s(1, 2, 256, 64), s(1, 2, 256, 64),
                                jax.ShapeDtypeStruct((1, 256), jnp.int32),
                                s(1, 256, 8, 64)).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("xla.gpu.triton") == 3


def test_rejects_shapes_it_does_not_take():
  q, keys, values, _ = _inputs(np.random.RandomState(4), 1, 2, 1, 16, jnp.float32)
  with pytest.raises(ValueError, match="head_dim"):
    FS.flash_attention(q[:, :100], keys[:, :, :100], values[:, :, :100], None)
  with pytest.raises(ValueError, match="heads"):
    FS.flash_attention(q[:, :, :1], keys.repeat(2, 1), values.repeat(2, 1), None)
