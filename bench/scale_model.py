"""Benchmark: the model of one RL step (analysis/scale_model.py) against the 3-process CPU run it
predicts (configs/tiny.py:multihost), from rates each measured alone: generation and training
(this script's --distributed children), data (multihost_bulk.py), push (multihost_push.py) and
scoring (the run's VerifierPool).

  python bench/scale_model.py [--cpu_run_workdir W]

Last line, one JSON object: predicted and measured per-batch time, predicted_over_measured,
the rates (with rates.message_s) and the run's workload.
"""
import dataclasses
import json
import os
import statistics
import sys
import tempfile

import common   # bench/common.py, beside the script

from magistral_jax.analysis import scale_model as M

CPU_CONFIG = "configs/tiny.py:multihost"


# ---- 1. the CPU run -------------------------------------------------------------------------

def batch_rows(workdir: str) -> list[dict]:
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [r for r in map(json.loads, filter(str.strip, f)) if "train_time_s" in r]


def cpu_workload(run, rows: list[dict], skip: int) -> tuple[dict, M.Workload]:
  """The measured per-batch time and the run's workload, from its batch rows."""
  rows = rows[skip:]
  if len(rows) < 3:
    raise SystemExit(f"scale_model: {len(rows)} batches after the first {skip}; need 3")
  gaps = [b["time"] - a["time"] for a, b in zip(rows, rows[1:])]
  tasks, tok, system = tasks_and_tokenizer(run, 64)
  kept_groups = len(rows) * run.rl.n_batch / run.rl.group_size
  measured = {"batch_s": statistics.median(gaps), "batches": len(gaps),
              "batch_s_rounds": [round(g, 3) for g in gaps],
              **{k: statistics.median(r[k] for r in rows)
                 for k in ("train_time_s", "trainer_idle_s", "weight_push_s")}}
  w = M.Workload(
      n_batch=run.rl.n_batch, n_mini=run.rl.n_mini, group_size=run.rl.group_size,
      n_async=run.pipeline.n_async or 2 * run.rl.n_batch, mode=run.pipeline.mode,
      prompt_tokens=statistics.mean(len(tok.apply_chat_template(t["problem"], system))
                                    for t in tasks),
      response_tokens=statistics.mean(r["response_length_mean"] for r in rows),
      keep=kept_groups / sum(r["groups_scored"] for r in rows),
      microbatch_tokens=run.rl.microbatch_tokens,
      padding=statistics.mean(r["padding_frac"] for r in rows),
      microbatches=round(statistics.median(r["microbatches"] for r in rows)))
  return measured, w


def tasks_and_tokenizer(run, n: int):
  from magistral_jax.data import synthetic
  from magistral_jax.data.prompts import system_prompt_for
  from magistral_jax.model.loading import load_policy
  tok, _, _ = load_policy(run.model, run.init, run.tokenizer, load_weights=False)
  opts = synthetic.options(run.data)
  return synthetic.take(n, run.seed, **opts), tok, system_prompt_for(run.system_prompt)


def verifier_rate(run, n: int) -> float:
  """Tasks/s of the run's VerifierPool on its math tasks (worked traces as the responses)."""
  from magistral_jax.data import synthetic
  from magistral_jax.verify.pool import VerifierPool
  tasks, _, _ = tasks_and_tokenizer(run, n)
  pool = VerifierPool.from_config(run.verifier, run.reward)
  try:
    for t in tasks[:8]:   # the workers start and import
      pool.submit(t, synthetic.trace(t)).result()
    return n / common.time_once(lambda: [f.result() for f in [
        pool.submit(t, synthetic.trace(t)) for t in tasks]], block=False)[0]
  finally:
    pool.close()


# ---- 2. the children: generation, then the train step, each alone ----------------------------

def child(args) -> None:
  import jax
  from magistral_jax.parallel import multihost
  from magistral_jax import config as config_lib
  from magistral_jax.run.recipes import load_recipe
  run = config_lib.validate(load_recipe(CPU_CONFIG, common.ROOT))
  layout = multihost.process_layout(run.devices)
  mailbox = multihost.Mailbox("scale_model")
  wl = json.loads(os.environ["SCALE_MODEL_WORKLOAD"])
  if not layout.is_trainer:
    result = measure_generation(run, layout, wl, args.reps)
    for p in layout.trainer_processes:
      mailbox.send(f"to{p}", result)
    return
  generation = mailbox.receive(f"to{jax.process_index()}", 1800, what="the generator's measurement")
  train = measure_train(run, layout, wl, args.reps)
  if not layout.is_leader:
    mailbox.send("cores", train["cores_busy"])
    return
  train["cores_busy"] += sum(mailbox.receive("cores", 600) for _ in layout.trainer_processes[1:])
  print(json.dumps({"generation": generation, "train": train}), flush=True)


