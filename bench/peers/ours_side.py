"""Our side of bench/vs_tunix.py: train.rl_loop.train over Rollouts in sync mode, colocated, on
the shared workload, timed from hooks on the loop's parts; the counterpart of tunix_side.py.

  python bench/peers/ours_side.py --spec=SPEC.json [--score=FILE]

Last line: one JSON object, the same per-iteration figures as the tunix side plus
generator_per_iteration and generator_compiles_in_timed_iterations.
"""
import dataclasses
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))   # bench/: common, vs_tunix (the workload's tokenizer)
import common  # noqa: E402
from peer_common import (jitter, side_main, side_summary, time_calls, versions,  # noqa: E402
                         weights_checksum)
from vs_tunix import progress, shared_tokenizer  # noqa: E402

# Our generator's loop counters (generate.counters.LoopCounters), per timed iteration (medians).
GEN_COUNTERS = ("steps", "compact_steps", "decode_time_s", "idle_time_s", "prefill_wait_s",
                "background_prefilled", "shared_prefix_hits", "shared_prefix_prefills")


def make_rollouts(model_cfg, params, trainer_devices, sampling, spec, pool, tokenizer, grpo,
                  system_prompt):
  """Our colocated layout (Rollouts colocated=True): one generator on the trainer's devices,
  taking turns with it, built as launch/train.py builds it (make_generators, the config's engine
  defaults, slots for the whole batch); every program it can run is compiled beforehand, since
  which prefill and drain programs a run meets depends on thread timing."""
  from magistral_jax.generate.config import EngineConfig
  from magistral_jax.pipeline.config import PipelineConfig
  from magistral_jax.pipeline.rollouts import Rollouts
  from magistral_jax.pipeline.generators import make_generators, shared_prefix_for
  # The run config's engine section takes its defaults from EngineConfig.
  tune = {} if spec.get("engine_tune") is None else {"tune": bool(spec["engine_tune"])}
  e = EngineConfig(max_concurrent_decodes=spec["prompts_per_iteration"] * spec["group_size"],
                   max_prefill_length=spec["max_prompt_length"],
                   background_prefill=False,   # stepped in turn
                   **tune)   # --engine_tune: the config default unless given
  shared = shared_prefix_for(e, tokenizer, system_prompt)
  gens = make_generators(model_cfg, params, [list(trainer_devices)], sampling, e,
                         mesh_shape={"tensor": len(trainer_devices)}, seed=spec["seed"],
                         shared_prefix=shared)
  for g in gens:   # only the prefill buckets this workload's prompts take (whole, or their rest)
    lengths = [len(ids) - (len(shared) if shared and ids[:len(shared)] == shared else 0)
               for ids in (t["ids"] for t in spec["prompts"])]
    buckets = sorted({g.engine.bucket_for(n) for n in lengths})
    g.engine.precompile(g.params, buckets, tune=False, existing_prefix=g.shared_prefix_cache())
  tasks = [{k: p[k] for k in ("id", "kind", "problem", "answer")} for p in spec["prompts"]]
  return Rollouts(generators=gens, pool=pool, tokenizer=tokenizer, prompts=iter(tasks),
                  grpo_cfg=grpo, cfg=PipelineConfig(mode="sync", batch_timeout_s=1800),
                  system_prompt=system_prompt, seed=spec["seed"], colocated=True)


def reward_config(max_new_tokens: int):
  """Our verifiers' reward for this bench, the rule the tunix side implements: paper §2's format
  gate, then format 0.1 + correct 0.9 (the math verifier); no language bonus, and the overlong
  penalty only past max_new_tokens (l_max 2N, l_cache N), which no completion reaches."""
  from magistral_jax.rewards.config import RewardConfig
  return RewardConfig(l_max=2 * max_new_tokens, l_cache=max_new_tokens, language_bonus=0.0)


