"""Benchmark: a model of one RL step (magistral_jax/analysis/scale_model.py), checked against the
3-process CPU run, then projected onto named clusters for configs/medium.py and configs/small.py.

1. Measured: the 3-process CPU run (configs/tiny.py:multihost, launch/local_cluster.py, 3
   processes of 2 CPU devices) in `--cpu_run_workdir` (run there first, `--sft_steps`,
   `--batches`, unless it has batches): per batch, the median interval between consecutive
   batch rows of metrics.jsonl after the first `--skip`. Its workload, from the same rows: mean
   response length, share of groups kept, microbatches per optimizer step, padding; the mean
   prompt length from its tokenizer and prompts.
2. Rates, each measured alone, nothing else of ours running:
   - generation and train tokens/s: a 3-process cluster of the run's layout (this script's
     --distributed children). The generator process runs the run's GeneratorLoop on its one
     device (engine settings as the run's, random weights, EOS off) on groups of the run's prompt
     length, every completion the run's mean response length; then the two trainer processes
     take the run's GRPO step (train.rl_loop.Trainer.step, FSDP over their 4 devices) on a
     minibatch of the run's shape. Each says how many cores it kept busy (CPU s / wall s).
   - data: bench/multihost_bulk.py at the size of a follower's rows of one minibatch (less a
     message each way) and at 1 KB (a key-value set, get and ack: twice a message's latency).
   - push: bench/multihost_push.py --model tiny (stage, offer, pull, ack).
   - scoring: the run's VerifierPool on the run's math tasks, tasks/s.
   `predicted_over_measured`: the model's per-batch time over the measured (goal 0.75-1.25).
   The run and the rates are measured back to back: give an empty workdir (a run read back later
   on a host whose load has changed compares two different machines).
3. Projected (`--projection_only` skips 1-2; the CPU-side rates then come from --message_s and
   --math_verify_s): each stage of configs/medium.py and configs/small.py on `--clusters`, half
   the chips training (FSDP), the rest generators of the recipe's size and mesh with as many
   decode slots (up to the recipe's) as fit a chip by run/plan.py's estimate. Chip figures:
   ACCELERATORS. Assumed workload: --keep, --prompt_tokens, --length_frac, --code_share. Policy:
   Small is Mistral Small 3 (24B); Medium 3's shape is not public (--medium_models: the 24B
   shape, Magistral Medium's smallest stated base, and README.md's 125B stand-in). VARIANTS say
   what the bottleneck costs: 3/4 of the chips generating; `live read`, a decode step reading
   only each slot's live positions (model/decode_live.py, decode_attention auto on NVIDIA GPUs),
   as many slots as a dense cache fits; `paged`, a slot also holding only its live positions (more
   slots fit); `push spread` (analysis/scale_model.push_seconds).

Last line: one JSON object. Usage: python bench/scale_model.py [--cpu_run_workdir W]
[--projection_only] [--clusters 64xH100,128xH100,256xH100,v5p-128,v5p-256]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import common   # bench/common.py, beside the script

from magistral_jax.analysis import scale_model as M
from magistral_jax.run import footprint

CPU_CONFIG = "configs/tiny.py:multihost"
MEDIUM_125B = ("vocab_size=131072,hidden_size=12288,intermediate_size=28672,num_layers=88,"
               "num_heads=96,num_kv_heads=8,head_dim=128")
# Chip figures. H100: mfu, decode_frac and stage_gbps are BENCHMARKS.md "First accelerator run
# (H100)" rows (`train` 1 x 8,192: MFU 0.274; `roofline` Llama-3.2-1B shape: 0.41 of the spec
# bandwidth; `push` 1B shape: 8.57 ms for its 2.47 GB of bf16 weights); the rest are the
# vendor's figures or assumptions (see BENCHMARKS.md "Many hosts: a model of one step"). TPU
# v5p: the vendor's peak and bandwidth with the H100's measured efficiencies (an assumption).
ACCELERATORS = {
    "H100": M.Accelerator("H100", peak_tflops=989.0, hbm_gbps=3350.0, memory_gib=78.0,
                          chips_per_host=8, mfu=0.274, decode_frac=0.41,
                          stage_gbps=2.47 / 8.57e-3, link_gbps=50.0, transfer_gbps=10.0,
                          verifier_cores=100, platform="cuda"),
    "v5p": M.Accelerator("v5p", peak_tflops=459.0, hbm_gbps=2765.0, memory_gib=95.0,
                         chips_per_host=4, mfu=0.274, decode_frac=0.41,
                         stage_gbps=2.47 / 8.57e-3 * 2765.0 / 3350.0, link_gbps=100.0,
                         transfer_gbps=25.0, verifier_cores=200, platform="tpu"),
}
# A code completion's CPU seconds: 20 tests, each a sandboxed program run (BENCHMARKS.md
# "Rewards and verifier pool": 30.3 programs/s on 2 workers).
CODE_VERIFY_S = 20 / (30.3 / 2)


# ---- 1. the CPU run -------------------------------------------------------------------------

def batch_rows(workdir: str) -> list[dict]:
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [r for r in map(json.loads, filter(str.strip, f)) if "train_time_s" in r]


def run_cpu(workdir: str, args) -> None:
  """The 3-process run, as README.md "Many hosts" starts it."""
  cmd = [sys.executable, os.path.join(common.ROOT, "launch/local_cluster.py"),
         "--num_processes=3", "--devices_per_process=2", "--",
         os.path.join(common.ROOT, "launch/train.py"),
         f"--config={CPU_CONFIG},sft_steps={args.sft_steps},batches={args.batches}",
         f"--workdir={workdir}"]
  env = dict(os.environ, PYTHONPATH=common.ROOT)
  t = time.time()
  r = subprocess.run(cmd, cwd=common.ROOT, env=env, capture_output=True, text=True)
  if r.returncode:
    sys.stderr.write(r.stdout[-6000:] + r.stderr[-6000:])
    raise SystemExit(f"scale_model: the 3-process run failed (exit code {r.returncode})")
  print(f"[cpu run] {time.time() - t:.0f}s: {workdir}", file=sys.stderr, flush=True)


def cpu_workload(run, rows: list[dict], skip: int) -> tuple[dict, M.Workload]:
  """The measured per-batch time and the run's workload, from its batch rows."""
  rows = rows[skip:]
  if len(rows) < 3:
    raise SystemExit(f"scale_model: {len(rows)} batches after the first {skip}; need 3")
  gaps = [b["time"] - a["time"] for a, b in zip(rows, rows[1:])]
  kept_groups = len(rows) * run.rl.n_batch / run.rl.group_size
  measured = {"batch_s": statistics.median(gaps), "batches": len(gaps),
              "batch_s_rounds": [round(g, 3) for g in gaps],
              "train_time_s": statistics.median(r["train_time_s"] for r in rows),
              "trainer_idle_s": statistics.median(r["trainer_idle_s"] for r in rows),
              "weight_push_s": statistics.median(r["weight_push_s"] for r in rows)}
  w = M.Workload(
      n_batch=run.rl.n_batch, n_mini=run.rl.n_mini, group_size=run.rl.group_size,
      n_async=run.pipeline.n_async or 2 * run.rl.n_batch, mode=run.pipeline.mode,
      prompt_tokens=prompt_tokens(run),
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


def prompt_tokens(run) -> float:
  tasks, tok, system = tasks_and_tokenizer(run, 64)
  return statistics.mean(len(tok.apply_chat_template(t["problem"], system)) for t in tasks)


def verifier_rate(run, n: int) -> float:
  """Tasks/s of the run's VerifierPool on its math tasks (worked traces as the responses)."""
  from magistral_jax.data import synthetic
  from magistral_jax.verify.pool import VerifierPool
  tasks, _, _ = tasks_and_tokenizer(run, n)
  pool = VerifierPool.from_config(run.verifier, run.reward)
  try:
    for t in tasks[:8]:   # the workers start and import
      pool.submit(t, synthetic.trace(t)).result()
    start = time.perf_counter()
    futures = [pool.submit(t, synthetic.trace(t)) for t in tasks]
    for f in futures:
      f.result()
    return n / (time.perf_counter() - start)
  finally:
    pool.close()


def sub_bench(script: str, *flags: str) -> dict:
  r = subprocess.run([sys.executable, os.path.join(common.ROOT, "bench", script), *flags],
                     cwd=common.ROOT, capture_output=True, text=True)
  if r.returncode:
    sys.stderr.write(r.stdout[-4000:] + r.stderr[-4000:])
    raise SystemExit(f"scale_model: bench/{script} failed (exit code {r.returncode})")
  return json.loads(r.stdout.strip().splitlines()[-1])


# ---- 2. the children: generation, then the train step, each alone ----------------------------

def child(args) -> None:
  from magistral_jax.parallel import multihost
  multihost.initialize()
  import jax
  from magistral_jax import config as config_lib
  from magistral_jax.run.recipes import load_recipe
  run = config_lib.validate(load_recipe(CPU_CONFIG, common.ROOT))
  layout = multihost.process_layout(run.devices)
  mailbox = multihost.Mailbox("scale_model")
  wl = json.loads(os.environ["SCALE_MODEL_WORKLOAD"])
  me = jax.process_index()
  if not layout.is_trainer:
    result = measure_generation(run, layout, wl, args.reps)
    for p in layout.trainer_processes:
      mailbox.send(f"to{p}", result)
    return multihost.finish()
  generation = mailbox.receive(f"to{me}", 1800, what="the generator's measurement")
  train = measure_train(run, layout, wl, args.reps)
  if not layout.is_leader:
    mailbox.send("cores", train["cores_busy"])
    return multihost.finish()
  others = [mailbox.receive("cores", 600) for _ in layout.trainer_processes[1:]]
  train["cores_busy"] += sum(others)
  print(json.dumps({"generation": generation, "train": train}), flush=True)
  multihost.finish()   # process 0 hosts the service: it leaves last


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
  done, lock, counter = threading.Event(), threading.Lock(), [0, 0]

  def on_sample(_):
    with lock:
      counter[0] += 1
      if counter[0] == counter[1]:
        done.set()
  loop.callback = on_sample
  loop.start()
  # Four batches' worth a round: the run generates without pause, this drains every round.
  groups = max(1, round(4 * wl["completions"] / run.rl.group_size))
  rounds, busy, it = [], [], iter(tasks)
  for r in range(-1, reps + 1):   # two untimed rounds: the first compiles, the second catches up
    done.clear()
    with lock:
      counter[:] = [0, groups * run.rl.group_size]
    w, c = time.perf_counter(), time.process_time()
    for g in range(groups):
      t = next(it)
      loop.submit(Request(id=(r, g), prompt_tokens=tok.apply_chat_template(t["problem"], system),
                          group_size=run.rl.group_size, seed=g))
    if not done.wait(1200):
      raise TimeoutError("generation did not finish")
    wall = time.perf_counter() - w
    if r > 0:
      rounds.append(groups * run.rl.group_size * new / wall)
      busy.append((time.process_time() - c) / wall)
  loop.stop()
  return {"tokens_per_s": statistics.median(rounds), "rounds_tokens_per_s": rounds,
          "cores_busy": statistics.median(busy), "completions": groups * run.rl.group_size,
          "response_tokens": new}


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
  rounds, busy = [], []
  for r in range(reps + 1):   # the first round compiles
    w, cpu = time.perf_counter(), time.process_time()
    trainer.step(mb)
    wall = time.perf_counter() - w
    if r:
      rounds.append(wall)
      busy.append((time.process_time() - cpu) / wall)
  n_micro = mb.arrays["tokens"].shape[0]
  step_s = statistics.median(rounds)
  return {"step_s": step_s, "rounds_s": rounds, "microbatches": n_micro,
          "tokens_per_s": n_micro * run.rl.microbatch_tokens / step_s,
          "cores_busy": statistics.median(busy)}


# ---- 3. prediction against the CPU run ----------------------------------------------------------

def cpu_check(args) -> dict:
  from magistral_jax import config as config_lib
  from magistral_jax.run.recipes import load_recipe
  run = config_lib.validate(load_recipe(CPU_CONFIG, common.ROOT))
  workdir = args.cpu_run_workdir or tempfile.mkdtemp(prefix="scale_model_")
  if len(batch_rows(workdir)) < args.skip + 4:
    run_cpu(workdir, args)
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
  bulk = sub_bench("multihost_bulk.py", f"--sizes=0.001,{rows_mb:.4f}", f"--reps={args.reps}")
  nbytes = [int(s * 2**20) for s in bulk["sizes_mb"]]
  message_s = nbytes[0] / (bulk["kv_MBps"][0] * 1e6) / 2
  bulk_s = nbytes[1] / (bulk["bulk_MBps"][1] * 1e6)
  push = sub_bench("multihost_push.py", "--model=tiny", f"--reps={args.reps}")
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


# ---- 4. projections ---------------------------------------------------------------------------

VARIANTS = ("recipe", "3/4 generating", "live read", "live read, 3/4 generating", "paged",
            "paged, 3/4 generating", "paged, 3/4 generating, push spread")


def project_one(run, cfg, cluster: str, variant: str, args, verify_core_s: float,
                message_s: float, trainer_gib: dict) -> dict:
  """One recipe stage on one cluster, in one variant (see the module docstring)."""
  from magistral_jax.run.footprint import trainer_bytes
  from magistral_jax.run.plan import parse_devices
  devices = parse_devices(cluster)
  acc = ACCELERATORS[devices.kind]
  chips, gen_chips = devices.count, max(run.devices.generators)
  n_gen = min(int(chips * (0.75 if "3/4" in variant else 0.5)), chips - gen_chips) // gen_chips
  while n_gen and (chips - n_gen * gen_chips) % gen_chips:   # a push needs k x gen_chips
    n_gen -= 1
  trainer = chips - n_gen * gen_chips
  response = args.length_frac * (run.reward.l_max - run.reward.l_cache)
  live = args.prompt_tokens + response   # a slot's mean live positions (module docstring)
  cache = run.engine.max_prefill_length + run.sampling.max_new_tokens
  rows = run.rl.microbatch_rows // run.devices.trainer * trainer   # one row per chip, as recipe
  laid = dataclasses.replace(
      run, devices=dataclasses.replace(run.devices, trainer=trainer,
                                       generators=(gen_chips,) * n_gen),
      rl=run.rl.replace(microbatch_rows=rows, microbatch_tokens=rows * run.rl.row_len))
  paged = variant.startswith("paged")
  live_read = paged or variant.startswith("live read")
  slots = n_gen and footprint.slots_that_fit(laid, cfg, gen_chips, devices.memory_bytes,
                                     devices.platform, positions=live if paged else None)
  key = (id(run), id(cfg), trainer, devices.platform)
  if key not in trainer_gib:
    trainer_gib[key] = trainer_bytes(laid, cfg, devices.platform)["total"] / 2**30
  out = {"cluster": cluster, "variant": variant, "trainer_chips": trainer,
         "generators": n_gen, "gen_chips": gen_chips, "slots": slots,
         "trainer_gib": trainer_gib[key],
         "trainer_fits": trainer_gib[key] <= devices.memory_bytes / 2**30}
  if not slots:
    return {**out, "step_s": None, "bottleneck": "a generator does not fit"}
  w = M.Workload(n_batch=run.rl.n_batch, n_mini=run.rl.n_mini, group_size=run.rl.group_size,
                 n_async=run.pipeline.n_async or 2 * run.rl.n_batch, mode=run.pipeline.mode,
                 prompt_tokens=args.prompt_tokens, response_tokens=response, keep=args.keep,
                 microbatch_tokens=laid.rl.microbatch_tokens, padding=args.padding)
  tensor = int(run.devices.generator_mesh.get("tensor", 1))
  cl = M.ClusterLayout(trainer, n_gen, gen_chips, tensor, slots, live if live_read else cache,
                       push="spread" if "spread" in variant else "leader")
  rates = M.accelerator_rates(cfg, w, cl, acc, verify_core_s=verify_core_s,
                              message_s=message_s, remat=cfg.remat)
  res = M.step_time(w, M.Layout(max(1, trainer // acc.chips_per_host)), rates)
  return {**out, "step_s": res["step_s"], "bottleneck": res["bottleneck"],
          "parts_s": res["parts_s"], "shares": res["shares"],
          "trainer_busy": res["trainer_s"] / res["step_s"]}


def projections(args, verify_core_s: float, message_s: float) -> list[dict]:
  from magistral_jax import config as config_lib
  from magistral_jax.run import plan as P
  from magistral_jax.run.recipes import load_recipe
  from magistral_jax.run.stages import stages as stage_list
  recipes = (("Medium", "configs/medium.py", args.medium_models.split(";")),
             ("Small", "configs/small.py", ["mistral_small_3_24b"]))
  out, trainer_gib = [], {}
  for name, spec, models in recipes:
    config = load_recipe(spec, common.ROOT)
    run = config_lib.validate(config)
    for stage in stage_list(config, run):
      for model in models:
        cfg = P.model_from_spec(model, stage.run.model)
        label = f"{cfg.num_params() / 1e9:.0f}B"
        for cluster in args.clusters.split(","):
          for variant in VARIANTS:
            r = project_one(stage.run, cfg, cluster, variant, args,
                            verify_core_s, message_s, trainer_gib)
            out.append({"recipe": name, "stage": stage.name, "model": label, **r})
  return out


def show(rows: list[dict]) -> None:
  head = (f"{'recipe':<7}{'stage':<6}{'model':<6}{'cluster':<10}{'variant':<35}{'train+gen':>11}"
          f"{'slots':>6}{'step s':>9}  " + "  ".join(f"{p[:5]:>5}" for p in M.PARTS)
          + "  bottleneck")
  print(head, file=sys.stderr)
  for r in rows:
    shares = ("  ".join(f"{r['shares'][p]:5.1%}" for p in M.PARTS) if r["step_s"] else
              " " * 34)
    print(f"{r['recipe']:<7}{r['stage']:<6}{r['model']:<6}{r['cluster']:<10}{r['variant']:<35}"
          f"{r['trainer_chips']:>4}+{r['generators']}x{r['gen_chips']:<4}{r['slots'] or 0:>6}"
          f"{r['step_s'] or 0:>9.0f}  {shares}  {r['bottleneck']}", file=sys.stderr)


def rounded(v):
  return ({a: rounded(b) for a, b in v.items()} if isinstance(v, dict) else
          round(v, 3) if isinstance(v, float) else v)


def main() -> None:
  p = common.argument_parser(__doc__)
  p.add_argument("--cpu_run_workdir", default="", help="the 3-process run's workdir")
  p.add_argument("--sft_steps", type=int, default=200, help="when this script runs it")
  p.add_argument("--batches", type=int, default=14, help="when this script runs it")
  p.add_argument("--skip", type=int, default=2, help="first batches left out (compilation)")
  p.add_argument("--reps", type=int, default=5)
  p.add_argument("--verify_tasks", type=int, default=200)
  p.add_argument("--projection_only", action="store_true")
  p.add_argument("--math_verify_s", type=float, default=1 / 195.2,
                 help="a math verification's CPU s (BENCHMARKS.md, MATH-500: 195.2/s)")
  p.add_argument("--message_s", type=float, default=0.002, help="projection_only: measured")
  p.add_argument("--clusters", default="64xH100,128xH100,256xH100,v5p-128,v5p-256")
  p.add_argument("--medium_models", default=f"mistral_small_3_24b;{MEDIUM_125B}",
                 help="';'-separated plan.py model specs")
  p.add_argument("--keep", type=float, default=0.5, help="assumed share of groups kept")
  p.add_argument("--prompt_tokens", type=float, default=512.0, help="assumed mean prompt")
  p.add_argument("--length_frac", type=float, default=0.5,
                 help="assumed mean response / (l_max - l_cache)")
  p.add_argument("--code_share", type=float, default=0.5, help="assumed share of code tasks")
  p.add_argument("--padding", type=float, default=0.06, help="collation's padding share")
  p.add_argument("--distributed", action="store_true", help=argparse.SUPPRESS)  # the children
  args = p.parse_args()
  if args.distributed:
    return child(args)
  result = {"bench": "scale_model"}
  message_s = args.message_s
  if not args.projection_only:
    check = result["cpu_check"] = cpu_check(args)
    result["predicted_over_measured"] = round(check["predicted_over_measured"], 3)
    message_s = check["rates"]["message_s"]
  # The math share at MATH-500's verification rate: the CPU run's arithmetic checks faster.
  verify_core_s = (1 - args.code_share) * args.math_verify_s + args.code_share * CODE_VERIFY_S
  rows = projections(args, verify_core_s, message_s)
  show(rows)
  result["projections"] = [rounded(r) for r in rows]
  result["assumptions"] = dict(
      {k: getattr(args, k) for k in ("keep", "prompt_tokens", "length_frac", "code_share",
                                     "padding", "math_verify_s")},
      verify_core_s=verify_core_s, message_s=message_s,
      accelerators={k: dataclasses.asdict(v) for k, v in ACCELERATORS.items()})
  result.update(common.host_info())
  common.emit(result)


if __name__ == "__main__":
  main()
