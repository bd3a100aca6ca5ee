"""The cold-start SFT of Magistral Small (paper §4): 4 epochs on Medium's correct traces, open
prompts answered by Medium, and 10% general instruction data (SFT traces dataset, see
magistral_jax/data). Run with launch/sft.py (issue: launchers)."""
from magistral_jax.config import default_config


def get_config(arg=None):
  c = default_config()
  c.init.update(source="hf", path="/path/to/mistral-small-3")
  c.tokenizer = "tekken_240911.json"
  c.model.update(param_dtype="float32", dtype="bfloat16", remat="full")   # fp32 master weights, bf16 compute
  c.sft.update(epochs=4, batch_size=512, learning_rate=1e-5,   # batch and lr NOT STATED
               row_len=32 * 1024, rows_per_micro=4)
  c.data.update(source="sft_traces")
  return c