def score(spec: dict) -> list[float]:
  """--score: our rewards of the completions of `spec` (completions, answers, max_new_tokens)
  under reward_config, jitter added: what tunix_side.py --score prints for the same file, when
  both sides score alike (tests/bench/test_vs_tunix.py)."""
  from magistral_jax.rewards.reward import compute_reward
  cfg = reward_config(spec["max_new_tokens"])
  return [compute_reward({"kind": "math", "problem": "", "answer": a}, c,
                         spec["max_new_tokens"], cfg).reward + jitter(c)
          for c, a in zip(spec["completions"], spec["answers"])]


class JitteredPool:
  """The VerifierPool, with `jitter(response)` added to each reward it returns."""

  def __init__(self, pool):
    self.pool = pool

  def submit(self, task, response, response_tokens=None, seed=0):
    import concurrent.futures
    out = concurrent.futures.Future()

    def done(f):
      try:
        r = f.result()
      except BaseException as e:   # the pipeline turns it into a dropped group
        out.set_exception(e)
        return
      out.set_result(dataclasses.replace(r, reward=r.reward + jitter(response)))
    self.pool.submit(task, response, response_tokens, seed).add_done_callback(done)
    return out


def run_ours(spec: dict) -> dict:
  """One run of our loop: warm-up + timed iterations. Returns this side's figures."""
  import jax
  import numpy as np
  from magistral_jax.generate.config import SamplingConfig
  from magistral_jax.model.hf_checkpoint import load_hf_safetensors
  from magistral_jax.parallel.config import TRAINER_RULES
  from magistral_jax.parallel.sharding import make_mesh
  from magistral_jax.data.prompts import system_prompt_for
  from magistral_jax.rl.config import GRPOConfig
  from magistral_jax.train.optimizer import make_optimizer
  from magistral_jax.train.config import OptimizerConfig
  from magistral_jax.train.rl_loop import Trainer, train
  from magistral_jax.train.step import init_state, make_grpo_step
  from magistral_jax.verify.pool import VerifierPool

  t_setup = time.perf_counter()
  tok, _ = shared_tokenizer(spec.get("tokenizer_source", "gguf"))   # the workload's
  system_prompt = system_prompt_for(spec["system_prompt"])
  if any(tok.apply_chat_template(p["problem"], system_prompt) != p["ids"]
         for p in spec["prompts"]):
    raise RuntimeError("our tokenizer renders the prompts differently from the workload spec")
  dtype = spec["dtype"]
  cfg, params = load_hf_safetensors(spec["weights_dir"], dtype=dtype)
  cfg = cfg.replace(param_dtype=dtype, dtype=dtype, eos_token_id=spec["eos_id"],
                    bos_token_id=spec["bos_id"])
  checksum = weights_checksum(jax.tree.leaves(params))
  B, G = spec["prompts_per_iteration"], spec["group_size"]
  n, N, P = B * G, spec["max_new_tokens"], spec["max_prompt_length"]
  # One optimizer step over gradients accumulated across microbatches of micro_prompts x G rows.
  m = spec.get("micro_prompts", B) * G
  grpo = GRPOConfig(n_batch=n, n_mini=n, group_size=G, microbatch_rows=m,
                    microbatch_tokens=m * (P + N))
  devices = jax.devices()[:1]
  tmesh = make_mesh({"fsdp": len(devices)}, devices)
  tx = make_optimizer(OptimizerConfig(learning_rate=spec["learning_rate"]))
  state = init_state(cfg, tx, jax.random.PRNGKey(spec["seed"]), tmesh, TRAINER_RULES,
                     params=params)
  del params
  step_fn = make_grpo_step(cfg, grpo, tx, tmesh, TRAINER_RULES, temperature=spec["temperature"])
  sampling = SamplingConfig(temperature=spec["temperature"], max_new_tokens=N, eos_id=None)
  pool = VerifierPool(1, reward_config(N), task_timeout_s=60)
  rollouts = make_rollouts(cfg, jax.device_get(state.params), devices, sampling, spec,
                           JitteredPool(pool), tok, grpo, system_prompt)
  trainer = Trainer(step_fn, state, tmesh, TRAINER_RULES)
  setup_s = time.perf_counter() - t_setup
  progress(f"ours: set up in {setup_s:.0f}s (weights, optimizer, engine precompile)")

  # Hooks: each records (start, end) or a timestamp; nothing waits that the loop does not.
  ev = {"gen": [], "tokens": [], "batch_end": [], "step": [], "push": [], "iter_end": []}
  for g in rollouts.generators:
    def on_sample(c, f=g.callback):
      ev["gen"].append(time.perf_counter())
      ev["tokens"].append(len(c.tokens))
      f(c)
    g.callback = on_sample
  for obj, name, key in ((rollouts, "next_batch", "batch_end"), (rollouts, "push", "push"),
                         (trainer, "step", "step")):
    time_calls(obj, name, ev[key])

  total = spec["warmup"] + spec["iterations"]
  compiles = lambda: sum(sum(g.engine.compile_counts().values()) for g in rollouts.generators)
  counts = [compiles()]   # after precompile; then at the end of the warm-up; then at the end

  gen_counters = lambda: {k: sum(getattr(g.counters, k) for g in rollouts.generators)
                          for k in GEN_COUNTERS}
  def on_batch(_trainer, _metrics):
    ev["iter_end"].append(time.perf_counter())
    (a, b), i = ev["step"][-1], len(ev["iter_end"])
    progress(f"ours: iteration {i}/{total} ended at {ev['iter_end'][-1] - t0:.1f}s "
             f"(its train step {b - a:.2f}s)")
    snaps.append(gen_counters())
    if len(ev["iter_end"]) == spec["warmup"]:
      counts.append(compiles())

  snaps = [gen_counters()]   # generator counters at the start and at each iteration's end
  t0 = time.perf_counter()
  try:
    with rollouts:
      history = train(trainer, rollouts, grpo, total, seed=spec["seed"], on_batch=on_batch)
    try:   # the verifier workers' peak RSS (VmHWM), where /proc tells
      workers_hwm = 1024 * sum(common.proc_status_kb("VmHWM", p) for p in pool.worker_pids())
    except (OSError, StopIteration, AttributeError):
      workers_hwm = None
  finally:
    pool.close()
  if len(history) != total:
    raise RuntimeError(f"only {len(history)}/{total} iterations ran: {dict(rollouts.counters)}")
  dropped = int(rollouts.counters["groups_dropped"])
  if dropped:
    raise RuntimeError(f"{dropped} groups were dropped: the workloads would differ")

  gen_t, toks = np.asarray(ev["gen"]), np.asarray(ev["tokens"])

  def record(i, s, e, within):
    inside = (gen_t > s) & (gen_t <= e)
    last_gen = float(gen_t[inside].max())
    return {"iteration_s": e - s, "rollout_s": last_gen - s,
            "scoring_s": ev["batch_end"][i][1] - last_gen,
            "train_step_s": within("step"), "weight_sync_s": within("push"),
            "generated_tokens": int(toks[inside].sum()), "completions": int(inside.sum())}
  counts.append(compiles())
  if counts[-1] != counts[-2]:
    print(f"[vs_tunix] WARNING: our generator compiled {counts[-1] - counts[-2]} program(s) "
          "during the timed iterations", file=sys.stderr, flush=True)
  gen = {k: float(statistics.median(snaps[i + 1][k] - snaps[i][k]
                                    for i in range(spec["warmup"], total))) for k in GEN_COUNTERS}
  gen["decode_step_ms"] = 1e3 * gen["decode_time_s"] / max(1, gen["steps"])
  eng = rollouts.generators[0].engine
  return side_summary(
      spec, t0, ev, record, generator_per_iteration=gen,
      generator_dot_library=eng.generate_library,   # None off CPU
      generator_tuning=eng.generate_tuning, verifier_workers_peak_rss_bytes=workers_hwm,
      setup_s=setup_s, weights_checksum=checksum, optimizer_steps=trainer.opt_steps,
      generator_compiles_in_warmup=counts[-2] - counts[0],
      generator_compiles_in_timed_iterations=counts[-1] - counts[-2],
      reward_mean=float(np.mean([h.get("reward", 0.0) for h in history])),
      versions=versions(("jax", "jaxlib", "flax", "optax")))


if __name__ == "__main__":
  side_main(__doc__, run_ours, score)
