"""The generator loop on a paged KV cache (generate/paging.py, model/paged_attention.py): the same
samples as on the dense cache (fp32, greedy and seeded sampling) through group sharing, refill,
drain compaction (a page-table gather), preemption when the pages run dry, a weight push mid-sequence, the recompute ablation and
release/reload; with every paged implementation (the Pallas kernel in its interpreter); and on
a generator mesh with a data axis, a pool per data replica."""
import dataclasses

import jax
import numpy as np
import pytest

from magistral_jax.generate.config import SamplingConfig
from magistral_jax.generate.engine import Engine
from magistral_jax.generate.loop import DIRECT, GeneratorLoop
from magistral_jax.generate.requests import Request
from magistral_jax.generate.xla_cpu import tune_engine, tuning_state
from magistral_jax.model import transformer as T
from magistral_jax.model.config import ModelConfig
from magistral_jax.parallel.sharding import make_mesh

CFG = ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8)
GREEDY = SamplingConfig(greedy=True, max_new_tokens=12)
SAMPLED = SamplingConfig(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=12)
SHAPE = dict(max_concurrent_decodes=4, max_prefill_length=16, max_decode_length=16,
             prefill_buckets=(8, 16))


@pytest.fixture(scope="module")
def params():
  init = jax.jit(lambda k: jax.tree.map(lambda x: x * 4 if x.ndim > 1 else x,
                                        T.init_params(CFG, k)))
  return init(jax.random.PRNGKey(0)), init(jax.random.PRNGKey(1))


@pytest.fixture(scope="module")
def mesh():
  return make_mesh({"tensor": 2}, jax.devices()[:2])


_ENGINES = {}


def engine(mesh, sampling, **kw):
  key = (sampling, tuple(sorted(kw.items())))
  if key not in _ENGINES:
    _ENGINES[key] = Engine(CFG, mesh, sampling=sampling, **SHAPE, **kw)
  return _ENGINES[key]


def requests(n=6, seed=0, group=2):
  rs = np.random.RandomState(seed)
  # Mixed completion lengths: the batch drains, slot by slot.
  return [Request(f"r{i}", rs.randint(1, CFG.vocab_size, rs.randint(3, 14)).tolist(),
                  group_size=group, seed=100 + i, max_new_tokens=int(rs.randint(2, 13)))
          for i in range(n)]


def run(eng, p, reqs, sampling, **kw):
  loop = GeneratorLoop(eng, p, sampling=sampling, **kw)
  return run_on(loop, reqs), loop


def same(a, b):
  assert a.keys() == b.keys()
  for k in a:
    assert a[k].tokens == b[k].tokens, k
    np.testing.assert_allclose(a[k].logprobs, b[k].logprobs, atol=2e-5)
    np.testing.assert_array_equal(a[k].versions, b[k].versions)


@pytest.mark.parametrize("impl,sampling", [("ragged", GREEDY), ("ragged", SAMPLED),
                                           ("dense", GREEDY), ("pallas_gpu", SAMPLED)],
                         ids=["ragged-greedy", "ragged-sampled", "dense-greedy", "pallas-sampled"])
def test_paged_samples_equal_dense_with_groups_and_refill(mesh, params, impl, sampling):
  p = params[0]
  want, _ = run(engine(mesh, sampling), p, requests(), sampling)
  got, loop = run(engine(mesh, sampling, kv_pages=40, page_size=4, paged_attention=impl), p,
                  requests(), sampling)
  same(want, got)
  m = loop.metrics()
  assert m["kv_preemptions"] == 0 and m["kv_pages_used"] == 0 and m["kv_pages_peak"] > 0
  assert loop.counters.compact_steps > 0   # the drain ran on fewer slots: a table gather
  for pool in loop.parts.pages.pools:
    pool.check()


def test_preemption_parks_and_resumes_with_the_same_samples(mesh, params):
  """A pool of 17 pages (2 slots' worth of 32 positions) under 4 slots: slots are parked and
  prefilled again, and every sample is what the dense engine draws."""
  p = params[0]
  want, _ = run(engine(mesh, SAMPLED), p, requests(8, seed=3), SAMPLED)
  got, loop = run(engine(mesh, SAMPLED, kv_pages=17, page_size=4), p, requests(8, seed=3),
                  SAMPLED)
  same(want, got)
  assert loop.metrics()["kv_preemptions"] > 0
  assert loop.metrics()["kv_pages_peak"] <= 16
  for pool in loop.parts.pages.pools:
    pool.check()
  with pytest.raises(ValueError, match="kv_pages=8"):
    GeneratorLoop(engine(mesh, SAMPLED, kv_pages=8, page_size=4), p, sampling=SAMPLED)


