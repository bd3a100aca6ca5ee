"""parallel/bulk.py on one process: packing named arrays into one buffer and back, and LocalRows,
a trainer process's rows of a batch field, going into train.step.shard_batch as the whole field
would. Between processes: tests/parallel/test_multihost.py (bulk) and the many-host run."""
import ml_dtypes
import numpy as np
import pytest

from magistral_jax.parallel.bulk import LocalRows, pack, row_ranges, unpack
from magistral_jax.parallel.config import TRAINER_RULES
from magistral_jax.parallel.sharding import make_mesh
from magistral_jax.train.step import batch_sharding, shard_batch


def test_pack_and_unpack_keep_every_dtype_shape_and_byte():
  rng = np.random.default_rng(0)
  arrays = {"f32": rng.standard_normal((3, 4)).astype(np.float32),
            "bf16": rng.standard_normal(5).astype(ml_dtypes.bfloat16),
            "strided": np.arange(24, dtype=np.int32).reshape(4, 6)[:, ::2],
            "empty": np.zeros((0, 3), np.int64), "scalar": np.float64(2.5), "bool": np.ones(3, bool)}
  buf, spec = pack(arrays)
  assert buf.dtype == np.uint8 and spec.nbytes == sum(np.asarray(a).nbytes for a in arrays.values())
  got = unpack(buf, spec)
  assert list(got) == list(arrays)
  for k, v in arrays.items():
    v = np.asarray(v)
    assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
    np.testing.assert_array_equal(got[k], v)
  with pytest.raises(ValueError, match="a bulk buffer of 3 bytes"):
    unpack(np.zeros(3, np.uint8), spec)


def test_local_rows_build_the_same_global_batch_as_the_whole_field():
  mesh = make_mesh({"fsdp": 4, "tensor": 2})
  sh = batch_sharding(mesh, TRAINER_RULES)
  rng = np.random.default_rng(1)
  full = {"tokens": rng.integers(0, 100, (2, 8, 16)).astype(np.int32),
          "adv": rng.standard_normal((2, 8, 16)).astype(np.float32)}
  ranges = row_ranges(sh, (2, 8, 16), 0)
  assert ranges == [(0, 2), (2, 4), (4, 6), (6, 8)]   # rows over fsdp, replicated over tensor
  local = {k: LocalRows(v.shape, v.dtype, {(a, b): v[:, a:b] for a, b in ranges})
           for k, v in full.items()}
  want, got = shard_batch(full, mesh, TRAINER_RULES), shard_batch(local, mesh, TRAINER_RULES)
  for k in full:
    assert got[k].sharding == want[k].sharding
    np.testing.assert_array_equal(np.asarray(got[k]), full[k])
  partial = LocalRows((2, 8, 16), np.int32, {(0, 2): full["tokens"][:, :2]})
  with pytest.raises(KeyError, match="rows 2:4 are not held here"):
    partial[(slice(None), slice(2, 4), slice(None))]
