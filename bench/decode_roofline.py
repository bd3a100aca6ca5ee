"""Benchmark: decode at a full batch (an Engine with `--batch` busy slots, timed as Engine.generate
back to back and as GeneratorLoop.step) against the memory-bandwidth roofline: the bytes a step
must move (analysis/scale_model.py) over the streaming bandwidth measured in the same run (and
the vendor's). Models: smollm2 (GGUF or random init), llama1b (random init).

  python bench/decode_roofline.py                          # accelerator: batch 256, both models
  python bench/decode_roofline.py --models smollm2 --batch 16   # CPU

Last line, one JSON object, per model: tokens_per_s (engine, loop), step bytes, roofline step
times, roofline_fraction, roofline_fraction_live, kv_read_bytes, live_kv_read_bytes, FLOP/s.
"""
import dataclasses
import os
import time

import common
import jax
import jax.numpy as jnp
import numpy as np

from magistral_jax.analysis import scale_model as M


def run_model(name: str, args, mesh, bw: dict, spec: float | None) -> dict:
  from magistral_jax.generate.config import SamplingConfig
  from magistral_jax.generate.engine import Engine
  from magistral_jax.generate.loop import DIRECT, GeneratorLoop
  from magistral_jax.generate.requests import Request
  from magistral_jax.model import named
  dtype = args.dtype
  cfg, params, source, _ = named.load_model(name, dtype)
  cfg = dataclasses.replace(cfg, decode_attention=args.decode_attention)
  timed = args.warm_steps + args.loop_steps + args.engine_steps + 2
  new = max(timed, args.max_new or 0)
  sampling = (SamplingConfig(greedy=True, max_new_tokens=new, eos_id=None) if args.greedy else
              SamplingConfig(temperature=1.0, max_new_tokens=new, eos_id=None))
  eng = Engine(cfg, mesh, max_concurrent_decodes=args.batch, max_prefill_length=args.prompt,
               max_decode_length=new, prefill_buckets=(args.prompt,), sampling=sampling,
               compact_sizes=(), attention_windows=args.attention_windows)
  if params is None:  # random init straight onto the engine's mesh (no host copy of 1B params)
    params = named.random_params(cfg, eng.param_shardings)
  t = time.perf_counter()
  dev_params = eng.load_params(params)
  del params
  eng.precompile(dev_params, tune=eng.platform == "cpu")
  compile_s = time.perf_counter() - t
  params_bytes = sum(x.nbytes for x in jax.tree.leaves(dev_params))
  embed_bytes = dev_params["embed"]["embedding"].nbytes
  itemsize = jnp.dtype(dtype).itemsize

  loop = GeneratorLoop(eng, dev_params, compact_drain=False, sampling=eng.sampling,
                       options=dataclasses.replace(DIRECT, overlap_host=not args.no_overlap))
  rs = np.random.RandomState(0)
  for i in range(args.batch):
    loop.submit(Request(i, rs.randint(0, cfg.vocab_size, args.prompt).tolist(),
                        max_new_tokens=new))
  # The first step prefills every prompt (batches of the engine's prefill sizes), inserts them.
  fill_s = common.time_once(loop.step, block=False)[0]
  if loop.num_active != args.batch:
    raise RuntimeError(f"{loop.num_active} of {args.batch} slots filled")
  for _ in range(args.warm_steps):
    loop.step()
  # Every slot holds the prompt plus the tokens so far; the engine-timed steps use the window
  # the loop would pick for the last of them (windows only grow, so it holds them all).
  live_end = args.prompt + timed
  window = eng.window_for(live_end)
  if eng.window_for(args.prompt + 1) != window:
    raise SystemExit(f"the timed steps (positions {args.prompt + 1}..{live_end}) cross an "
                     f"attention window boundary of {eng.attention_windows}: the loop and the "
                     "engine would time different windows; change --max_new or the step counts")
  # Each round times a block of loop steps, then a block of engine steps on the loop's state
  # (the loop does not record the engine-timed tokens; nothing finishes, so nothing is lost).
  def loop_step():   # with overlap, a round ends on the step in flight: waiting for loop.state
    loop.step()      # (the last step's output) times it to completion
    return loop.state

  def engine_step():
    loop.state, res = eng.generate(dev_params, loop.state, window)
    return loop.state, res
  timing = common.time_rounds(
      {"loop": loop_step, "engine": engine_step}, args.rounds, warmup=0,
      calls={"loop": args.loop_steps // args.rounds, "engine": args.engine_steps // args.rounds})
  # A slot that finished stays inactive, so the last engine step shows it.
  if loop.num_active != args.batch or not bool(
      np.all(jax.device_get(timing["engine"].result[1].valid))):
    raise RuntimeError("a slot finished during the timed steps")
  loop_step_s, engine_step_s = timing["loop"].median, timing["engine"].median

  # The mean position the timed steps attend up to (live slots' prompt plus tokens so far).
  live_len = args.prompt + args.warm_steps + 1 + (args.loop_steps + args.engine_steps) / 2
  live = M.decode_step_traffic(cfg, params_bytes, embed_bytes, args.batch, live_len, itemsize)
  # What the step reads: the window (XLA's decode attention) or the live positions.
  tr = (live if eng.decode_attention == "live" else
        M.decode_step_traffic(cfg, params_bytes, embed_bytes, args.batch, window, itemsize))
  bytes_ = tr["bytes_per_step"]
  roof_measured = bytes_ / (bw["stream_GBps"] * 1e9)
  out = {
      "model": name, "weights": source, "dtype": dtype, "params": int(cfg.num_params()),
      "batch": args.batch, "cache_length": eng.cache_length, "attention_window": window,
      "attention_windows": list(eng.attention_windows), "live_positions": live_len,
      "decode_attention": eng.decode_attention,
      "sampling": "greedy" if args.greedy else "temperature 1",
      "dot_library": eng.generate_library, "compile_and_tune_s": compile_s,
      "fill_s": fill_s, "overlap_host": loop.options.overlap_host,
      "engine_step_ms": engine_step_s * 1e3, "loop_step_ms": loop_step_s * 1e3,
      **{f"{k}_step_ms_per_round": [x * 1e3 for x in t.rounds] for k, t in timing.items()},
      "tokens_per_s": args.batch / engine_step_s,
      "loop_tokens_per_s": args.batch / loop_step_s,
      **tr,
      "achieved_GBps": bytes_ / engine_step_s / 1e9,
      "achieved_TFLOPs": tr["flops_per_step"] / engine_step_s / 1e12,
      "roofline_step_ms_measured_bw": roof_measured * 1e3,
      "roofline_fraction": roof_measured / engine_step_s,
      "live_kv_read_bytes": live["kv_read_bytes"],
      "roofline_fraction_live": live["bytes_per_step"] / (bw["stream_GBps"] * 1e9) / engine_step_s,
  }
  if spec:
    out["roofline_step_ms_spec_bw"] = bytes_ / (spec * 1e9) * 1e3
    out["roofline_fraction_of_spec"] = bytes_ / (spec * 1e9) / engine_step_s
  return out


def main():
  args = common.argument_parser(
      __doc__, models="smollm2,llama1b", batch=256, prompt=128,
      dtype=(str, "float32 / bfloat16 (default: by platform)"),
      tensor=(1, "devices of the engine's tensor axis"),
      greedy=(False, "greedy instead of temperature 1"),
      max_new=(int, "a KV cache for this many new tokens (default: the timed steps only)"),
      decode_attention=(["xla", "auto", "live"], "ModelConfig.decode_attention: xla reads the "
                        "window, live (Pallas, interpreted on CPU) each slot's reached positions"),
      attention_windows=(1, "1: dense over the cache"),
      no_overlap=(False, "GeneratorLoop overlap_host=False"), warm_steps=4, loop_steps=32,
      engine_steps=32, rounds=(4, "interleaved rounds of loop and engine"),
      bandwidth_mib=(int, "the bandwidth probe's array (default 2048; 512 on CPU)")).parse_args()
  from magistral_jax.parallel.sharding import make_mesh
  devices = jax.devices()[:args.tensor]
  if len(devices) < args.tensor:
    raise SystemExit(f"--tensor {args.tensor}: only {len(jax.devices())} devices")
  platform = devices[0].platform
  args.dtype = args.dtype or ("float32" if platform == "cpu" else "bfloat16")
  mesh = make_mesh({"tensor": args.tensor}, devices)
  kind = devices[0].device_kind
  bw = common.stream_bandwidth(devices[0],
                               (args.bandwidth_mib or (512 if platform == "cpu" else 2048)) << 20)
  spec = M.vendor_peak(kind)[1]
  common.emit({"device": kind, "bandwidth": bw, "spec_GBps": spec})
  runs = {}
  for name in [m for m in args.models.split(",") if m]:
    runs[name] = run_model(name, args, mesh, bw, spec)
    common.emit(runs[name])
  first = runs[next(iter(runs))]
  common.emit({
      "bench": "decode_roofline", "platform": platform, "device": kind,
      "devices": args.tensor, "cpus": os.cpu_count(), "dtype": args.dtype, "batch": args.batch,
      "overlap_host": not args.no_overlap,
      **{f"measured_{k}": bw[k] for k in ("read_GBps", "copy_GBps", "stream_GBps")},
      "spec_GBps": spec, **{k: first[k] for k in ("cache_length", "attention_window",
                                                  "tokens_per_s", "roofline_fraction")},
      "runs": runs})


if __name__ == "__main__":
  main()
