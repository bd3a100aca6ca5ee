"""Benchmark: the async RL pipeline against its synchronous twin; generator utilisation.

Setup: 8 simulated CPU devices (`--layout`, default 4,2,2: trainer FSDP on 4, two tensor-parallel
generators on 2 each), the real VerifierPool and math verifier, the tiny model of
tests/test_pipeline.py SFT-warm-started on synthetic arithmetic so response lengths spread as RL
completions do. Both modes run train.rl_loop.train from the same params, programs, prompts and
seeds, after a 1-batch warm-up; `--repeats` rounds alternate the order; medians are reported.
Sync generates one batch per policy version; async keeps 2 * n_batch completions generating.
`--colocated`: one generator on the trainer's devices, turn-taking against one batch of lookahead.
The weight push between these layouts is bench/weight_push.py --reshard.

  python bench/pipeline.py [--batches 10 --repeats 5] [--colocated]

Last line, one JSON object: async_over_sync_throughput (scored completions/s),
async_over_sync_trained_throughput, generator_utilization, decode_utilization,
response_length_{min,p10,p50,p90,max}, per-mode diagnostics.
"""
import common

common.use_cpu_devices(8)   # a trainer slice and two generator slices

import json  # noqa: E402
import logging  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

MAX_STEPS = 8          # synthetic problems with 1..MAX_STEPS operations
MAX_NEW = 112          # response cap (the longest SFT trace is ~95 tokens)
MAX_PREFILL = 96       # prompts are 51..~80 tokens; one prefill bucket, so one compile


def _host_cpu_jiffies() -> tuple[int, int]:
  """(busy, total) CPU jiffies of the whole host, from /proc/stat ((0, 0) where there is none)."""
  try:
    with open("/proc/stat") as f:
      vals = [int(v) for v in f.readline().split()[1:]]
  except (OSError, ValueError):
    return 0, 0
  idle = vals[3] + (vals[4] if len(vals) > 4 else 0)   # idle + iowait
  return sum(vals) - idle, sum(vals)


