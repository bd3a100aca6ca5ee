"""Magistral Small: cold-start SFT (configs/sft_small.py), then RL (SPEC §4).

RL: batch 2048 sequences, l_max − l_cache = 32k, temperature 1.0, eps_high 0.3.
"""
from magistral_jax.config import default_config

K = 1024


def get_config(arg=None):
  c = default_config()
  c.init.update(source="orbax", path="runs/sft_small/params")   # the SFT checkpoint
  c.tokenizer = "tekken_240911.json"
  c.system_prompt = "magistral"
  c.model.update(param_dtype="bfloat16", dtype="bfloat16", remat="full")
  c.data.update(source="math500")
  c.rl.update(eps_low=0.2,             # NOT STATED
              eps_high=0.3, n_batch=2 * K, n_mini=2 * K,
              group_size=16,           # NOT STATED
              microbatch_tokens=64 * K, microbatch_rows=4)
  c.optimizer.update(learning_rate=1e-6, warmup_steps=10)   # NOT STATED
  c.sampling.update(temperature=1.0, max_new_tokens=40 * K)
  c.reward.update(l_max=40 * K, l_cache=8 * K)               # l_max − l_cache = 32k; l_cache NOT STATED
  c.pipeline.update(mode="async", n_async=4 * K)
  c.engine.update(max_concurrent_decodes=256, max_prefill_length=4 * K)
  c.devices.update(trainer=16, generators=(8, 8), trainer_mesh={"fsdp": -1},
                   generator_mesh={"tensor": 4, "data": -1})
  c.eval.update(k=64, temperature=0.7, top_p=1.0, greedy=False, max_new_tokens=40 * K)
  c.num_batches = 500                  # NOT STATED
  return c
