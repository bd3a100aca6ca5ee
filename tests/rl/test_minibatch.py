"""A batch of scored groups -> minibatches of whole groups, advantages normalised per minibatch,
packed by greedy collation."""
import numpy as np
import pytest

from magistral_jax.rewards.reward import RewardResult
from magistral_jax.rl import collate as C
from magistral_jax.rl.advantages import score_group
from magistral_jax.rl.config import GRPOConfig
from magistral_jax.rl.minibatch import make_minibatches, split_minibatches


def scored_groups(seed, n_groups, group_size, cfg, vocab=11, max_prompt=5, max_comp=12):
  """Random prompts and completions, rewards with a spread in every group."""
  rng = np.random.default_rng(seed)
  groups = []
  for gid in range(n_groups):
    comps, results = [], []
    for j in range(group_size):
      p = rng.integers(1, vocab, rng.integers(1, max_prompt + 1))
      c = rng.integers(1, vocab, rng.integers(1, max_comp + 1))
      comps.append(C.Completion(p, c, -rng.random(len(c)) * 2))
      results.append(RewardResult(float(j == 0) + rng.random() * 0.1, {}))
    groups.append(score_group(gid, comps, results, cfg))
  return groups


def test_split_minibatches_keeps_groups_whole():
  gid = np.repeat([5, 1, 9, 3], 4)
  mbs = split_minibatches(gid, 8, np.random.default_rng(0))
  assert len(mbs) == 2 and sorted(np.concatenate(mbs).tolist()) == list(range(16))
  for mb in mbs:
    assert all(np.sum(gid[mb] == g) in (0, 4) for g in np.unique(gid))
  with pytest.raises(ValueError, match="straddles"):
    split_minibatches(gid, 6)


def test_make_minibatches_normalises_advantages_per_minibatch():
  cfg = GRPOConfig(n_batch=8, n_mini=4, group_size=4, microbatch_tokens=64, microbatch_rows=2)
  groups = scored_groups(1, 2, 4, cfg)
  out = make_minibatches(groups, cfg, np.random.default_rng(0))
  assert len(out) == 2
  for mb in out:
    assert len({c.group_id for c in mb.completions}) == 1   # whole groups
    per_seq = np.array([a[0] for a in C.unpack_tokens(mb.arrays["advantages"], mb.completions,
                                                      mb.placement)])
    np.testing.assert_allclose(per_seq, [c.advantage for c in mb.completions], rtol=1e-6)
    np.testing.assert_allclose([per_seq.mean(), per_seq.std()], [0, 1], atol=1e-5)
    assert mb.arrays["weights"].sum() == pytest.approx(1.0, rel=1e-5)
    assert mb.arrays["tokens"].shape[1:] == (2, 32)
    assert 0 <= mb.stats["padding_frac"] < 1 and mb.stats["sequences"] == 4


def test_the_split_depends_on_the_groups_and_the_rng_not_their_order():
  cfg = GRPOConfig(n_batch=16, n_mini=8, group_size=4, microbatch_tokens=64, microbatch_rows=2)
  groups = scored_groups(2, 4, 4, cfg)
  a = make_minibatches(groups, cfg, np.random.default_rng(3))
  b = make_minibatches(groups[::-1], cfg, np.random.default_rng(3))
  for x, y in zip(a, b):
    for k in x.arrays:
      np.testing.assert_array_equal(x.arrays[k], y.arrays[k])


def test_a_batch_of_the_wrong_size_or_with_a_dropped_group_is_an_error():
  cfg = GRPOConfig(n_batch=8, n_mini=8, group_size=4, microbatch_tokens=64, microbatch_rows=2)
  groups = scored_groups(0, 3, 4, cfg)
  with pytest.raises(ValueError, match="batch has 12 completions, GRPOConfig.n_batch=8"):
    make_minibatches(groups, cfg)
  groups[0].dropped = "zero_advantage"
  with pytest.raises(ValueError, match="dropped groups in a training batch: \\[0\\]"):
    make_minibatches(groups[:2], cfg)