def main():
  ap = common.argument_parser(__doc__)
  ap.add_argument("--batches", type=int, default=10, help="measured batches per mode")
  ap.add_argument("--repeats", type=int, default=5,
                  help="sync/async runs per mode, order alternating; figures are medians")
  ap.add_argument("--sft_steps", type=int, default=250)
  ap.add_argument("--seed", type=int, default=1)
  ap.add_argument("--layout", default="4,2,2",
                  help="devices of the trainer, then of each generator, for the throughput runs")
  ap.add_argument("--colocated", action="store_true",
                  help="one generator on the trainer's devices: sync = taking turns, async = "
                       "one batch of lookahead (--layout N: the trainer's device count)")
  args = ap.parse_args()
  if args.colocated and args.layout == "4,2,2":
    args.layout = "1"
  if args.batches < 2:
    ap.error("--batches must be >= 2 (throughput is measured from the end of batch 1)")
  logging.basicConfig(level=logging.WARNING)

  from magistral_jax.data import synthetic
  from magistral_jax.generate.engine import Engine
  from magistral_jax.generate.loop import GeneratorLoop
  from magistral_jax.generate.config import SamplingConfig
  from magistral_jax.model import transformer as T
  from magistral_jax.model.char_tokenizer import char_tokenizer
  from magistral_jax.model.config import ModelConfig
  from magistral_jax.parallel.config import TRAINER_RULES
  from magistral_jax.parallel.sharding import make_mesh
  from magistral_jax.parallel.config import GENERATOR_RULES
  from magistral_jax.pipeline.config import PipelineConfig
  from magistral_jax.pipeline.rollouts import Rollouts
  from magistral_jax.parallel.layout import split_devices
  from magistral_jax.train.sft import sft_warm_start
  from magistral_jax.rewards.config import RewardConfig
  from magistral_jax.rl.config import GRPOConfig
  from magistral_jax.train.optimizer import make_optimizer
  from magistral_jax.train.config import OptimizerConfig, SFTConfig
  from magistral_jax.train.rl_loop import Trainer, train
  from magistral_jax.train.sft import make_sft_step
  from magistral_jax.train.step import init_state, make_grpo_step
  from magistral_jax.verify.pool import VerifierPool

  t_start = time.time()
  tok = char_tokenizer()
  cfg = ModelConfig(vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=128,
                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                    eos_token_id=tok.eos_id, bos_token_id=tok.bos_id)
  # 8 rows of 256 tokens: a minibatch of 8 completions (<= ~200 tokens each) always fits in one
  # microbatch, so the train step compiles once.
  grpo = GRPOConfig(n_batch=16, n_mini=8, group_size=4, microbatch_tokens=2048, microbatch_rows=8)
  try:   # split_devices checks the counts (a trainer, >= 1 generator, enough devices)
    layout = [int(x) for x in args.layout.split(",")]
    tdev, gdevs = split_devices(layout[0], layout[1:], colocated=args.colocated)
  except ValueError as e:
    ap.error(f"--layout {args.layout!r}: comma-separated device counts, trainer first: {e}")
  tmesh = make_mesh({"fsdp": len(tdev)}, tdev)
  problems = lambda seed: synthetic.problems(seed, min_steps=1, max_steps=MAX_STEPS)

  # ---- SFT warm start on 1..MAX_STEPS-step traces ------------------------------------------
  t = time.time()
  tx = make_optimizer(OptimizerConfig(learning_rate=5e-3))
  state = init_state(cfg, tx, jax.random.PRNGKey(0), tmesh, TRAINER_RULES)
  examples = ((p["problem"], synthetic.trace(p)) for p in problems(0))
  state, sft_m = sft_warm_start(state, make_sft_step(cfg, tx, tmesh, TRAINER_RULES), tok, examples,
                                SFTConfig(num_steps=args.sft_steps, batch_size=8, row_len=256,
                                          rows_per_micro=8),
                                system_prompt=synthetic.TINY_SYSTEM_PROMPT, mesh=tmesh,
                                log_every=50)
  params = jax.device_get(state.params)
  del state
  sft_s = time.time() - t
  print(f"sft: {args.sft_steps} steps in {sft_s:.1f}s, nll/token "
        f"{sft_m.get('nll_per_token', float('nan')):.3f}", flush=True)

  sampling = SamplingConfig(temperature=1.0, max_new_tokens=MAX_NEW, eos_id=tok.eos_id)
  engines = [Engine(cfg, make_mesh({"tensor": len(d)}, d), GENERATOR_RULES,
                    max_concurrent_decodes=8, max_prefill_length=MAX_PREFILL,
                    max_decode_length=MAX_NEW, prefill_buckets=(MAX_PREFILL,), sampling=sampling)
             for d in gdevs]
  rl_tx = make_optimizer(OptimizerConfig(learning_rate=1e-3))
  train_step = make_grpo_step(cfg, grpo, rl_tx, tmesh, TRAINER_RULES)
  pool = VerifierPool(1, RewardConfig(l_max=MAX_NEW, l_cache=16), task_timeout_s=30)

  def run_mode(mode: str, num_batches: int, lengths: list | None = None):
    state = init_state(cfg, rl_tx, jax.random.PRNGKey(0), tmesh, TRAINER_RULES, params=params)
    gens = [GeneratorLoop(e, params, 0, seed=args.seed + i, sampling=e.sampling) for i, e in enumerate(engines)]
    ends = []
    trainer = Trainer(train_step, state, tmesh, TRAINER_RULES)
    pipe = Rollouts(generators=gens, pool=pool, tokenizer=tok, prompts=problems(args.seed),
                    grpo_cfg=grpo,
                    cfg=PipelineConfig(mode=mode, batch_timeout_s=300),
                    system_prompt=synthetic.TINY_SYSTEM_PROMPT, seed=args.seed,
                    colocated=args.colocated)
    if lengths is not None:   # record every generated completion's length (dropped groups too)
      for g in gens:
        g.callback = (lambda c, f=g.callback: (lengths.append(len(c.tokens)), f(c)))
    t0 = time.time()
    cpu0 = _host_cpu_jiffies()
    with pipe:
      history = train(trainer, pipe, grpo, num_batches, seed=args.seed,
                      on_batch=lambda _t, _m: ends.append((time.time(),
                                                           pipe.counters["groups_scored"])))
    cpu1 = _host_cpu_jiffies()
    if len(history) != num_batches:
      raise RuntimeError(f"{mode}: only {len(history)}/{num_batches} batches ran")
    if num_batches < 2:
      return {}
    (t_first, scored_first), (t_last, scored_last) = ends[0], ends[-1]
    return {
        "completions_per_s": grpo.group_size * (scored_last - scored_first) / (t_last - t_first),
        "trained_completions_per_s": grpo.n_batch * (num_batches - 1) / (t_last - t_first),
        "trained_completions_per_s_incl_fill": grpo.n_batch * num_batches / (t_last - t0),
        "scored_completions": int(pipe.counters["groups_scored"] * grpo.group_size),
        "groups_dropped_frac": pipe.counters["groups_dropped"] / max(1, pipe.counters["groups_scored"]),
        "generator_utilization": float(np.mean([h["generator_utilization"] for h in history[1:]])),
        "generator_utilization_per_batch": [round(h["generator_utilization"], 3) for h in history],
        **{k: float(np.mean([h[f"generator_{k}"] for h in history[1:]]))
           for k in ("slot_occupancy", "decode_frac", "decode_utilization")},
        "trainer_idle_frac": float(np.mean([h["trainer_idle_frac"] for h in history[1:]])),
        "train_time_s": float(np.mean([h["train_time_s"] for h in history[1:]])),
        "weight_push_s": float(np.mean([h["weight_push_s"] for h in history[1:]])),
        "version_lag_mean": float(np.mean([h["version_lag_mean"] for h in history[1:]])),
        "reward": float(np.mean([h.get("reward", 0.0) for h in history[1:]])),
        "wall_s": time.time() - t0,
        # Share of the host's CPU capacity (all cores, all processes) busy during this run.
        "host_cpu_busy_frac": (cpu1[0] - cpu0[0]) / max(1, cpu1[1] - cpu0[1]),
        # Whole run (fill included): decode steps and their mean time, tokens per decode step.
        "decode_steps": int(sum(g.counters.steps for g in gens)),
        "decode_step_ms": 1e3 * sum(g.counters.decode_time_s for g in gens) / max(1, sum(g.counters.steps for g in gens)),
        "tokens_per_decode_step": sum(g.counters.generated_tokens for g in gens) / max(1, sum(g.counters.steps for g in gens)),
        "verifier_latency_s": float(np.mean([h["verifier_latency_s"] for h in history[1:]])),
        **{k: float(np.max([h[k] for h in history])) for k in history[0] if "peak" in k},
    }

  out = {}
  try:
    t = time.time()
    run_mode("sync", 1)    # compiles prefill/insert/generate, the train step and the pushes
    warm_s = time.time() - t
    print(f"warm-up batch (compiles): {warm_s:.1f}s", flush=True)
    lengths = []
    runs = {"sync": [], "async": []}
    for r in range(args.repeats):   # alternate the order so drifting host load hits both modes
      for mode in (("sync", "async") if r % 2 == 0 else ("async", "sync")):
        runs[mode].append(run_mode(mode, args.batches, lengths))
        print(f"{mode} (repeat {r}): " + json.dumps({k: (round(v, 4) if isinstance(v, float) else v)
                                                     for k, v in runs[mode][-1].items()}), flush=True)
  finally:
    pool.close()
  L = np.asarray(lengths)
  rate = {m: float(np.median([x["completions_per_s"] for x in runs[m]])) for m in runs}
  trained = {m: float(np.median([x["trained_completions_per_s"] for x in runs[m]])) for m in runs}
  util = {m: float(np.median([x["generator_utilization"] for x in runs[m]])) for m in runs}
  out.update(
      async_over_sync_throughput=rate["async"] / rate["sync"],
      async_over_sync_per_repeat=[a["completions_per_s"] / s["completions_per_s"]
                                  for a, s in zip(runs["async"], runs["sync"])],
      async_over_sync_trained_throughput=trained["async"] / trained["sync"],
      async_over_sync_trained_per_repeat=[
          a["trained_completions_per_s"] / s["trained_completions_per_s"]
          for a, s in zip(runs["async"], runs["sync"])],
      groups_dropped_frac_per_repeat={m: [round(x["groups_dropped_frac"], 3) for x in runs[m]]
                                      for m in runs},
      host_cpu_busy_frac={m: float(np.median([x["host_cpu_busy_frac"] for x in runs[m]]))
                          for m in runs},
      generator_utilization=util["async"], sync_generator_utilization=util["sync"],
      **{f"{m}_generator_{k}": float(np.median([x[k] for x in runs[m]]))
         for m in ("async", "sync") for k in ("slot_occupancy", "decode_frac", "decode_utilization")},
      async_completions_per_s=rate["async"], sync_completions_per_s=rate["sync"],
      async_trained_completions_per_s=trained["async"],
      sync_trained_completions_per_s=trained["sync"],
      async_decode_step_ms=float(np.median([x["decode_step_ms"] for x in runs["async"]])),
      sync_decode_step_ms=float(np.median([x["decode_step_ms"] for x in runs["sync"]])),
      async_tokens_per_decode_step=float(np.median([x["tokens_per_decode_step"] for x in runs["async"]])),
      sync_tokens_per_decode_step=float(np.median([x["tokens_per_decode_step"] for x in runs["sync"]])),
      groups_dropped_frac=float(np.mean([x["groups_dropped_frac"] for m in runs for x in runs[m]])),
      response_length_min=int(L.min()), response_length_p10=float(np.percentile(L, 10)),
      response_length_p50=float(np.percentile(L, 50)),
      response_length_p90=float(np.percentile(L, 90)), response_length_max=int(L.max()),
      response_length_spread_p90_over_p10=float(np.percentile(L, 90) / np.percentile(L, 10)),
      response_length_spread_max_over_min=float(L.max() / L.min()),
      batches_per_mode=args.batches, repeats=args.repeats, sft_s=sft_s, warmup_s=warm_s)

  out["colocated"] = args.colocated
  if args.colocated:
    for m in runs:
      for k in runs[m][0]:
        if "peak" in k:
          out[f"{m}_{k.replace('/', '_')}"] = float(np.median([x[k] for x in runs[m]]))
  out["total_wall_s"] = time.time() - t_start
  out["devices"] = (f"{len(tdev)} of {jax.device_count()} x {jax.default_backend()}"
                    + (", colocated" if args.colocated else ""))
  common.emit(out, ndigits=4)


if __name__ == "__main__":
  main()
