"""Decode attention over pages (model/paged_attention.py): every implementation gives dense's
result, on long-tailed lengths, GQA, empty slots and shared pages; the writes land where the
table says; the ragged path's list holds exactly the live pages, in one program for any lengths."""
import numpy as np
import jax
import jax.numpy as jnp
import pytest

from magistral_jax.model import paged_attention as pa

PS, MAX_PAGES, POOL = 8, 16, 96


def _case(seed=0, lengths=(1, 7, 8, 9, 40, 128, 0, 77), hq=8, hkv=2, dh=16, dtype=jnp.float32):
  r = np.random.default_rng(seed)
  b = len(lengths)
  k = jnp.asarray(r.normal(size=(hkv, POOL, PS, dh)), dtype)
  v = jnp.asarray(r.normal(size=(hkv, POOL, PS, dh)), dtype)
  q = jnp.asarray(r.normal(size=(b, hq, dh)), dtype)
  table = np.zeros((b, MAX_PAGES), np.int32)
  free = list(r.permutation(np.arange(1, POOL)))
  for i, n in enumerate(lengths):
    for j in range(pa.pages_for(n, PS)):
      table[i, j] = free.pop()
  return q, k, v, jnp.asarray(table), jnp.asarray(lengths, jnp.int32)


def _numpy_reference(q, k, v, table, lengths):
  q, k, v, table, lengths = map(np.asarray, (q, k, v, table, lengths))
  b, hq, dh = q.shape
  hkv = k.shape[0]
  out = np.zeros_like(q, dtype=np.float64)
  for i in range(b):
    n = lengths[i]
    if n == 0:
      continue
    keys = np.concatenate([k[:, p] for p in table[i]], axis=1)[:, :n]     # [Hkv, n, Dh]
    vals = np.concatenate([v[:, p] for p in table[i]], axis=1)[:, :n]
    for h in range(hq):
      s = keys[h // (hq // hkv)] @ q[i, h] / np.sqrt(dh)
      w = np.exp(s - s.max())
      out[i, h] = (w / w.sum()) @ vals[h // (hq // hkv)]
  return out


def test_dense_is_attention_over_each_slot_s_live_positions():
  args = _case()
  np.testing.assert_allclose(pa.dense(*args), _numpy_reference(*args), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("lengths", [(1, 7, 8, 9, 40, 128, 0, 77), (128,) * 4, (0, 0, 3),
                                     (5,)])
def test_ragged_reads_only_live_pages_and_gives_dense_s_result(lengths):
  args = _case(lengths=lengths)
  total = int(pa.pages_for(np.asarray(lengths), PS).sum())
  for chunk in (1, 3, 64):   # chunks that split slots, and one holding every page
    got = jax.jit(pa.ragged, static_argnames="chunk")(*args, chunk=chunk)
    np.testing.assert_allclose(got, pa.dense(*args), rtol=1e-5, atol=1e-5)
  page, slot, first, real = map(np.asarray, pa.flat_pages(args[3], args[4], total + 5, PS))
  assert int(real.sum()) == total
  want = {(i, j) for i, L in enumerate(lengths) for j in range(pa.pages_for(L, PS))}
  assert {(int(s), int(f) // PS) for s, f, r in zip(slot, first, real) if r} == want
  # An offset list is the same list from there on (the loop's chunk i starts at i * chunk).
  tail = pa.flat_pages(args[3], args[4], 5, PS, start=3)
  for part, whole in zip(tail, pa.flat_pages(args[3], args[4], 8, PS)):
    np.testing.assert_array_equal(part, whole[3:8])


def test_one_ragged_program_serves_every_mix_of_lengths():
  """The loop's trip count is a value: new lengths never compile a new program."""
  run = jax.jit(lambda *a: pa.ragged(*a, chunk=4))
  for lengths in [(1, 7, 8, 9, 40, 128, 0, 77), (64,) * 8, (0,) * 8, (3, 0, 0, 0, 0, 0, 0, 1)]:
    args = _case(lengths=lengths)
    np.testing.assert_allclose(run(*args), pa.dense(*args), rtol=1e-5, atol=1e-5)
  assert run._cache_size() == 1


@pytest.mark.parametrize("impl", ["pallas_gpu"])
def test_jax_s_paged_kernel_in_the_interpreter_gives_dense_s_result(impl):
  # jax's GPU kernel wants a head_dim and head blocks its Triton lowering takes; the interpreter
  # runs the same program on CPU.
  args = _case(lengths=(1, 7, 8, 9, 40, 128, 3, 77), hq=16, hkv=2, dh=32)
  got = pa.attend(impl, *args, interpret=True)
  np.testing.assert_allclose(got, pa.dense(*args), rtol=2e-4, atol=2e-4)


def test_bf16_pages_are_attended_in_fp32():
  args = _case(dtype=jnp.bfloat16)
  got = pa.ragged(*args)
  assert got.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(got, np.float32),
                             _numpy_reference(*(np.asarray(a, np.float32) if a.dtype == jnp.bfloat16 else np.asarray(a) for a in args)),
                             rtol=3e-2, atol=3e-2)


def test_token_and_prompt_writes_land_where_the_table_says():
  q, k, v, table, lengths = _case(lengths=(3, 8, 0))
  kn = jnp.ones((3, 2, 16)) * jnp.arange(1, 4)[:, None, None]
  k2, v2 = pa.write_tokens(k, v, table, jnp.asarray([3, 8, -1]), kn, -kn)
  # slot 0: page table[0, 0] offset 3; slot 1: its second page (allocated as pages_for(8) = 1:
  # the test's table has it as page 0 = null, so the caller reserves ahead; here position 8 ->
  # table[1, 1] = NULL_PAGE); slot 2: nothing (-1 -> null page).
  assert np.all(np.asarray(k2[:, table[0, 0], 3]) == 1)
  assert np.all(np.asarray(v2[:, table[0, 0], 3]) == -1)
  untouched = np.ones(k.shape[1], bool)
  untouched[[int(table[0, 0]), pa.NULL_PAGE]] = False
  np.testing.assert_array_equal(np.asarray(k2)[:, untouched], np.asarray(k)[:, untouched])
  pages = jnp.asarray([5, 9])
  kp = jnp.arange(11 * 2 * 16, dtype=jnp.float32).reshape(11, 2, 16)
  k3, _ = pa.write_prompt(k, v, pages, kp, kp)
  got = np.concatenate([np.asarray(k3[:, 5]), np.asarray(k3[:, 9])], axis=1)   # [Hkv, 16, Dh]
  np.testing.assert_array_equal(got[:, :11], np.asarray(kp).transpose(1, 0, 2))
  np.testing.assert_array_equal(got[:, 11:], np.asarray(k[:, 9, 3:]))        # tail kept


def test_bytes_read_follow_the_live_lengths_for_the_kernels_and_ragged():
  lengths = [8, 8, 8, 120]
  dense = pa.bytes_read("dense", lengths, PS, MAX_PAGES, 1)
  live = pa.bytes_read("pallas_gpu", lengths, PS, MAX_PAGES, 1)
  assert dense == 4 * MAX_PAGES * PS and live == (3 + 15) * PS
  chunk = pa.chunk_pages(PS) * PS   # the ragged loop reads whole chunks of pages
  assert live <= pa.bytes_read("ragged", lengths, PS, MAX_PAGES, 1) < live + chunk


def test_a_decode_step_on_pages_is_the_decode_step_on_a_per_slot_cache():
  """transformer.decode on a PagedKVCache (one token per slot) gives the per-slot cache's hidden
  states, by every implementation, with slots on scattered pages; an idle slot (num_new 0) whose
  table still names another slot's pages writes nothing there."""
  from magistral_jax.model import transformer as T
  from magistral_jax.model.config import ModelConfig
  cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=8)
  params = T.to_decode_layout(T.init_params(cfg, jax.random.PRNGKey(0)))
  b, ps, maxp = 3, 4, 5
  r = np.random.default_rng(1)
  table = r.permutation(np.arange(1, 1 + b * maxp)).reshape(b, maxp).astype(np.int32)
  table[2] = table[0]   # the idle slot names slot 0's pages: it must not write into them
  dense = T.init_cache(cfg, b, ps * maxp, per_layer=True)
  paged = {impl: T.init_paged_cache(cfg, b, 1 + b * maxp, ps, maxp)._replace(
      page_table=jnp.asarray(table)) for impl in ("dense", "ragged", "pallas_gpu")}
  num_new = jnp.asarray([1, 1, 0], jnp.int32)
  step = jax.jit(T.decode, static_argnames=("cfg", "paged"))
  for _ in range(ps * maxp - 1):
    tok = jnp.asarray(r.integers(1, cfg.vocab_size, (b, 1)), jnp.int32)
    want, dense = step(params, cfg, tok, dense, num_new=num_new)
    for impl in paged:
      got, paged[impl] = step(params, cfg, tok, paged[impl], num_new=num_new, paged=impl)
      np.testing.assert_allclose(np.asarray(got)[:2], np.asarray(want)[:2], atol=2e-6)
  for impl, cache in paged.items():
    np.testing.assert_array_equal(np.asarray(cache.lengths), [19, 19, 0])
  with pytest.raises(ValueError, match="decode steps only"):
    T.decode(params, cfg, jnp.zeros((b, 2), jnp.int32), paged["dense"], paged="dense")


@pytest.mark.own_process
@pytest.mark.parametrize("impl", ["dense", "ragged", "pallas_gpu"])
def test_each_data_replica_attends_within_its_own_pool(impl):
  """A generator mesh with a data axis (issue #66: one pool per data replica): the pages are
  split over `data` as the slots are, each replica's slots hold pages of its own pool only, and
  the decode step, run per shard, gives the one-device step's outputs and writes, page for page
  (the table numbers pages across the pools)."""
  from magistral_jax.parallel.config import GENERATOR_RULES
  from magistral_jax.parallel.sharding import ShardingCtx, make_mesh
  shard = ShardingCtx(make_mesh({"data": 2, "tensor": 2}, jax.devices()[:4]), GENERATOR_RULES)
  lengths = (1, 7, 0, 40, 9, 128, 77, 0)   # slots 0-3 on replica 0, 4-7 on replica 1
  q, k, v, _, lens = _case(3, lengths)
  r = np.random.default_rng(4)
  per = POOL // 2
  table = np.zeros((len(lengths), MAX_PAGES), np.int32)
  for rep in (0, 1):
    free = list(r.permutation(np.arange(rep * per + 1, (rep + 1) * per)))   # not its null page
    for i in range(4 * rep, 4 * rep + 4):
      table[i] = rep * per   # its own pool's null page past its pages
      for j in range(pa.pages_for(lengths[i], PS)):
        table[i, j] = free.pop()
  live = lens > 0
  step = pa.PagedStep(jnp.asarray(table), jnp.where(live, lens - 1, -1), lens, impl)
  k_new = jnp.asarray(r.normal(size=(len(lengths), 2, q.shape[-1])), q.dtype)
  v_new = jnp.asarray(r.normal(size=k_new.shape), q.dtype)
  run = jax.jit(lambda *a, shard=None: pa.decode_step(*a, step, shard), static_argnames="shard")
  want = run(q, k_new, v_new, k, v)
  got = run(q, k_new, v_new, k, v, shard=shard)
  assert got[1].sharding.shard_shape(got[1].shape)[1] == per   # each replica holds its pool
  np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), atol=2e-5)
  pages = np.setdiff1d(np.arange(POOL), [0, per])   # an idle slot writes into its null page
  for g, w in zip(got[1:], want[1:]):
    np.testing.assert_array_equal(np.asarray(g)[:, pages], np.asarray(w)[:, pages])
  # The one-device step is attention over each slot's live positions (after the writes).
  np.testing.assert_allclose(np.asarray(want[0])[live],
                             _numpy_reference(q, want[1], want[2], table, lens)[live], atol=2e-5)
