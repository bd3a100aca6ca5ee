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
