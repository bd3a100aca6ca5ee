r"""The learning recipe (issue #51): SmolLM2-135M-Instruct, from its cold start, trained with GRPO
on a task where it has headroom, and a control run with the verdict replaced by a coin.

configs/smollm2.py's model, reward and system prompt; its sizes (`gpu`, `colocated`) and its
cold start (`sft`) too, then this recipe's task: the synthetic arithmetic task at difficulty
`task=synthetic/OPERAND/STEPS` (default LEARN_TASK, picked from the headroom table:
BENCHMARKS.md "Headroom"), "Compute 52-17+8." with the real math verifier on the exact answer.
Held out: the task's evaluation bucket (data/synthetic.py: never trained on), pass@1 averaged
over k samples, before, during and after (WORKDIR/eval_*.json, heldout_curve.jsonl;
bench/learn.py pairs them).

Arguments (comma-separated): `gpu` and `colocated` (configs/smollm2.py's sizes), `sft` (the cold
start on the task's own worked traces; bench/learn.py's GPU run starts from configs/smollm2.py's
GSM8K one instead),
`control` (the control run: reward.control=random at --config.reward.control_rate, no "before"
evaluation: the controlled run's is the same weights'), `task=`, `init=PATH|gguf`, `batches=N`,
`sft_steps=N`, `heldout=N`. bench/learn.py runs them all in order:

  python bench/learn.py --workdir=runs/learn_cpu      (2 CPU cores)
  bash bench/gpu_suite.sh learn       (one GPU; BENCHMARKS.md "A real model learns")
"""
import os

from magistral_jax.data import synthetic
from magistral_jax.run.recipes import recipe_args, recipe_module

# configs/smollm2.py, beside this file (a recipe is loaded by path, not as a package module).
smollm2 = recipe_module(os.path.join(os.path.dirname(os.path.abspath(__file__)), "smollm2.py"))

LEARN_TASK = "synthetic/20/1-3"   # picked from the headroom table (BENCHMARKS.md "Headroom")
# With `tools` (issue #67): a task whose arithmetic the model fails at without the interpreter
# (0.000 at pass@16 in the headroom table), and the cold start's share of traces that call it.
TOOLS_TASK = "synthetic/999/2-4"
TOOL_RATE = 0.5


def get_config(arg=None):
  args = recipe_args(arg, "configs/smollm2_learn.py",
                     switches=("sft", "gpu", "colocated", "control", "tools"),
                     values=("task", "init", "batches", "sft_steps", "heldout", "tool_rate",
                             "new_tokens"))
  c = smollm2.get_config(",".join(k for k in ("sft", "gpu", "colocated") if k in args))
  default_task = TOOLS_TASK if "tools" in args else LEARN_TASK
  c.data.update(source="synthetic", heldout_source="", heldout=256,
                **synthetic.set_options(args.get("task", default_task)))
  c.sampling.update(temperature=1.0, max_new_tokens=256)
  c.reward.update(l_max=256, l_cache=64)
  c.eval.update(k=4, temperature=0.7, max_new_tokens=256, every=5)
  if "gpu" in args:
    # 32 prompts x G=8 a batch, 4 optimizer steps of 64 (the later ones off-policy within the
    # clip), lr NOT STATED: one step a batch at the GSM8K recipe's lr moved nothing. Rows of 768
    # tokens: the 512-token prompt limit + 256 new tokens. BENCHMARKS.md "A real model learns".
    c.rl.update(n_batch=256, n_mini=64, group_size=8, microbatch_tokens=32 * 768,
                microbatch_rows=32)
    c.optimizer.update(learning_rate=1e-5)
    c.engine.update(max_concurrent_decodes=256)
    c.eval.every = 8
    c.num_batches = 32
  else:
    # 2 CPU cores: short prompts (the synthetic task's one-line instruction, not the paper's
    # system prompt) and the cold start on the task's own worked traces (GSM8K's would take
    # hours here). 4 prompts x G=8 a batch: at this policy's low pass@1, groups of 4 mostly had
    # no correct sample and were dropped. One optimizer step a batch: two smaller ones broke the
    # format (the noise of small steps at Adam's full step size). Rows of 160 tokens: a short
    # prompt + 64 new tokens; remat off (rows this short need no memory saving).
    # `new_tokens=N` (default 64; 96 with `tools`, whose task's 4-step traces run to ~70
    # tokens, as its baseline without the tool must have too) sets every length from it.
    new = int(args.get("new_tokens", 96 if "tools" in args else 64))
    c.system_prompt = "tiny"
    c.model.remat = "none"
    c.engine.update(max_concurrent_decodes=32, max_prefill_length=96)
    c.sampling.max_new_tokens = new
    c.reward.update(l_max=new, l_cache=new // 4)
    c.eval.update(max_new_tokens=new, every=0)
    c.rl.update(n_batch=32, n_mini=32, group_size=8, microbatch_tokens=8 * (96 + new),
                microbatch_rows=8)
    c.optimizer.update(learning_rate=1.5e-5)
    c.num_batches = 24
    if "sft" in args:
      c.init.update(source="gguf", path="")
      c.sft.update(num_steps=12, batch_size=8, rows_per_micro=8, row_len=64 + new,
                   learning_rate=2e-4)
  if "tools" in args:
    # Issue #67: the policy may call the interpreter (tool_use/protocol.py). Its cold start
    # calls it in TOOL_RATE of the traces (synthetic.tool_trace: print the expression, copy
    # the result into the box) and works the steps in the rest, so RL has a choice to learn:
    # call the tool more. The same recipe without `tools` is its baseline (bench/learn.py
    # --tools runs both).
    c.tools.enabled = True
    c.data.sft_tool_rate = float(args.get("tool_rate", TOOL_RATE))
  if "control" in args:
    c.reward.control = "random"
    c.eval.before = False
  smollm2.apply_common(c, args)
  return c
