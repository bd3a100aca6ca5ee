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


def test_completions_pack_into_flat_arrays_and_back():
  from magistral_jax.generate.requests import Sample
  from magistral_jax.pipeline.generator_service import pack_samples, unpack_samples
  from magistral_jax.rewards.reward import failed_result
  task = {"id": "m1", "kind": "math", "problem": "1 + 1?", "answer": "2"}
  a = Sample(7, 0, [1, 2, 3], [4, 5], np.asarray([-0.5, -1.5], np.float32),
             np.asarray([3, 4], np.int32), "eos", task)
  b = Sample(7, 1, [1, 2, 3], [], np.zeros(0, np.float32), np.zeros(0, np.int32), "length",
             task, prompt_truncated=True)   # an empty completion
  result = failed_result("boom")
  arrays, rest = pack_samples([a, (b, result)])
  assert {k: v.dtype.kind for k, v in arrays.items()} == {
      "prompt_lengths": "i", "lengths": "i", "prompt_tokens": "i", "tokens": "i",
      "logprobs": "f", "versions": "i", "tool_mask": "b"}
  got_a, (got_b, got_result) = unpack_samples(arrays, rest)
  for want, got in ((a, got_a), (b, got_b)):
    assert (got.request_id, got.sample_index, got.prompt_tokens, got.tokens, got.finish_reason,
            got.metadata, got.prompt_truncated) == (
                want.request_id, want.sample_index, want.prompt_tokens, want.tokens,
                want.finish_reason, want.metadata, want.prompt_truncated)
    np.testing.assert_array_equal(got.logprobs, want.logprobs)
    np.testing.assert_array_equal(got.versions, want.versions)
  assert got_result == result
  assert pack_samples([])[0]["tokens"].shape == (0,)
