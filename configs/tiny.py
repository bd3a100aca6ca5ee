"""The CPU default: synthetic multi-step arithmetic with a character-level tokenizer.

A 4-layer, 128-wide decoder is warm-started by SFT on worked traces in the
Magistral format, then trained with the full async pipeline (trainer on 4 simulated devices, two
generators on 2 each) and the full Magistral reward through the real math verifier.

Variants: configs/tiny.py:adv_norm=group, :mode=sync, :eps_high=0.2, :n_mini_per_batch=4,
:batches=20, :sft_steps=100 (see _apply_arg); combined with commas.

`configs/tiny.py:colocated` is the one-device layout: the trainer and one generator share one
device and take turns (generation phase, then training; pipeline/taking_turns.py), for
`XLA_FLAGS=--xla_force_host_platform_device_count=1` or one GPU. `:colocated,mode=async` keeps
generating one batch ahead with the previous weights while a batch trains.

`configs/tiny.py:multihost` is the many-host layout rehearsed as 3 local processes of 2 devices
(the generator process generates on one of them):
`python launch/local_cluster.py --num_processes=3 --devices_per_process=2 -- launch/train.py
--config=configs/tiny.py:multihost --workdir=W` (parallel/multihost.py).
"""
from magistral_jax.config import default_config
from magistral_jax.run.recipes import recipe_args

RL_KEYS = ("adv_norm", "eps_high", "eps_low", "n_mini", "n_batch", "loss_agg", "group_size")


def get_config(arg=None):
  c = default_config()
  c.seed = 0
  c.model.update(vocab_size=104, hidden_size=128, intermediate_size=384, num_layers=4,
                 num_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=512,
                 bos_token_id=1, eos_token_id=2)
  c.tokenizer = "char"
  c.system_prompt = "tiny"   # a one-line prompt: the paper's is ~900 characters of char tokens
  # 1-3 steps of + and - on operands 0..9, never below zero: "Compute 7+2-5." -> 4.
  c.data.update(source="synthetic", min_steps=1, max_steps=3, max_operand=9,
                allow_negative=False, heldout=128, sft_slip_rate=0.4)
  # The cold start teaches the format and the arithmetic facts at a constant lr, stopped while
  # its loss is still falling. Its demonstrator is imperfect: 40% of the traces make one
  # arithmetic slip (an off-by-one step whose error carries to the boxed answer), as a cold start
  # distilled from another model's traces would. The SFT policy imitates the slips; the
  # verifier's reward is what teaches it to stop (BENCHMARKS.md "Tiny default run"). One problem
  # text in 8 is reserved for evaluation (data/synthetic.py): a 1-step problem held out is still
  # practised as a step of longer ones, so the training distribution keeps every fact.
  c.sft.update(num_steps=800, batch_size=32, learning_rate=3e-3, row_len=256, rows_per_micro=4)
  # 8 prompts x G=8 per batch, two optimizer steps per batch (n_mini = n_batch / 2: the paper
  # finds n_batch = n_mini best and more than 2 minibatches harmful; why 2 here: docs/ablations.md
  # (d)).
  c.rl.update(eps_low=0.2, eps_high=0.28, n_batch=64, n_mini=32, group_size=8,
              microbatch_tokens=2048, microbatch_rows=4)
  # RL lr: the fastest learner of the three tried, neither undoing the cold start (a noisy
  # gradient at 8 prompts a batch) nor barely moving (BENCHMARKS.md "Tiny default run").
  c.optimizer.update(learning_rate=2e-4, warmup_steps=0, grad_clip_norm=1.0)
  c.sampling.update(temperature=1.0, max_new_tokens=64)
  c.engine.update(max_concurrent_decodes=16, max_prefill_length=64)
  # l_max - l_cache tokens free: a 3-step trace fits them; penalty up to l_max.
  c.reward.update(l_max=64, l_cache=16)
  c.verifier.update(num_workers=1, task_timeout_s=30.0)
  # n_async = 0: 2 x n_batch (the paper's n_async / n_batch = 2) whatever n_batch a variant sets.
  c.pipeline.update(mode="async", n_async=0, sample_every=5, batch_timeout_s=600.0)
  c.devices.update(trainer=4, generators=(2, 2), trainer_mesh={"fsdp": -1},
                   generator_mesh={"tensor": -1})
  # The paper's evaluation: temperature 0.7, top-p 1.0, pass@1 averaged over k samples.
  c.eval.update(k=4, greedy=False, temperature=0.7, top_p=1.0, max_new_tokens=64)
  c.checkpoint.update(every=10, keep=21)   # all 21 (0, 10, .., 200): the PCA notebook reads them
  c.num_batches = 200
  _apply_arg(c, arg)
  return c