@pytest.mark.parametrize("recompute", [False, True])
def test_a_weight_push_mid_sequence_keeps_or_recomputes_the_pages(mesh, params, recompute):
  """New weights after 5 steps: each token's version and value as on the dense engine, with the
  stale KV kept (the paper) or recomputed (the ablation), overlap on and off."""
  outs = []
  for kw in ({}, dict(kv_pages=40, page_size=4)):
    for overlap in (True, False):
      opts = dataclasses.replace(DIRECT, overlap_host=overlap, recompute_kv_on_update=recompute)
      loop = GeneratorLoop(engine(mesh, SAMPLED, **kw), params[0], sampling=SAMPLED,
                           options=opts)
      for r in requests(3, seed=5):
        loop.submit(r)
      for _ in range(5):
        loop.step()
      loop.update_params(params[1], 1)
      outs.append({(s.request_id, s.sample_index): s for s in loop.run_until_idle()})
  same(outs[0], outs[2])
  same(outs[1], outs[3])
  assert any(1 in s.versions and 0 in s.versions for s in outs[2].values())


def test_release_and_reload_give_back_every_page(mesh, params):
  eng = engine(mesh, GREEDY, kv_pages=40, page_size=4)
  loop = GeneratorLoop(eng, params[0], sampling=GREEDY)
  first = run_on(loop, requests(2))
  loop.release()
  assert loop.parts.pages.pools[0].free_pages == 39
  loop.reload(params[0], 0)
  same(run_on(loop, requests(2)), first)


def test_background_prefill_and_a_shared_prefix_on_pages(mesh, params):
  """The run's loop options (a prefill worker thread, a shared system-prompt prefix continued by
  every prompt): the dense engine's samples."""
  prefix = list(range(1, 7))
  reqs = [dataclasses.replace(r, prompt_tokens=prefix + r.prompt_tokens[:8])
          for r in requests(5, seed=7)]
  opts = dataclasses.replace(DIRECT, background_prefill=True)
  outs = []
  for kw in ({}, dict(kv_pages=40, page_size=4)):
    loop = GeneratorLoop(engine(mesh, SAMPLED, **kw), params[0], sampling=SAMPLED, options=opts,
                         shared_prefix=prefix)
    outs.append(run_on(loop, reqs))
  same(*outs)


def run_on(loop, reqs):
  for r in reqs:
    loop.submit(r)
  return {(s.request_id, s.sample_index): s for s in loop.run_until_idle()}


@pytest.mark.parametrize("kw", [{}, dict(kv_pages=40, page_size=4)], ids=["dense", "paged"])
def test_samples_carried_over_a_release_go_on_where_they_stopped(mesh, params, kw):
  """release(carry=True) mid-generation (slots full, requests queued), reload of the same
  weights as version 1: every sample is the uninterrupted run's, its tokens before the release
  of version 0 and after it of version 1; the KV cache and weights were gone in between."""
  eng = engine(mesh, SAMPLED, **kw)
  want, _ = run(eng, params[0], requests(6, seed=9), SAMPLED)
  loop = GeneratorLoop(eng, params[0], sampling=SAMPLED)
  for r in requests(6, seed=9):
    loop.submit(r)
  for _ in range(4):
    loop.step()
  loop.release(carry=True)
  assert loop.released and len(loop.carry) == 4 and not loop.idle()
  loop.reload(params[0], 1)
  got = {(s.request_id, s.sample_index): s for s in loop.run_until_idle()}
  assert got.keys() == want.keys()
  for k, s in got.items():
    assert s.tokens == want[k].tokens, k
    np.testing.assert_allclose(s.logprobs, want[k].logprobs, atol=2e-5)
  carried = [s for s in got.values() if 0 in s.versions]
  assert len(carried) == 4 and all(1 in s.versions for s in carried)
  assert all(list(s.versions) == sorted(s.versions) for s in got.values())


_REPLICA_ENGINES = {}


def replica_engine(**kw):
  """An engine on a generator mesh with a data axis: data 2 x tensor 2."""
  key = tuple(sorted(kw.items()))
  if key not in _REPLICA_ENGINES:
    mesh = make_mesh({"data": 2, "tensor": 2}, jax.devices()[:4])
    _REPLICA_ENGINES[key] = Engine(CFG, mesh, sampling=SAMPLED, **SHAPE, **kw)
  return _REPLICA_ENGINES[key]


