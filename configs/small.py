"""Magistral Small: cold-start SFT (configs/sft_small.py), then RL (paper §4).

RL: batch 2048 sequences, l_max − l_cache = 32k, temperature 1.0, eps_high 0.3.
"""
from magistral_jax.config import default_config
from magistral_jax.run.rehearsal import rehearsal_of

K = 1024
PROMPT_TOKENS = 4 * K       # engine.max_prefill_length
MAX_NEW_TOKENS = 40 * K     # sampling.max_new_tokens = l_max
TRAINER_DEVICES = 16


# `configs/small.py:rehearsal`: this recipe on a CPU host in a few minutes (magistral_jax/run/
# rehearsal.py: every knob kept, tiny model, the char tokenizer on synthetic arithmetic).
LENGTH_DIVISOR = 128       # prompt 4k -> 32, max_new_tokens 40k -> 320, l_max, l_cache, rows
BATCH_DIVISOR = 256        # n_batch, n_mini, n_async
GROUP_DIVISOR = 4          # group_size 16 -> 4
REHEARSAL_BATCHES = 4      # batches per stage


def get_config(arg=None):
  c = default_config()
  c.init.update(source="orbax", path="runs/sft_small/params")   # the SFT checkpoint
  c.tokenizer = "tekken_240911.json"
  c.system_prompt = "magistral"
  c.model.update(param_dtype="float32", dtype="bfloat16", remat="full")   # fp32 master weights, bf16 compute
  c.data.update(source="math500")
  c.rl.update(eps_low=0.2,             # NOT STATED
              eps_high=0.3, n_batch=2 * K, n_mini=2 * K,
              group_size=16,           # NOT STATED
              # A row holds the longest sequence, a 4k prompt and 40k new tokens (45,055 packed
              # tokens; collation never splits a sequence), and each of the trainer's 16
              # data-parallel devices gets one row per microbatch.
              microbatch_tokens=TRAINER_DEVICES * (PROMPT_TOKENS + MAX_NEW_TOKENS),
              microbatch_rows=TRAINER_DEVICES)
  c.optimizer.update(learning_rate=1e-6, warmup_steps=10)   # NOT STATED
  c.sampling.update(temperature=1.0, max_new_tokens=MAX_NEW_TOKENS)
  c.reward.update(l_max=40 * K, l_cache=8 * K)               # l_max − l_cache = 32k; l_cache NOT STATED
  c.pipeline.update(mode="async", n_async=4 * K)
  c.engine.update(max_concurrent_decodes=256, max_prefill_length=PROMPT_TOKENS)
  c.devices.update(trainer=TRAINER_DEVICES, generators=(8, 8), trainer_mesh={"fsdp": -1},
                   generator_mesh={"tensor": 4, "data": -1})
  c.eval.update(k=64, temperature=0.7, top_p=1.0, greedy=False, max_new_tokens=40 * K)
  c.num_batches = 500                  # NOT STATED
  if arg == "rehearsal":
    # 8 completions a batch (2 prompts x G=4), 32 in all: with a quarter of the cold-start
    # traces rambling, a run could end without one completion cut off at max_new_tokens (it
    # reached 265 of 320 once in CI); 40% rambling makes one near-certain.
    return rehearsal_of(c, length_divisor=LENGTH_DIVISOR, batch_divisor=BATCH_DIVISOR,
                        group_divisor=GROUP_DIVISOR, batches_per_stage=REHEARSAL_BATCHES,
                        ramble_rate=0.4)
  if arg:
    raise ValueError(f"configs/small.py: unknown config argument {arg!r}; expected rehearsal")
  return c
