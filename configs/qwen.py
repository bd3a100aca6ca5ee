r"""Your own Hugging Face checkpoint (Qwen2.5, Qwen3, Llama, Mistral) on GSM8K (README, "Bring your
own model").

  python launch/train.py --config=configs/qwen.py:path=/ckpt/Qwen3-0.6B --workdir=runs/qwen

`path=DIR` is a folder as `save_pretrained` writes it: config.json, the safetensors (one file or
shards with their index) and tokenizer.json. The architecture comes from its config.json
(Qwen2ForCausalLM, Qwen3ForCausalLM, LlamaForCausalLM, MistralForCausalLM; an unsupported
feature, e.g. MoE or a yarn rope, stops the run naming it), the weights are read onto the
trainer's mesh slice by slice (model/hf_sharded.py), and the tokenizer is the checkpoint's.

An instruct model rarely writes the paper's format (`<think>...</think>` then a boxed answer)
unprompted: every reward is then 0 and no GRPO group has an advantage. Check the raw model first
(`python launch/eval.py --config=configs/qwen.py:path=DIR --workdir=W`: its format rate); if it
is near 0, cold-start it on worked traces as configs/smollm2.py does (`launch/sft.py` with
data.source=gsm8k_traces), then RL from the SFT weights with `sft=SFT_WORKDIR/params`.

One accelerator by default: the trainer and one generator share it and take turns
(devices.colocated; pipeline.mode=sync), fp32 master weights with bf16 compute and a bf16
generator. Fit: `python launch/plan.py --config=configs/qwen.py:path=DIR` before launching.

Arguments (comma-separated): `path=DIR` (the checkpoint), `sft=DIR` (RL from launch/sft.py's
params instead), `batches=N`, `heldout=N`, `tiny` (the CPU rehearsal CI runs on a random-init
checkpoint: the synthetic arithmetic task with the character tokenizer, after a short cold
start, tests/launch/test_qwen_recipe.py).
"""
import os

from magistral_jax.config import default_config
from magistral_jax.run.recipes import recipe_args

TRAIN, TEST = "gsm8k_train", "gsm8k_test"   # shipped GSM8K splits (data/sources/SOURCES.md)
PATH = "/path/to/your/checkpoint"


def get_config(arg=None):
  args = recipe_args(arg, "configs/qwen.py", switches=("tiny",),
                     values=("path", "sft", "batches", "heldout"))
  path = args.get("path", PATH)
  c = default_config()
  c.seed = 0
  c.init.update(source="hf", path=path)
  c.tokenizer = os.path.join(path, "tokenizer.json")
  c.system_prompt = "magistral"
  c.model.update(param_dtype="float32", dtype="bfloat16", remat="full", logits_chunk=256)
  c.data.update(source=TRAIN, heldout_source=TEST, heldout=128)
  # 32 prompts x G=8 a batch, 4 optimizer steps of 64 completions (NOT STATED at this scale;
  # the learning recipe's on an H100, BENCHMARKS.md "A real model learns"). Rows of 1536 tokens:
  # the 512-token prompt limit + 1024 new tokens.
  c.rl.update(eps_low=0.2, eps_high=0.28, n_batch=256, n_mini=64, group_size=8,
              microbatch_tokens=16 * 1536, microbatch_rows=16)
  c.optimizer.update(learning_rate=1e-6, warmup_steps=5)   # NOT STATED
  c.sampling.update(temperature=1.0, max_new_tokens=1024)
  c.engine.update(max_concurrent_decodes=256, max_prefill_length=512)
  c.reward.update(l_max=1024, l_cache=256)    # scaled to one accelerator; the paper's is 40k/8k
  c.verifier.update(num_workers=8)
  c.devices.update(trainer=1, colocated=True)
  c.pipeline.update(mode="sync", batch_timeout_s=3600.0)
  c.eval.update(k=4, temperature=0.7, top_p=1.0, greedy=False, max_new_tokens=1024, every=10)
  c.checkpoint.update(every=10, keep=3)
  c.num_batches = 100

  if "tiny" in args:
    # The CPU rehearsal on a random-init checkpoint of the real architecture: configs/tiny.py's
    # task narrowed as tests/launch/test_tiny_learns.py narrows it (operands 0..4, 1-2 steps),
    # the character tokenizer, one device, after a short cold start from the checkpoint
    # (launch/sft.py with `tiny`, 50 steps on clean traces); then one optimizer step a batch of
    # 16 prompts x G=8 at a raised lr, so that 16 batches move the policy past the noise; the
    # lr tests/launch/test_tiny_learns.py takes: at twice it, single steps break the format and
    # the reward swings between batches instead of rising.
    c.tokenizer = "char"
    c.system_prompt = "tiny"
    c.model.update(param_dtype="float32", dtype="float32", remat="none", logits_chunk=128)
    c.data.update(source="synthetic", heldout_source="", min_steps=1, max_steps=2, max_operand=4,
                  allow_negative=False, heldout=32)
    c.sft.update(num_steps=50, batch_size=32, learning_rate=3e-3, row_len=128,
                 rows_per_micro=8)
    c.rl.update(n_batch=128, n_mini=128, group_size=8, microbatch_tokens=8 * 128,
                microbatch_rows=8)
    c.optimizer.update(learning_rate=5e-4, warmup_steps=0)
    c.sampling.update(temperature=1.0, max_new_tokens=48)
    c.engine.update(max_concurrent_decodes=64, max_prefill_length=64)
    c.reward.update(l_max=48, l_cache=16)
    c.verifier.update(num_workers=1, task_timeout_s=30.0)
    c.pipeline.update(batch_timeout_s=600.0)
    c.eval.update(k=2, max_new_tokens=48, every=0)
    c.checkpoint.update(every=4, async_save=False)
    c.num_batches = 16

  if "sft" in args:
    c.init.update(source="orbax", path=args["sft"])
  if "batches" in args:
    c.num_batches = int(args["batches"])
  if "heldout" in args:
    c.data.heldout = int(args["heldout"])
  return c