def test_dot_library_tuning_times_a_paged_step_over_held_pages(mesh, params):
  """The CPU dot-library tuning (xla_cpu.tune_engine) times a paged step with every slot holding
  an equal share of the pool, up to the cache length, so the attention over live pages counts as
  it does in a run (a dense step reads its whole cache anyway); the tuned engine gives the dense
  samples."""
  eng = Engine(CFG, mesh, sampling=GREEDY, **SHAPE, kv_pages=40, page_size=4,
               cpu_dot_library="auto")
  state = tuning_state(eng, 4)
  table, lengths = np.asarray(state.cache.page_table), np.asarray(state.cache.lengths)
  assert eng.cache_length == 32 and (39 // 4) * 4 > 32   # the share is capped by the cache
  np.testing.assert_array_equal(lengths, 32 - 4 - 1)
  assert np.all(table > 0) and len(np.unique(table)) == table.size == 4 * 8
  assert np.asarray(state.active).all()
  dense = engine(mesh, GREEDY)
  assert not np.asarray(tuning_state(dense, 4).cache.lengths).any()

  p = params[0]
  tuning = tune_engine(eng, eng.load_params(p))
  assert tuning["chosen"] == eng.generate_library and all(t > 0 for t in
                                                         tuning["step_ms"].values())
  want, _ = run(dense, p, requests(), GREEDY)
  got, _ = run(eng, p, requests(), GREEDY)
  same(want, got)


@pytest.mark.own_process
@pytest.mark.parametrize("kv_pages", [20, 9], ids=["roomy", "dry"])
def test_a_pool_per_data_replica_gives_the_dense_samples(params, kv_pages):
  """A generator mesh with a data axis (data 2 x tensor 2): one pool of kv_pages per replica,
  split over `data` as the slots are; each slot's pages are its replica's, group mates share
  pages within a replica only, and a dry pool (9 pages: one sample's 8 and the null page, for
  its 2 slots) preempts one of its own slots. The samples are the dense engine's on that mesh."""
  reqs = requests(8, seed=3)
  want, _ = run(replica_engine(), params[0], reqs, SAMPLED)
  eng = replica_engine(kv_pages=kv_pages, page_size=4)
  assert eng.page_replicas == 2 and eng.compact_sizes == ()
  loop = GeneratorLoop(eng, params[0], sampling=SAMPLED)
  for r in reqs:
    loop.submit(r)
  got, seen, idle = {}, np.zeros(4, bool), False
  while not idle:
    idle = loop.idle()
    got.update({(s.request_id, s.sample_index): s for s in loop.run_until_idle(max_steps=1)})
    table = loop.parts.pages.table()
    for slot in range(4):   # slots 0-1 take pages of pool 0, slots 2-3 of pool 1
      own = table[slot][table[slot] % kv_pages != 0] // kv_pages
      seen[slot] |= own.size > 0
      assert (own == slot // 2).all(), (slot, table[slot])
    for pool in loop.parts.pages.pools:
      pool.check()
  assert seen.all()
  same(want, got)
  pool = loop.state.cache.k[0]
  assert pool.shape[1] == 2 * kv_pages and pool.sharding.shard_shape(pool.shape)[1] == kv_pages
  assert (loop.metrics()["kv_preemptions"] > 0) == (kv_pages == 9)
  # Pools split otherwise than the slots would hand a replica's slots pages it does not hold.
  from magistral_jax.parallel.config import GENERATOR_RULES
  whole = tuple((n, None if n == "cache_pages" else a) for n, a in GENERATOR_RULES)
  with pytest.raises(ValueError, match="must name the same mesh axes"):
    Engine(CFG, eng.mesh, whole, sampling=SAMPLED, kv_pages=kv_pages, **SHAPE)


@pytest.mark.own_process
def test_a_pool_per_data_replica_keeps_its_pages_through_a_push_a_recompute_and_a_carry(params):
  """On data 2 x tensor 2, as on one pool: new weights mid-sequence (kept KV, and the recompute
  ablation, which prefills every slot again into its pages), then a release that carries the
  unfinished samples over and a reload: the dense engine's samples and versions."""
  outs = []
  for kw in ({}, dict(kv_pages=20, page_size=4)):
    for recompute in (False, True):
      opts = dataclasses.replace(DIRECT, recompute_kv_on_update=recompute)
      loop = GeneratorLoop(replica_engine(**kw), params[0], sampling=SAMPLED, options=opts)
      for r in requests(6, seed=9):
        loop.submit(r)
      for _ in range(3):
        loop.step()
      loop.update_params(params[1], 1)
      for _ in range(3):
        loop.step()
      loop.release(carry=True)
      loop.reload(params[1], 2)
      outs.append({(s.request_id, s.sample_index): s for s in loop.run_until_idle()})
  same(outs[0], outs[2])
  same(outs[1], outs[3])
  assert any({1, 2} <= set(s.versions) for s in outs[2].values())
