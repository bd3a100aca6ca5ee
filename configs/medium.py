"""Magistral Medium: pure RL from the instruct model, in stages (paper §4).

Stages keep the data not too easy, grow the length budget (l_max − l_cache 16k → 24k → 32k) and
shrink the batch as sequences grow (8k → 4k → 2k sequences) to bound KV memory. n_batch = n_mini
(one optimizer step per batch); n_async / n_batch ≤ 2; eps_high 0.28.
"""
from magistral_jax.config import default_config
from magistral_jax.run.rehearsal import rehearsal_of

K = 1024
PROMPT_TOKENS = 4 * K       # engine.max_prefill_length
MAX_NEW_TOKENS = 40 * K     # sampling.max_new_tokens: l_max of the last stage
TRAINER_DEVICES = 64


# `configs/medium.py:rehearsal`: this recipe on a CPU host in a few minutes (magistral_jax/run/
# rehearsal.py: every knob kept, tiny model, the char tokenizer on synthetic arithmetic).
LENGTH_DIVISOR = 128       # prompt 4k -> 32, max_new_tokens 40k -> 320, l_max, l_cache, rows
BATCH_DIVISOR = 512        # n_batch, n_mini, n_async
GROUP_DIVISOR = 4          # group_size 16 -> 4
REHEARSAL_BATCHES = 2      # batches per stage


def get_config(arg=None):
  c = default_config()
  c.init.update(source="hf", path="/path/to/mistral-medium-3")   # the instruct checkpoint
  c.tokenizer = "tekken_240911.json"   # Mistral's Tekken tokenizer (mistral-common)
  c.system_prompt = "magistral"
  c.model.update(param_dtype="float32", dtype="bfloat16", remat="full")   # fp32 master weights, bf16 compute
  c.data.update(source="math500")      # point data_dir at the filtered 38k math + 35k code sets
  c.rl.update(eps_low=0.2,             # NOT STATED
              eps_high=0.28, adv_norm="minibatch", loss_agg="token",
              n_batch=8 * K, n_mini=8 * K,
              group_size=16,           # NOT STATED
              # A row holds the longest sequence, a 4k prompt and 40k new tokens (45,055 packed
              # tokens; collation never splits a sequence), and each of the trainer's 64
              # data-parallel devices gets one row per microbatch.
              microbatch_tokens=TRAINER_DEVICES * (PROMPT_TOKENS + MAX_NEW_TOKENS),
              microbatch_rows=TRAINER_DEVICES)
  c.optimizer.update(learning_rate=1e-6, warmup_steps=10)   # NOT STATED
  c.sampling.update(temperature=1.0,   # NOT STATED for Medium's RL
                    max_new_tokens=MAX_NEW_TOKENS)
  c.engine.update(max_concurrent_decodes=256, max_prefill_length=PROMPT_TOKENS)
  c.reward.update(l_max=16 * K + 8 * K, l_cache=8 * K)     # l_cache NOT STATED
  c.pipeline.update(mode="async", n_async=16 * K)          # n_async / n_batch = 2
  c.devices.update(trainer=TRAINER_DEVICES, generators=(32, 32), trainer_mesh={"fsdp": -1},
                   generator_mesh={"tensor": 8, "data": -1})
  c.eval.update(k=64, temperature=0.7, top_p=1.0, greedy=False, max_new_tokens=40 * K)
  # Stage count and lengths NOT STATED beyond the 16k/24k/32k and 8k/4k/2k progression. A stage
  # generates at most its l_max (past it the length penalty is -0.1 whatever the answer), so
  # its generators decode up to l_max, not the last stage's 40k.
  c.stages = tuple(
      {"name": name, "num_batches": 200,
       "overrides": {"rl.n_batch": n, "rl.n_mini": n, "reward.l_max": l_max,
                     "sampling.max_new_tokens": l_max, "pipeline.n_async": 2 * n}}
      for name, n, l_max in (("16k", 8 * K, 24 * K), ("24k", 4 * K, 32 * K),
                             ("32k", 2 * K, 40 * K)))
  if arg == "rehearsal":
    return rehearsal_of(c, length_divisor=LENGTH_DIVISOR, batch_divisor=BATCH_DIVISOR,
                        group_divisor=GROUP_DIVISOR, batches_per_stage=REHEARSAL_BATCHES)
  if arg:
    raise ValueError(f"configs/medium.py: unknown config argument {arg!r}; expected rehearsal")
  return c
