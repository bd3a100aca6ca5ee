"""Benchmark: the continuous-batching generator (a GeneratorLoop over an Engine of B slots,
refilled from a queue, weights pushed mid-run) against transformers `generate` in static batches
of B, on the same requests and weights (SmolLM2-135M-Instruct's GGUF, or a random init of
`--model`'s shapes for both sides): prompts of `--prompt` tokens, [min_new, 5 * min_new] new
tokens, EOS ignored. `--repeats` alternates the sides; speedups are medians of per-pair ratios.
`--shared_prefix N` adds a transformers side that reuses a DynamicCache of the common prefix.

  python bench/generate.py [--batches 16,64] [--repeats 3]

Last line, one JSON object: the largest batch size's speedup_vs_hf(_prefix_cache),
speedup_outside_prefill, slot_utilization, ..., and every batch size's figures under 'runs'.
"""
import dataclasses
import os
import threading
import time

import common
import jax
import numpy as np


def run_ours(cfg, params, prompts, lengths, slots, args, time_prefill=False):
  from magistral_jax.generate.config import SamplingConfig
  from magistral_jax.generate.engine import Engine
  from magistral_jax.generate.loop import DIRECT, GeneratorLoop
  from magistral_jax.generate.requests import Request
  from magistral_jax.parallel.sharding import make_mesh
  p_len, n_shared, group_size = len(prompts[0]), args.shared_prefix, args.group_size
  sampling = (SamplingConfig(greedy=True, max_new_tokens=8) if args.temperature <= 0 else
              SamplingConfig(temperature=args.temperature, top_p=args.top_p, max_new_tokens=8))
  # With a shared prefix the rests of the prompts (p_len - n_shared tokens) get a bucket.
  eng = Engine(cfg, make_mesh({"tensor": 1}, jax.devices()[:1]), max_concurrent_decodes=slots,
               max_prefill_length=p_len, max_decode_length=int(max(lengths)),
               prefill_buckets=(p_len - n_shared, p_len) if n_shared else (p_len,),
               sampling=sampling, attention_windows=args.attention_windows)
  shared = list(prompts[0][:n_shared]) if n_shared else None
  # Warm-up: pick the generate step's CPU dot library by timing both (xla_cpu.tune_engine),
  # compile every (bucket, prefill batch size) program once, then run a request through the loop.
  warm = GeneratorLoop(eng, params, shared_prefix=shared, sampling=eng.sampling)
  eng.precompile(warm.params, existing_prefix=warm.shared_prefix_cache())
  warm.submit(Request("w", prompts[0], max_new_tokens=2))
  warm.run_until_idle()
  compiled = eng.compile_counts()

  # The shared prefix is prefilled here, before the clock starts (transformers' prefix cache is
  # made before its clock too), and again after each weight push by the first prefill that
  # needs it, while the loop runs.
  options = dataclasses.replace(DIRECT, background_prefill=not args.no_background_prefill,
                                loop_prefill_below=args.loop_prefill_below)
  loop = GeneratorLoop(eng, params, options=options, compact_drain=not args.no_compact,
                       shared_prefix=shared, sampling=eng.sampling)
  for i, (p, n) in enumerate(zip(prompts, lengths)):
    loop.submit(Request(i, p, group_size=group_size, max_new_tokens=int(n)))
  total, n_updates = int(sum(lengths)) * group_size, args.n_updates
  queued_util, call_s = [], []

  # The trainer side holds its weights on device; give it distinct device copies to push.
  pushes = [jax.tree.map(lambda x: x.copy(), loop.params) for _ in range(n_updates)]
  jax.block_until_ready(pushes)

  def pusher():  # push weights a few times while the loop runs, from another thread
    for v in range(1, n_updates + 1):
      while loop.counters.generated_tokens < total * v / (n_updates + 1):
        time.sleep(0.01)
      t = time.perf_counter()
      loop.update_params(pushes[v - 1], v)
      call_s.append(time.perf_counter() - t)
  th = threading.Thread(target=pusher)
  t0 = time.perf_counter()
  th.start()
  while not loop.idle():
    loop.step()
    if loop._pending_work():
      queued_util.append((loop.counters.steps, loop.counters.active_slot_steps))
  done = sum(len(loop.completions.get().tokens) for _ in range(loop.completions.qsize()))
  wall = time.perf_counter() - t0
  th.join()
  # Prefill alone, after the timed run on the same engine: every prompt once, in the engine's
  # largest prefill batch (what the loop does when it has enough queued).
  prefill_s = (time_prefill_ours(eng, loop.params, prompts, loop.shared_prefix_cache())
               if time_prefill else None)
  c, metrics = loop.counters, loop.metrics()
  step_s, pause_s = c.decode_time_s / c.steps, max(c.update_pauses_s, default=0.0)
  s_q, a_q = queued_util[-1] if queued_util else (1, 0)
  return {
      "tokens_per_s": done / wall, "wall_s": wall, "generated_tokens": done, "steps": c.steps,
      **{k: metrics[k] for k in ("slot_utilization", "computed_slot_utilization",
                                 "attention_window_fraction", "shared_prefix_hits",
                                 "shared_prefix_prefills")},
      "slot_utilization_while_queued": a_q / (s_q * slots),
      "decode_step_s": step_s, "decode_s": c.decode_time_s,
      "prefill_insert_host_s": wall - c.decode_time_s, "versions_seen": loop.version,
      "update_pause_s": pause_s, "update_pause_in_steps": pause_s / step_s,
      "update_call_s": max(call_s, default=0.0), "recompiled": eng.compile_counts() != compiled,
      "dot_library": eng.generate_library, "generate_tuning": eng.generate_tuning,
      "compact_steps": c.compact_steps, "background_prefill": options.background_prefill,
      "loop_prefill_below": options.loop_prefill_below, "prefill_wait_s": c.prefill_wait_s,
      "background_prefilled": c.background_prefilled,
      "attention_windows": list(eng.attention_windows),
      "compact_tuning": {n: eng.compact_engine(n).generate_tuning for n in eng.compact_sizes},
      "prefill_only_s": prefill_s,
  }


