"""The page pool's bookkeeping (generate/pages.py), alone and driving the paged attention of
model/paged_attention.py: a group shares its prompt's pages, each member decodes into its own,
and attention over the pages equals attention over a dense cache of the same tokens."""
import numpy as np
import jax.numpy as jnp
import pytest

from magistral_jax.generate.pages import NULL_PAGE, OutOfPages, PagePool
from magistral_jax.model import paged_attention as pa


def test_admit_reserve_release_keep_the_books():
  p = PagePool(num_pages=10, page_size=4, max_pages_per_slot=5)
  assert p.admit(0, 5) == [1, 2] and p.free_pages == 7
  assert p.reserve(0, 8) == [] and p.reserve(0, 9) == [3]
  assert p.table(2)[0].tolist() == [1, 2, 3, NULL_PAGE, NULL_PAGE]
  assert p.table(2)[1].tolist() == [NULL_PAGE] * 5
  p.check()
  with pytest.raises(ValueError, match="more than"):
    p.reserve(0, 21)
  assert p.release(0) == 3 and p.free_pages == 9
  p.check()


def test_a_group_shares_full_prompt_pages_and_owns_the_partial_one():
  p = PagePool(num_pages=20, page_size=4, max_pages_per_slot=8)
  src = p.admit(0, 10 + 1)                     # prompt of 10 + its first token: 3 pages
  pages = p.share(0, 1, prompt_len=10)
  assert pages[:2] == src[:2] and pages[2] not in src       # 2 full pages shared, 1 own
  p.check()
  p.release(0)                                 # the shared pages stay for slot 1
  assert all(q not in p._free for q in pages)
  p.release(1)
  assert p.free_pages == 19
  p.check()
  # A prompt that fills whole pages shares all of them; the first new token gets its own.
  p.admit(0, 9)
  pages = p.share(0, 1, prompt_len=8)
  assert pages[:2] == p.pages_of(0)[:2] and len(pages) == 3 and pages[2] != p.pages_of(0)[2]


def test_out_of_pages_preempts_the_slot_with_the_least_progress():
  p = PagePool(num_pages=7, page_size=4, max_pages_per_slot=6)
  for s in range(3):
    p.admit(s, 8)
  assert not p.can_admit(4)
  with pytest.raises(OutOfPages):
    p.reserve(0, 9)
  victim = p.preempt_victim({0: 12, 1: 3, 2: 3})
  assert victim == 2                            # fewest tokens; ties to the latest slot
  p.preempt(victim)
  assert p.reserve(0, 9) and p.preemptions == 1
  p.check()


def test_attention_over_shared_and_own_pages_equals_a_dense_cache():
  """A group of 3 sharing a 10-token prompt, each then decoding 7 tokens of its own, against the
  same tokens in a dense per-slot cache."""
  ps, hkv, hq, dh, prompt, new = 4, 2, 4, 8, 10, 7
  r = np.random.default_rng(0)
  pool = PagePool(num_pages=32, page_size=ps, max_pages_per_slot=8)
  k_pages = jnp.zeros((hkv, 32, ps, dh))
  v_pages = jnp.zeros((hkv, 32, ps, dh))
  dense_k = np.zeros((3, 8 * ps, hkv, dh))
  dense_v = np.zeros((3, 8 * ps, hkv, dh))
  kp, vp = r.normal(size=(prompt, hkv, dh)), r.normal(size=(prompt, hkv, dh))
  first = pool.admit(0, prompt + 1)
  k_pages, v_pages = pa.write_prompt(k_pages, v_pages, jnp.asarray(first[:3]), kp, vp)
  for s in (1, 2):   # each member writes the prompt into its pages (shared ones: same values)
    mine = pool.share(0, s, prompt)
    k_pages, v_pages = pa.write_prompt(k_pages, v_pages, jnp.asarray(mine[:3]), kp, vp)
  dense_k[:, :prompt], dense_v[:, :prompt] = kp, vp
  lengths = np.full(3, prompt)
  for t in range(new):
    for s in range(3):
      pool.reserve(s, int(lengths[s]) + 1)
    kn, vn = r.normal(size=(3, hkv, dh)), r.normal(size=(3, hkv, dh))
    table = jnp.asarray(pool.table(3))
    k_pages, v_pages = pa.write_tokens(k_pages, v_pages, table, jnp.asarray(lengths), kn, vn)
    dense_k[np.arange(3), lengths], dense_v[np.arange(3), lengths] = kn, vn
    lengths = lengths + 1
  pool.check()
  q = jnp.asarray(r.normal(size=(3, hq, dh)))
  table, n = jnp.asarray(pool.table(3)), jnp.asarray(lengths, jnp.int32)
  got = pa.ragged(q, k_pages, v_pages, table, n, chunk=2)
  # The dense reference: the same tokens, one contiguous cache per slot.
  s = np.einsum("bkgd,bskd->bkgs", np.asarray(q).reshape(3, hkv, hq // hkv, dh), dense_k)
  s = np.where(np.arange(8 * ps)[None, None, None] < lengths[:, None, None, None],
               s / np.sqrt(dh), -np.inf)
  w = np.exp(s - s.max(-1, keepdims=True))
  want = np.einsum("bkgs,bskd->bkgd", w / w.sum(-1, keepdims=True), dense_v).reshape(3, hq, dh)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  # The group's slots differ only after the prompt: their outputs differ.
  assert not np.allclose(got[0], got[1])