def _apply_arg(c, arg):
  """`configs/tiny.py:adv_norm=group,mode=sync,eps_high=0.2,n_mini=8,batches=4`."""
  args = recipe_args(arg, "configs/tiny.py", switches=("colocated", "multihost", "tools"),
                     values=RL_KEYS + ("n_mini_per_batch", "mode", "batches", "slip",
                                       "sft_steps"))
  # colocated/multihost first: a mode=... given with them wins
  for key in sorted(args, key=lambda k: k not in ("colocated", "multihost")):
    value = args[key]
    if key in RL_KEYS:
      c.rl[key] = type(c.rl[key])(value)
    elif key == "n_mini_per_batch":   # optimizer steps per batch: n_mini = n_batch / this
      if c.rl.n_batch % int(value):
        raise ValueError(f"configs/tiny.py: n_batch={c.rl.n_batch} is not divisible by "
                         f"n_mini_per_batch={value}")
      c.rl.n_mini = c.rl.n_batch // int(value)
    elif key == "mode":
      c.pipeline.mode = value
    elif key == "colocated":   # one device: trainer and generator share it and take turns
      c.devices.update(trainer=1, colocated=True)
      c.pipeline.mode = "sync"
      # One CPU device runs each step on about one core (the disaggregated layout's 8 simulated
      # devices keep both busy), so the cold start and the RL run are shortened to fit the
      # make-run budget on 2 cores (BENCHMARKS.md "One device, colocated" has what they reach).
      # Later arguments (sft_steps=, batches=) still override these.
      c.sft.num_steps, c.num_batches = 500, 140
    elif key == "multihost":   # 3 processes x 2 devices: launch/local_cluster.py
      # Trainer = processes 0 and 1 (FSDP over their 4 devices); generator = process 2, on one of
      # its devices. Once jax.distributed is up, XLA:CPU runs every collective over gloo, even
      # between two devices of one process (TCP to itself), so a tensor-parallel generator here
      # spends its time in the kernel (BENCHMARKS.md "Many hosts"). The cross-process push to a
      # tensor-parallel generator is tested on its own (tests/parallel/test_multihost.py).
      # Fewer, longer microbatches mean fewer FSDP gathers: half the cold start's rows, 8 RL
      # rows (the sequences are short). Three processes on 2 cores train slower than one
      # process, so the cold start and the RL run are shortened, as for `colocated`. Later
      # arguments (sft_steps=, batches=) still override these.
      c.devices.update(trainer_processes=2, generator_process_devices=1)
      c.sft.rows_per_micro = 16
      c.rl.update(microbatch_tokens=2048, microbatch_rows=8)
      c.sft.num_steps, c.num_batches = 500, 120
    elif key == "tools":   # issue #67: the policy may call the interpreter (tool_use/protocol.py)
      # Half the cold start's traces call it for the whole expression (synthetic.tool_trace);
      # the system prompt says how; a result block needs room: 64 more new tokens.
      c.tools.enabled = True
      c.data.sft_tool_rate = 0.5
      c.sampling.max_new_tokens = c.eval.max_new_tokens = 128
      c.reward.update(l_max=128, l_cache=32)
      c.engine.max_prefill_length = 96
      c.rl.microbatch_tokens = c.rl.microbatch_rows * 288   # rows of 96 + 128 + slack
      c.sft.row_len = 512
    elif key == "batches":
      c.num_batches = int(value)
    elif key == "slip":   # fraction of cold-start traces with one arithmetic slip
      c.data.sft_slip_rate = float(value)
    elif key == "sft_steps":
      c.sft.num_steps = int(value)

