"""Greedy collation, packing, global normalisers and exact microbatch gradient accumulation."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from magistral_jax.rl import collate as C
from magistral_jax.rl.config import GRPOConfig
from magistral_jax.rl.loss import grpo_loss
from magistral_jax.rl.minibatch import normalize_advantages


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 64), min_size=0, max_size=60), st.integers(64, 200))
def test_first_fit_places_every_sequence_once_within_budget(lengths, capacity):
  bins = C.first_fit(lengths, capacity)
  placed = sorted(i for b in bins for i in b)
  assert placed == list(range(len(lengths)))
  assert all(sum(lengths[i] for i in b) <= capacity for b in bins)
  # Longest first: each bin received its sequences in non-increasing length order.
  for b in bins:
    assert [lengths[i] for i in b] == sorted((lengths[i] for i in b), reverse=True)


def test_first_fit_rejects_sequences_longer_than_a_row():
  with pytest.raises(ValueError, match="sequence 1 has 9 tokens, more than the row length 8"):
    C.first_fit([3, 9, 2], 8)


def make_completions(seed, n=8, group_size=4, vocab=11, max_prompt=5, max_comp=12):
  rng = np.random.default_rng(seed)
  out = []
  for i in range(n):
    p = rng.integers(1, vocab, rng.integers(1, max_prompt + 1))
    c = rng.integers(1, vocab, rng.integers(1, max_comp + 1))
    out.append(C.Completion(p, c, -rng.random(len(c)) * 2, float(rng.normal()), i // group_size))
  return out


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from([(1, 24), (2, 16), (4, 40)]))
def test_pack_layout_keeps_every_token_and_segment(seed, shape):
  rows, row_len = shape
  comps = make_completions(seed)
  adv = np.arange(len(comps), dtype=np.float32)
  w = np.ones(len(comps), np.float32)
  arrays, placement = C.pack(comps, adv, w, row_len, rows)
  assert all(a.shape[1:] == (rows, row_len) for a in arrays.values())
  assert arrays["loss_mask"].sum() == sum(len(c.completion_tokens) for c in comps)
  for i, (c, lp, tg, a) in enumerate(zip(comps,
                                         C.unpack_tokens(arrays["old_logprobs"], comps, placement),
                                         C.unpack_tokens(arrays["targets"], comps, placement),
                                         C.unpack_tokens(arrays["advantages"], comps, placement))):
    np.testing.assert_allclose(lp, c.old_logprobs, rtol=1e-6)
    np.testing.assert_array_equal(tg, c.completion_tokens)
    assert np.all(a == i)
    m, r, s = placement[i]
    seg = arrays["segment_ids"][m, r, s]
    assert seg > 0 and np.all(arrays["segment_ids"][m, r, s:s + c.num_tokens] == seg)
    np.testing.assert_array_equal(arrays["positions"][m, r, s:s + c.num_tokens], np.arange(c.num_tokens))
  # Padding slots carry no loss.
  pad = arrays["segment_ids"] == 0
  assert not arrays["loss_mask"][pad].any() and not arrays["weights"][pad].any()


@pytest.mark.parametrize("agg", ["token", "sequence", "group_token_sum"])
def test_aggregation_weights_sum_to_one_over_the_minibatch(agg):
  lengths = np.array([3, 10, 1, 6, 6, 2])
  w = C.aggregation_weights(lengths, [0, 0, 1, 1, 2, 2], agg)
  assert np.sum(w * lengths) == pytest.approx(1.0)


def test_bad_completions_raise_naming_the_completion():
  good = C.Completion([1], [2, 3], [-0.1, -0.2], 0.5, 7)
  bad = C.Completion([1], [2, 3], [-0.1], 0.5, 7)
  with pytest.raises(ValueError, match="completion 1 \\(group 7\\): 1 old log-probs for 2"):
    C.pack([good, bad], [0, 0], [1, 1], 8, 1)
  with pytest.raises(ValueError, match="empty prompt"):
    C.pack([C.Completion([], [2], [-0.1])], [0], [1], 8, 1)


# ---- exact microbatch accumulation --------------------------------------------------------------

def _bigram_logprobs(table, arrays):
  """A differentiable stand-in policy: π(y | x) = softmax(table[x])[y]."""
  lp = jax.nn.log_softmax(table[arrays["tokens"]], -1)
  return jnp.take_along_axis(lp, arrays["targets"][..., None], -1)[..., 0]


@functools.partial(jax.jit, static_argnums=2)
def _micro_value_and_grad(table, m, cfg):
  def micro_loss(t):
    lp = _bigram_logprobs(t, m)
    return grpo_loss(lp, m["old_logprobs"], m["advantages"], m["weights"], m["loss_mask"], cfg,
                     segment_ids=m["segment_ids"], ref_logprobs=lp * 0.9)[0]
  return jax.value_and_grad(micro_loss)(table)


def _accumulated_grad(table, arrays, cfg):
  total, grad = 0.0, jnp.zeros_like(table)
  for k in range(arrays["tokens"].shape[0]):
    m = {key: jnp.asarray(v[k]) for key, v in arrays.items()}
    l, g = _micro_value_and_grad(table, m, cfg)
    total, grad = total + l, grad + g
  return total, grad


@settings(max_examples=8, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from(["token", "sequence", "group_token_sum"]))
def test_microbatched_gradient_equals_full_minibatch_gradient(seed, agg):
  comps = make_completions(seed, n=12, group_size=4)
  cfg = GRPOConfig(loss_agg=agg, kl_coef=0.05, n_batch=12, n_mini=12, group_size=4)
  rng = np.random.default_rng(seed)
  table = jnp.asarray(rng.normal(size=(11, 11)), jnp.float32)
  group_ids = np.asarray([c.group_id for c in comps])
  adv = normalize_advantages([c.advantage for c in comps], group_ids, cfg.adv_norm)
  w = C.aggregation_weights([len(c.completion_tokens) for c in comps], group_ids, agg)
  # The unsplit minibatch: one microbatch, one row per sequence.
  full, _ = C.pack(comps, adv, w, 20, len(comps), bins=[[i] for i in range(len(comps))])
  want_loss, want_grad = _accumulated_grad(table, full, cfg)
  # Arbitrary splits: random bins of at most 40 tokens, 1-3 rows per microbatch.
  order = rng.permutation(len(comps))
  bins, cur, used = [], [], 0
  for i in order:
    n = comps[i].num_tokens
    if cur and (used + n > 40 or rng.random() < 0.3):
      bins.append(cur)
      cur, used = [], 0
    cur.append(int(i))
    used += n
  bins.append(cur)
  # Pad to 4 microbatches so every example reuses one compiled shape.
  split, _ = C.pack(comps, adv, w, 40, 3, bins=bins, min_microbatches=4)
  assert split["tokens"].shape[0] > 1 or len(bins) == 1
  got_loss, got_grad = _accumulated_grad(table, split, cfg)
  np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(got_grad, want_grad, rtol=1e-4, atol=1e-7)