def measure_generation(run, layout, wl: dict, reps: int) -> dict:
  """Completion tokens/s of the run's generator: groups of the run's prompt length, every
  completion wl['response'] tokens (EOS off), all submitted at once, until the last is back."""
  import threading
  import jax
  from magistral_jax.generate.config import SamplingConfig
  from magistral_jax.generate.requests import Request
  from magistral_jax.model import transformer as T
  from magistral_jax.pipeline.generators import make_generators, shared_prefix_for
  tasks, tok, system = tasks_and_tokenizer(run, 4096)
  devices = layout.generator_devices()[layout.generator_index]
  new = max(1, round(wl["response"]))
  sampling = SamplingConfig(temperature=run.sampling.temperature, max_new_tokens=new,
                            eos_id=None)
  params = T.init_params(run.model, jax.random.PRNGKey(0))
  [loop] = make_generators(run.model, params, [devices], sampling, run.engine,
                           mesh_shape=run.devices.generator_mesh,
                           rules=run.sharding.generator_rules,
                           shared_prefix=shared_prefix_for(run.engine, tok, system))
  finished = threading.Semaphore(0)   # released once per completion
  loop.callback = lambda _: finished.release()
  loop.start()
  # Four batches' worth a round: the run generates without pause, this drains every round.
  groups = max(1, round(4 * wl["completions"] / run.rl.group_size))
  n, it, round_ids = groups * run.rl.group_size, iter(tasks), iter(range(reps + 2))

  def one_round():
    r = next(round_ids)
    for g in range(groups):
      loop.submit(Request(id=(r, g), group_size=run.rl.group_size, seed=g,
                          prompt_tokens=tok.apply_chat_template(next(it)["problem"], system)))
    if not all(finished.acquire(timeout=1200) for _ in range(n)):
      raise TimeoutError("generation did not finish")
  # Two untimed rounds: the first compiles, the second catches up.
  t = common.time_fn(one_round, reps, warmup=2, block=False)
  loop.stop()
  rounds = [n * new / w for w in t.rounds]
  return {"tokens_per_s": statistics.median(rounds), "rounds_tokens_per_s": rounds,
          "cores_busy": statistics.median(c / w for c, w in zip(t.cpu_rounds, t.rounds)),
          "completions": n, "response_tokens": new}


