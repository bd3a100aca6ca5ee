"""Benchmark: the async RL pipeline against its synchronous twin, and generator utilisation:
train.rl_loop.train from the same SFT-warm-started tiny model, programs, prompts and seeds, on 8
simulated CPU devices (`--layout`) with the real VerifierPool, or `--colocated`.

  python bench/pipeline.py [--batches 10 --repeats 5] [--colocated]

Last line, one JSON object: async_over_sync_throughput (scored completions/s),
async_over_sync_trained_throughput, generator_utilization, decode_utilization,
response_length_{min,p10,p50,p90,max}, per-mode diagnostics.
"""
import common

common.use_cpu_devices(8)   # a trainer slice and two generator slices

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
  ap = common.argument_parser(
      __doc__, batches=10, repeats=5, sft_steps=250, seed=1,   # batches, runs per mode
      layout=("4,2,2", "devices of the trainer, then each generator"),
      colocated=(False, "one generator on the trainer's devices (--layout N: theirs)"))
  args = ap.parse_args()
  if args.colocated and args.layout == "4,2,2":
    args.layout = "1"
  if args.batches < 2:
    ap.error("--batches must be >= 2 (throughput is measured from the end of batch 1)")
  logging.basicConfig(level=logging.WARNING)

  from magistral_jax.data import synthetic
  from magistral_jax.generate.config import SamplingConfig
  from magistral_jax.generate.engine import Engine
  from magistral_jax.generate.loop import GeneratorLoop
  from magistral_jax.model.char_tokenizer import char_tokenizer
  from magistral_jax.model.config import ModelConfig
  from magistral_jax.parallel.config import GENERATOR_RULES, TRAINER_RULES
  from magistral_jax.parallel.layout import split_devices
  from magistral_jax.parallel.sharding import make_mesh
  from magistral_jax.pipeline.config import PipelineConfig
  from magistral_jax.pipeline.rollouts import Rollouts
  from magistral_jax.rewards.config import RewardConfig
  from magistral_jax.rl.config import GRPOConfig
  from magistral_jax.train.config import OptimizerConfig, SFTConfig
  from magistral_jax.train.optimizer import make_optimizer
  from magistral_jax.train.rl_loop import Trainer, train
  from magistral_jax.train.sft import make_sft_step, sft_warm_start
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
  tx = make_optimizer(OptimizerConfig(learning_rate=5e-3))
  examples = ((p["problem"], synthetic.trace(p)) for p in problems(0))
  sft_s, (state, sft_m) = common.time_once(lambda: sft_warm_start(
      init_state(cfg, tx, jax.random.PRNGKey(0), tmesh, TRAINER_RULES),
      make_sft_step(cfg, tx, tmesh, TRAINER_RULES), tok, examples,
      SFTConfig(num_steps=args.sft_steps, batch_size=8, row_len=256, rows_per_micro=8),
      system_prompt=synthetic.TINY_SYSTEM_PROMPT, mesh=tmesh, log_every=50), block=False)
  params = jax.device_get(state.params)
  del state
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
    gens = [GeneratorLoop(e, params, 0, seed=args.seed + i, sampling=e.sampling)
            for i, e in enumerate(engines)]
    ends, trainer = [], Trainer(train_step, state, tmesh, TRAINER_RULES)
    pipe = Rollouts(generators=gens, pool=pool, tokenizer=tok, prompts=problems(args.seed),
                    grpo_cfg=grpo, cfg=PipelineConfig(mode=mode, batch_timeout_s=300),
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
    mean = lambda k: float(np.mean([h[k] for h in history[1:]]))   # past batch 1
    steps = max(1, sum(g.counters.steps for g in gens))   # the whole run's, fill included
    return {
        "completions_per_s": grpo.group_size * (scored_last - scored_first) / (t_last - t_first),
        "trained_completions_per_s": grpo.n_batch * (num_batches - 1) / (t_last - t_first),
        "trained_completions_per_s_incl_fill": grpo.n_batch * num_batches / (t_last - t0),
        "scored_completions": int(pipe.counters["groups_scored"] * grpo.group_size),
        "groups_dropped_frac": pipe.counters["groups_dropped"] / max(1, pipe.counters["groups_scored"]),
        "generator_utilization": mean("generator_utilization"),
        "generator_utilization_per_batch": [round(h["generator_utilization"], 3) for h in history],
        **{k: mean(f"generator_{k}") for k in ("slot_occupancy", "decode_frac", "decode_utilization")},
        **{k: mean(k) for k in ("trainer_idle_frac", "train_time_s", "weight_push_s",
                                "version_lag_mean", "verifier_latency_s")},
        "reward": float(np.mean([h.get("reward", 0.0) for h in history[1:]])),
        "wall_s": time.time() - t0,
        # Share of the host's CPU capacity (all cores, all processes) busy during this run.
        "host_cpu_busy_frac": (cpu1[0] - cpu0[0]) / max(1, cpu1[1] - cpu0[1]),
        "decode_steps": int(sum(g.counters.steps for g in gens)),
        "decode_step_ms": 1e3 * sum(g.counters.decode_time_s for g in gens) / steps,
        "tokens_per_decode_step": sum(g.counters.generated_tokens for g in gens) / steps,
        **{k: float(np.max([h[k] for h in history])) for k in history[0] if "peak" in k},
    }

  try:
    # The warm-up batch compiles prefill/insert/generate, the train step and the pushes.
    warm_s = common.time_once(lambda: run_mode("sync", 1), block=False)[0]
    print(f"warm-up batch (compiles): {warm_s:.1f}s", flush=True)
    lengths, runs = [], {"sync": [], "async": []}
    for r in range(args.repeats):   # alternate the order so drifting host load hits both modes
      for mode in (("sync", "async") if r % 2 == 0 else ("async", "sync")):
        runs[mode].append(run_mode(mode, args.batches, lengths))
        common.emit({"mode": mode, "repeat": r, **runs[mode][-1]}, ndigits=4)
  finally:
    pool.close()
  L = np.asarray(lengths)
  p10, p50, p90 = (float(np.percentile(L, q)) for q in (10, 50, 90))
  med = lambda k, m: float(np.median([x[k] for x in runs[m]]))
  ratio = lambda k: med(k, "async") / med(k, "sync")
  per_repeat = lambda k: [a[k] / s[k] for a, s in zip(runs["async"], runs["sync"])]
  out = dict(
      async_over_sync_throughput=ratio("completions_per_s"),
      async_over_sync_per_repeat=per_repeat("completions_per_s"),
      async_over_sync_trained_throughput=ratio("trained_completions_per_s"),
      async_over_sync_trained_per_repeat=per_repeat("trained_completions_per_s"),
      groups_dropped_frac_per_repeat={m: [round(x["groups_dropped_frac"], 3) for x in runs[m]]
                                      for m in runs},
      host_cpu_busy_frac={m: med("host_cpu_busy_frac", m) for m in runs},
      generator_utilization=med("generator_utilization", "async"),
      sync_generator_utilization=med("generator_utilization", "sync"),
      **{f"{m}_generator_{k}": med(k, m)
         for m in ("async", "sync") for k in ("slot_occupancy", "decode_frac", "decode_utilization")},
      **{f"{m}_{k}": med(k, m) for m in ("async", "sync") for k in (
          "completions_per_s", "trained_completions_per_s", "decode_step_ms",
          "tokens_per_decode_step")},
      groups_dropped_frac=float(np.mean([x["groups_dropped_frac"] for m in runs for x in runs[m]])),
      response_length_min=int(L.min()), response_length_p10=p10, response_length_p50=p50,
      response_length_p90=p90, response_length_max=int(L.max()),
      response_length_spread_p90_over_p10=p90 / p10,
      response_length_spread_max_over_min=float(L.max() / L.min()),
      batches_per_mode=args.batches, repeats=args.repeats, sft_s=sft_s, warmup_s=warm_s,
      colocated=args.colocated)
  if args.colocated:
    out.update({f"{m}_{k.replace('/', '_')}": med(k, m) for m in runs for k in runs[m][0]
                if "peak" in k})
  out["total_wall_s"] = time.time() - t_start
  out["devices"] = (f"{len(tdev)} of {jax.device_count()} x {jax.default_backend()}"
                    + (", colocated" if args.colocated else ""))
  common.emit(out, ndigits=4)


if __name__ == "__main__":
  main()
