"""Benchmark: the generator loop on a paged KV cache against the dense cache, at equal KV memory.

Workload: `--requests` requests with long-tailed prompt and completion lengths (lognormal, means
`--prompt_mean` / `--new_mean`, clipped to the cache's halves), random weights of SmolLM2-135M's
shapes with `--layers` layers (fp32; no EOS, so every sample runs to its own max_new_tokens), a
cache of `--cache` positions per sequence.
Baseline: the dense engine with `--dense_slots` slots (each owns `--cache` positions; one attention
window, so every step reads every slot's whole cache). Against it: the paged engine with a pool of
the same memory (dense_slots x cache positions, in pages of `--page_size`) under `--paged_slots`
slots. Each engine's generate steps (its own and its drain's compacted ones) first take the faster
XLA:CPU dot library, as a run's generators do (xla_cpu.tune_engine); then it runs the workload
once to compile, then once timed.

Figures (last line): `paged_over_dense_tokens_per_s` (generated tokens per second of wall time,
prefills included); `kv_read_over_live` (KV positions the decode steps read, over the positions
their slots hold: the live pages in whole chunks of each step, paged_attention.bytes_read; the
dense cache's length for each slot a step computes) for both, and
`paged_read_per_token_over_dense`; `in_flight_ratio` (sequences per decode step while requests
wait for a slot, paged over dense: what the same memory holds at once; the drain's steps, which
the longest samples set, are left out); `preempted_frac` (samples parked for want of pages, over
all samples); `same_samples` (share of samples with the dense run's tokens: the batches differ,
so the last bits of the float sums may).

  python bench/paged_decode.py [--requests 32] [--cache 8192] [--layers 4]
"""
import time

import common

common.use_cpu_devices()

import jax
import numpy as np

from magistral_jax.generate.config import SamplingConfig
from magistral_jax.generate.engine import Engine
from magistral_jax.generate.loop import DIRECT, GeneratorLoop
from magistral_jax.generate.requests import Request
from magistral_jax.generate.xla_cpu import tune_engine
from magistral_jax.model import config as model_config
from magistral_jax.model import paged_attention as pa
from magistral_jax.model.named import random_params
from magistral_jax.parallel.sharding import make_mesh


def workload(a, vocab: int) -> list[Request]:
  r = np.random.default_rng(a.seed)
  half = a.cache // 2
  prompts = common.lognormal_lengths(r, a.prompt_mean, a.requests, half)
  news = common.lognormal_lengths(r, a.new_mean, a.requests, half)
  return [Request(f"r{i}", r.integers(1, vocab, p).tolist(), max_new_tokens=int(n), seed=i)
          for i, (p, n) in enumerate(zip(prompts, news))]


def run(engine: Engine, params, reqs, sampling) -> dict:
  """One pass of the workload: tokens, wall time, and what the decode steps read and held."""
  loop = GeneratorLoop(engine, params, sampling=sampling, options=DIRECT)
  slots, reads, lives, busy = loop.parts.slots, [], [], []
  positions = slots.positions

  def recorded(in_flight=None):   # each dispatched step: the positions its slots hold
    held = list(slots.reached(in_flight).values())
    lives.append(sum(held))
    if not loop.parts.requests.empty() or any(g.waiting > 0 for g in loop.parts.groups):
      busy.append(len(held))   # sequences in flight while requests wait: the capacity
    if engine.kv_pages:
      reads.append(pa.bytes_read(engine.paged_attention, held, engine.page_size,
                                 engine.max_pages_per_slot, 1))
    return positions(in_flight)
  slots.positions = recorded
  t0 = time.perf_counter()
  for q in reqs:
    loop.submit(q)
  samples = loop.run_until_idle()
  wall = time.perf_counter() - t0
  c = loop.counters
  if not engine.kv_pages:   # every computed slot (drain compaction computes fewer) reads it all
    reads = [c.computed_slot_steps * engine.cache_length]
  return dict(wall_s=wall, tokens=sum(len(s.tokens) for s in samples),
              in_flight=c.active_slot_steps / max(1, c.steps), steps=c.steps,
              in_flight_while_queued=float(np.mean(busy)) if busy else None,
              compact_steps=c.compact_steps,
              kv_positions_read=int(sum(reads)), kv_read_over_live=sum(reads) / max(1, sum(lives)),
              mean_live=sum(lives) / max(1, c.active_slot_steps),
              preemptions=loop.metrics().get("kv_preemptions", 0.0),
              samples={s.request_id: s.tokens for s in samples})


def main():
  a = common.argument_parser(
      __doc__, requests=32, cache=(8192, "positions per sequence"), prompt_mean=1024.0,
      new_mean=96.0, layers=4, dense_slots=8, paged_slots=32, page_size=16, seed=0).parse_args()
  cfg = model_config.SMOLLM2_135M.replace(num_layers=a.layers, dtype="float32",
                                          param_dtype="float32")
  sampling = SamplingConfig(greedy=True, max_new_tokens=a.cache // 2)
  mesh = make_mesh({"tensor": 1}, jax.devices()[:1])
  shape = dict(max_prefill_length=a.cache // 2, max_decode_length=a.cache // 2,
               sampling=sampling, max_prefill_batch=4)
  pages = a.dense_slots * -(-a.cache // a.page_size) + 1
  engines = {"dense": Engine(cfg, mesh, max_concurrent_decodes=a.dense_slots, **shape),
             "paged": Engine(cfg, mesh, max_concurrent_decodes=a.paged_slots, kv_pages=pages,
                             page_size=a.page_size, **shape)}
  params = random_params(cfg)
  reqs = workload(a, cfg.vocab_size)
  out = {}
  for name, eng in engines.items():
    p = eng.load_params(params)
    tune_engine(eng, p)                         # as pipeline/generators.py does
    run(eng, p, reqs, sampling)                 # compiles every program the workload needs
    out[name] = run(eng, p, reqs, sampling)
    out[name]["tokens_per_s"] = out[name]["tokens"] / out[name]["wall_s"]
    out[name]["dot_library"] = {n: e.generate_step.library for n, e in
                                [(eng.max_concurrent_decodes, eng)] + [
                                    (c, eng.compact_engine(c)) for c in eng.compact_sizes]}
  d, p = out["dense"], out["paged"]
  same = np.mean([d["samples"][k] == p["samples"][k] for k in d["samples"]])
  for r in out.values():
    del r["samples"]
  common.emit(dict(
      bench="paged_decode", backend=jax.default_backend(), layers=a.layers, cache=a.cache,
      requests=a.requests, page_size=a.page_size, kv_pages=pages,
      dense_slots=a.dense_slots, paged_slots=a.paged_slots,
      live_fraction=d["mean_live"] / a.cache, dense=d, paged=p,
      paged_over_dense_tokens_per_s=p["tokens_per_s"] / d["tokens_per_s"],
      kv_read_over_live=p["kv_read_over_live"],
      # Per generated token (both hold the same tokens at the same positions, step by step).
      paged_read_per_token_over_dense=p["kv_positions_read"] / max(1, d["kv_positions_read"]),
      # None when a side never had requests waiting (as many slots as requests): its slots, not
      # its memory, held it back, so the ratio says nothing about the memory.
      in_flight_ratio=(p["in_flight_while_queued"] / d["in_flight_while_queued"]
                       if p["in_flight_while_queued"] and d["in_flight_while_queued"] else None),
      preempted_frac=p["preemptions"] / a.requests, same_samples=float(same),
      host=common.host_info()), ndigits=4)


if __name__ == "__main__":
  main()