def time_prefill_ours(eng, params, prompts, shared=None) -> float:
  """Our prefill alone: every prompt once, in the calls the loop makes for a long queue
  (Engine.split_batch: the largest prefill batch first); with `shared` (the shared prefix's
  Prefix, made beforehand, as in the loop), each prompt's rest continuing it."""
  n_shared = 0 if shared is None else int(np.asarray(shared.true_length))
  tokens = np.asarray(prompts, np.int32)[:, n_shared:]
  kw = {} if shared is None else {"existing_prefix": shared}
  t, start = time.perf_counter(), 0
  for m in eng.split_batch(len(tokens)):
    jax.block_until_ready(eng.prefill_many(params, tokens[start:start + m],
                                           [tokens.shape[1]] * m, **kw))
    start += m
  return time.perf_counter() - t


def hf_batches(hf, prompts, batch, group_size=1, prefix_cache=None):
  """(first prompt index, token tensor, past) per static batch of transformers: batch // group_size
  prompts, each repeated group_size times (what num_return_sequences does before the prefill);
  `past`, generate's keywords: with `prefix_cache` (hf_prefix_cache) a copy of it, repeated to the
  batch, as past_key_values."""
  import copy
  import torch
  per = max(1, batch // group_size)
  for s in range(0, len(prompts), per):
    x = torch.tensor(prompts[s:s + per], dtype=torch.long,
                     device=hf.device).repeat_interleave(group_size, 0)
    past = {} if prefix_cache is None else {"past_key_values": copy.deepcopy(prefix_cache)}
    if past:
      past["past_key_values"].batch_repeat_interleave(len(x))
    yield s, x, past


def time_prefill_hf(hf, prompts, batch, group_size=1, prefix_cache=None) -> float:
  """transformers' prefill alone: the first forward of each static batch as `generate` runs it
  (KV cache on, logits of the last position only); with `prefix_cache` (hf_prefix_cache) the
  forward of the prompts' rests over a copy of that cache, repeated to the batch."""
  import torch
  n = 0 if prefix_cache is None else prefix_cache.get_seq_length()
  t = time.perf_counter()
  with torch.inference_mode():
    for _, x, past in hf_batches(hf, prompts, batch, group_size, prefix_cache):
      hf(x[:, n:], use_cache=True, logits_to_keep=1, **past)
    _sync(hf)
  return time.perf_counter() - t


def hf_prefix_cache(hf, prefix):
  """transformers' prefix reuse (its documented way to share a prompt prefix across `generate`
  calls): one forward of the prefix into a DynamicCache, copied and repeated to each batch."""
  import torch
  from transformers import DynamicCache
  cache = DynamicCache()
  with torch.inference_mode():
    hf(torch.tensor([prefix], dtype=torch.long, device=hf.device), past_key_values=cache,
       use_cache=True, logits_to_keep=1)
  return cache


def load_hf(cfg, params, gguf_path, dtype: str, device: str):
  """transformers' model with the same weights: its own GGUF loader for the GGUF, else our params
  written as HF safetensors (fp32) and read back in `dtype`."""
  import tempfile
  from magistral_jax.model.hf_checkpoint import save_hf_safetensors
  if gguf_path is not None:
    return common.hf_causal_lm(gguf_path, dtype).to(device).eval()
  with tempfile.TemporaryDirectory() as d:
    save_hf_safetensors(jax.tree.map(lambda x: np.asarray(x, np.float32), params),
                        cfg.replace(dtype="float32", param_dtype="float32"), d)
    return common.hf_causal_lm(d, dtype).to(device).eval()


def _sync(hf):
  import torch
  if hf.device.type == "cuda":
    torch.cuda.synchronize()


def run_hf(hf, prompts, lengths, batch, args, prefix_cache=None):
  """transformers `generate` in static batches; with `prefix_cache` (hf_prefix_cache, made
  before the clock starts) each batch starts from a copy of it, so only the rests are
  prefilled."""
  import torch
  t0 = time.perf_counter()
  slot_steps, g = 0, args.group_size
  # Sampled: the same temperature / top-p, and top_k=0 (transformers' default is 50).
  how = (dict(do_sample=False) if args.temperature <= 0 else
         dict(do_sample=True, temperature=args.temperature, top_p=args.top_p, top_k=0))
  with torch.inference_mode():
    for s, x, past in hf_batches(hf, prompts, batch, g, prefix_cache):
      n = int(max(lengths[s:s + len(x) // g]))   # the batch runs to its longest
      hf.generate(x, max_new_tokens=n, min_new_tokens=n, eos_token_id=None, pad_token_id=0,
                  use_cache=True, **how, **past)
      slot_steps += n * len(x)
    _sync(hf)
  wall = time.perf_counter() - t0
  useful = float(sum(lengths)) * g
  return {"tokens_per_s": useful / wall, "wall_s": wall, "slot_utilization": useful / slot_steps}


def main():
  ap = common.argument_parser(
      __doc__, batches="16,64", requests_per_slot=1.5, prompt=128, min_new=8, n_updates=3,
      group_size=1, temperature=(0.0, "0: greedy; > 0: sampled"),
      top_p=(1.0, "nucleus mass when sampling"), skip_hf=False,
      shared_prefix=(0, "the first N prompt tokens are every request's (ours prefills them once)"),
      no_compact=(False, "GeneratorLoop compact_drain=False"),
      attention_windows=(1, "Engine's (1: dense)"),
      no_background_prefill=(False, "GeneratorLoop background_prefill=False"),
      loop_prefill_below=(0.5, "GeneratorLoop's"), repeats=(1, "runs per side and batch size"),
      model=("smollm2", "smollm2 | llama1b (Llama-3.2-1B shapes)"),
      weights=("auto", "gguf | random | auto (gguf if installed)"),
      dtype=("float32", "float32 | bfloat16, both sides"),
      hf_device=("auto", "cpu | cuda | auto (cuda where JAX runs on a GPU and torch sees one)"))
  args = ap.parse_args()
  if args.shared_prefix and not 0 < args.shared_prefix < args.prompt:
    ap.error(f"--shared_prefix {args.shared_prefix} must lie in [1, --prompt)")

  import torch
  from magistral_jax.model import named
  torch.set_num_threads(os.cpu_count())
  cfg, params, weights, gguf_path = named.load_model(args.model, args.dtype, args.weights)
  if params is None:   # made on the default device; transformers gets the same values
    params = named.random_params(cfg)
  hf_device = args.hf_device if args.hf_device != "auto" else (
      "cuda" if jax.default_backend() == "gpu" and torch.cuda.is_available() else "cpu")
  hf = None if args.skip_hf else load_hf(cfg, params, gguf_path, args.dtype, hf_device)
  median_run = lambda rs: rs[int(np.argsort([x["tokens_per_s"] for x in rs])[(len(rs) - 1) // 2])]

  runs = {}
  for b in [int(x) for x in args.batches.split(",")]:
    rs = np.random.RandomState(b)
    n_req = max(1, int(round(args.requests_per_slot * b / args.group_size)))
    prompts = rs.randint(0, cfg.vocab_size, (n_req, args.prompt))
    if args.shared_prefix:
      prompts[:, :args.shared_prefix] = rs.randint(0, cfg.vocab_size, args.shared_prefix)
    prompts = prompts.tolist()
    lengths = rs.randint(args.min_new, 5 * args.min_new + 1, n_req)
    # transformers' sides, each with its prefix cache: none, and the shared prefix's.
    caches = {} if hf is None else {"hf": None}
    if hf is not None:
      if args.shared_prefix:
        caches["hf_prefix_cache"] = hf_prefix_cache(hf, prompts[0][:args.shared_prefix])
      # Warmed up at this batch shape before its clock, as ours is (run_ours precompiles and
      # runs a request first): a first generate of a shape runs slow on a GPU.
      first = prompts[:max(1, b // args.group_size)]
      run_hf(hf, first, [2] * len(first), b, args)
    sides, prefill = {"ours": [], **{k: [] for k in caches}}, {}
    for rep in range(args.repeats):
      for side in (list(sides) if rep % 2 == 0 else list(sides)[::-1]):
        if side == "ours":
          sides[side].append(run_ours(cfg, params, prompts, lengths, b, args, rep == 0))
        else:
          sides[side].append(run_hf(hf, prompts, lengths, b, args, caches[side]))
          if rep == 0:
            prefill[side] = time_prefill_hf(hf, prompts, b, args.group_size, caches[side])
    ours = sides["ours"]
    r = {"batch": b, "requests": n_req, "group_size": args.group_size, "ours": median_run(ours)}
    for side in caches:
      ratios = [o["tokens_per_s"] / h["tokens_per_s"] for o, h in zip(ours, sides[side])]
      r.update({side: median_run(sides[side]), f"speedup_vs_{side}": float(np.median(ratios)),
                f"speedup_vs_{side}_per_repeat": ratios})
    if "hf" in caches:
      # Where the time goes: each side's prompt prefill alone (measured after its first run), and
      # the speedup on the rest of the wall (decode, scheduling, host work), the part continuous
      # batching changes. Prefill runs at about the same rate on both sides (the same matmuls),
      # so hf wall / our prefill bounds the speedup of any decoder on this workload.
      ours_p, hf_p = ours[0]["prefill_only_s"], prefill["hf"]
      r["prefill_only_s"] = {"ours": ours_p, **prefill}
      r["speedup_outside_prefill"] = float(np.median([(h["wall_s"] - hf_p) / max(
          o["wall_s"] - ours_p, 1e-9) for o, h in zip(ours, sides["hf"])]))
      r["speedup_bound_if_decode_free"] = float(np.median([h["wall_s"] for h in sides["hf"]])
                                                / ours_p)
    if args.repeats > 1:
      r["repeats"] = {k: sides.get(k, []) for k in ("ours", "hf", "hf_prefix_cache")}
    runs[b] = r
    common.emit(r)

  last = runs[max(runs)]
  common.emit({
      **common.host_info(), "jax_backend": jax.default_backend(),
      "device": jax.devices()[0].device_kind, "model": args.model, "weights": weights,
      "dtype": args.dtype, "hf_device": hf_device, "prompt": args.prompt,
      "new_tokens_range": [args.min_new, 5 * args.min_new],
      "sampling": ("greedy" if args.temperature <= 0 else
                   {"temperature": args.temperature, "top_p": args.top_p}),
      "shared_prefix": args.shared_prefix,
      **{k: last.get(k) for k in ("speedup_vs_hf", "speedup_vs_hf_prefix_cache",
                                  "speedup_outside_prefill", "speedup_bound_if_decode_free")},
      **{k: last["ours"][k] for k in ("slot_utilization", "computed_slot_utilization",
                                      "slot_utilization_while_queued")},
      "update_pause_in_steps": max(r["ours"]["update_pause_in_steps"] for r in runs.values()),
      "runs": {str(k): v for k, v in runs.items()}})


if __name__ == "__main__":
  main()