def measure_train(run, layout, wl: dict, reps: int) -> dict:
  """The run's GRPO step on a minibatch of the run's shape (n_mini completions of its mean
  prompt and response lengths, wl['microbatches'] microbatches), on the trainer processes."""
  import jax
  import numpy as np
  from magistral_jax.parallel.sharding import make_mesh
  from magistral_jax.rl.collate import Completion
  from magistral_jax.rl.minibatch import collate_minibatch
  from magistral_jax.train.optimizer import learning_rate_schedule, make_optimizer
  from magistral_jax.train.rl_loop import Trainer
  from magistral_jax.train.step import init_state, make_grpo_step
  mesh = make_mesh(run.devices.trainer_mesh, layout.trainer_devices())
  rules = run.sharding.trainer_rules
  tx = make_optimizer(run.optimizer)
  state = init_state(run.model, tx, jax.random.PRNGKey(0), mesh, rules)
  step_fn = make_grpo_step(run.model, run.rl, tx, mesh, rules,
                           temperature=run.sampling.temperature,
                           lr_schedule=learning_rate_schedule(run.optimizer))
  trainer = Trainer(step_fn, state, mesh, rules)
  rng = np.random.default_rng(0)
  p, c = max(1, round(wl["prompt"])), max(1, round(wl["response"]))
  comps = [Completion(rng.integers(3, run.model.vocab_size, p),
                      rng.integers(3, run.model.vocab_size, c),
                      -np.abs(rng.normal(1.0, 0.5, c)), float(rng.normal()),
                      i // run.rl.group_size) for i in range(run.rl.n_mini)]
  mb = collate_minibatch(comps, run.rl, min_microbatches=wl["microbatches"])
  t = common.time_fn(lambda: trainer.step(mb), reps, block=False)   # the warm-up compiles
  n_micro = mb.arrays["tokens"].shape[0]
  return {"step_s": t.median, "rounds_s": t.rounds, "microbatches": n_micro,
          "tokens_per_s": n_micro * run.rl.microbatch_tokens / t.median,
          "cores_busy": statistics.median(c / w for c, w in zip(t.cpu_rounds, t.rounds))}


# ---- 3. prediction against the CPU run ----------------------------------------------------------

def cpu_check(args) -> dict:
  from magistral_jax import config as config_lib
  from magistral_jax.run.recipes import load_recipe
  run = config_lib.validate(load_recipe(CPU_CONFIG, common.ROOT))
  workdir = args.cpu_run_workdir or tempfile.mkdtemp(prefix="scale_model_")
  if len(batch_rows(workdir)) < args.skip + 4:   # the run, as README.md "Many hosts" starts it
    os.makedirs(workdir, exist_ok=True)
    wall = common.run_logged(
        [sys.executable, os.path.join(common.ROOT, "launch/local_cluster.py"),
         "--num_processes=3", "--devices_per_process=2", "--",
         os.path.join(common.ROOT, "launch/train.py"),
         f"--config={CPU_CONFIG},sft_steps={args.sft_steps},batches={args.batches}",
         f"--workdir={workdir}"], os.path.join(workdir, "local_cluster.log"),
        env=dict(os.environ, PYTHONPATH=common.ROOT))
    print(f"[cpu run] {wall:.0f}s: {workdir}", file=sys.stderr, flush=True)
  measured, w = cpu_workload(run, batch_rows(workdir), args.skip)
  print(f"[cpu run] {workdir}: {measured['batches']} batch intervals, median "
        f"{measured['batch_s']:.2f}s; workload {dataclasses.asdict(w)}", file=sys.stderr)
  verify = verifier_rate(run, args.verify_tasks)
  os.environ["SCALE_MODEL_WORKLOAD"] = json.dumps({
      "prompt": w.prompt_tokens, "response": w.response_tokens, "completions": w.completions,
      "microbatches": w.microbatches_per_step})
  parts = common.cluster_json(__file__, 3, 2, 0, "scale_model")
  gen, train = parts["generation"], parts["train"]
  # A follower's rows of one minibatch: half of them (2 trainer processes).
  rows_mb = w.slots_per_step * M.BYTES_PER_TOKEN_SLOT / 2 / 2**20
  bench = lambda script, *flags: common.run_json(
      [sys.executable, os.path.join(common.ROOT, "bench", script), *flags])
  bulk = bench("multihost_bulk.py", f"--sizes=0.001,{rows_mb:.4f}", f"--reps={args.reps}")
  nbytes = [int(s * 2**20) for s in bulk["sizes_mb"]]
  message_s = nbytes[0] / (bulk["kv_MBps"][0] * 1e6) / 2
  bulk_s = nbytes[1] / (bulk["bulk_MBps"][1] * 1e6)
  push = bench("multihost_push.py", "--model=tiny", f"--reps={args.reps}")
  rates = M.Rates(
      decode_tokens_per_s=gen["tokens_per_s"], verify_tasks_per_s=verify,
      train_tokens_per_s=train["tokens_per_s"],
      bulk_bytes_per_s=nbytes[1] / max(bulk_s - 2 * message_s, 0.1 * bulk_s),
      message_s=message_s, push_s=push["cross_process_push_s"],
      cores_busy={"generation": gen["cores_busy"], "train": train["cores_busy"]})
  layout = M.Layout(trainer_processes=2, shared_cores=os.cpu_count())   # and one generator
  pred = M.step_time(w, layout, rates)
  ratio = pred["step_s"] / measured["batch_s"]
  print(f"[check] per batch: measured {measured['batch_s']:.2f}s, predicted "
        f"{pred['step_s']:.2f}s ({pred['bottleneck']}): predicted/measured {ratio:.3f}",
        file=sys.stderr)
  for p in M.PARTS:
    print(f"  {p:<11}{pred['parts_s'][p]:8.3f}s  {pred['shares'][p]:6.1%}", file=sys.stderr)
  print(f"  run's own: train_time_s {measured['train_time_s']:.2f}, trainer_idle_s "
        f"{measured['trainer_idle_s']:.2f}, weight_push_s {measured['weight_push_s']:.3f} per "
        f"push", file=sys.stderr)
  return {"measured_batch_s": measured["batch_s"], "predicted_batch_s": pred["step_s"],
          "predicted_over_measured": ratio, "goal": "0.75 <= predicted_over_measured <= 1.25",
          "goal_met": bool(0.75 <= ratio <= 1.25), "bottleneck": pred["bottleneck"],
          "parts_s": pred["parts_s"], "terms_s": pred["terms_s"], "measured": measured,
          "workload": dataclasses.asdict(w), "workdir": workdir, "apart": parts,
          "rates": {**dataclasses.asdict(rates), "train_step_s": train["step_s"],
                    "train_microbatches": train["microbatches"],
                    "math_verify_s": 1.0 / verify * run.verifier.num_workers}}


def main() -> None:
  p = common.argument_parser(
      __doc__, cpu_run_workdir=("", "the 3-process run's workdir"),
      sft_steps=(200, "when this script runs it"), batches=(14, "when this script runs it"),
      skip=(2, "first batches left out (compilation)"), reps=5, verify_tasks=200)
  args = common.cluster_main(p, child)
  if args is None:
    return
  check = cpu_check(args)
  common.emit({"bench": "scale_model", "cpu_check": check,
               "predicted_over_measured": round(check["predicted_over_measured"], 3),
               **common.host_info()})


if __name__ == "__main__":
  main()
