"""The SFT cold-start step: prompt-masked next-token loss over packed sequences."""
import jax
import jax.numpy as jnp
import numpy as np

from magistral_jax.model import transformer as tfm
from magistral_jax.model.config import ModelConfig
from magistral_jax.train import optimizer as O
from magistral_jax.train import step as S
from magistral_jax.train.sft import make_sft_step, sft_collate

CFG = ModelConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                  num_kv_heads=1, head_dim=16, logits_chunk=16)


def test_sft_step_matches_masked_cross_entropy_and_learns():
  rng = np.random.default_rng(0)
  examples = [(rng.integers(1, 48, rng.integers(1, 6)), rng.integers(1, 48, rng.integers(1, 10)))
              for _ in range(8)]
  batch, _ = sft_collate(examples, row_len=16, rows_per_micro=2)
  assert batch["tokens"].shape[0] >= 2   # several microbatches, several sequences per row
  tx = O.make_optimizer(O.OptimizerConfig(learning_rate=3e-2))
  state = S.init_state(CFG, tx, jax.random.PRNGKey(0))
  params = jax.device_get(state.params)

  # Reference: each example unpacked in its own row (right-padded; causal, so padding is never
  # seen), full logits, loss on the response tokens only.
  seqs = [np.concatenate([p, r]) for p, r in examples]
  width = max(map(len, seqs))
  rows = np.stack([np.pad(q, (0, width - len(q))) for q in seqs])
  lp = np.asarray(jax.nn.log_softmax(jax.jit(tfm.forward_logits, static_argnums=1)(
      params, CFG, jnp.asarray(rows[:, :-1])), -1))
  nll, count = 0.0, 0
  for b, (p, r) in enumerate(examples):
    t = np.arange(len(p) - 1, len(p) + len(r) - 1)
    nll -= lp[b, t, rows[b, t + 1]].sum()
    count += len(r)

  step = make_sft_step(CFG, tx)
  losses = []
  for _ in range(4):
    state, m = step(state, S.shard_batch(batch))
    losses.append(float(m["loss"]))
  assert float(m["tokens"]) == count
  np.testing.assert_allclose(losses[0], nll / count, rtol=1e-5)
  assert losses[-1] < losses[0] - 0.1


def test_one_rule_makes_rows_of_text_pairs():
  """sft_pairs_to_tokens, the rule of every SFT (launch/sft.py and the RL run's warm start): a
  pair of up to row_len + 1 tokens is kept whole, a longer one has its response cut to fit (the
  end never learned), a prompt over row_len tokens is an error."""
  import pytest
  from magistral_jax.model.char_tokenizer import char_tokenizer
  from magistral_jax.train.sft import sft_pair_arrays, sft_pairs_to_tokens
  tok = char_tokenizer()
  p = len(tok.apply_chat_template("1+2", None))
  row = p + 4   # room for 5 response tokens: 4 characters and EOS
  (whole, cut), n_cut = sft_pairs_to_tokens([("1+2", "abcd"), ("1+2", "abcdefgh")], tok, None,
                                            row)
  assert n_cut == 1
  assert whole[1] == tok.encode("abcd") + [tok.eos_id]
  assert len(whole[0]) + len(whole[1]) == row + 1
  assert cut[1] == tok.encode("abcde")   # cut: no EOS, so the model never learns to stop here
  arrays, n_cut = sft_pair_arrays([("1+2", "abcdefgh")], tok, None, row, 1)
  assert n_cut == 1 and int(arrays["loss_mask"].sum()) == 5   # one row, every position used
  [(_, one)], _ = sft_pairs_to_tokens([("1+2", "abc")], tok, None, p)
  assert one == tok.encode("a")   # a prompt of row_len tokens: one response token
  with pytest.raises(ValueError, match="raise sft.row_len"):
    sft_pairs_to_tokens([("1+2", "abc")], tok, None, p - 1)
