"""What both sides of bench/vs_tunix.py compute alike: the reward tie-breaker, the weights
checksum, peak memory, a side's summary and its command line. Both venvs import it, so it imports
nothing of either framework (numpy and jax, which both have, inside the functions)."""
import argparse
import importlib.metadata as md
import json
import os
import resource
import statistics
import time
import zlib


def jitter(text: str) -> float:
  """The deterministic tie-breaker both sides add to each reward (see bench/vs_tunix.py)."""
  return (zlib.crc32(text.encode("utf-8")) % 1000) / 1e5


def weights_checksum(leaves) -> list[float]:
  """[sum, sum of squares] over every weight, in float64: equal on both sides when they hold the
  same numbers, whatever their layouts."""
  import numpy as np
  s = q = 0.0
  for x in leaves:
    x = np.asarray(x, np.float64)
    s += float(x.sum())
    q += float((x * x).sum())
  return [s, q]


def peak_memory_bytes() -> tuple[int, str]:
  """The process's peak memory: the accelerator's peak_bytes_in_use, else the peak RSS."""
  import jax
  dev = jax.devices()[0]
  if dev.platform != "cpu":
    stats = dev.memory_stats() or {}
    if "peak_bytes_in_use" in stats:
      return int(stats["peak_bytes_in_use"]), f"{dev.platform} peak_bytes_in_use"
  return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
          "process peak RSS (ru_maxrss)")


def time_calls(obj, name: str, spans: list, after=None) -> None:
  """Wraps obj.NAME so that each call appends its (start, end) perf_counter seconds to `spans`,
  after `after(result)` where given: the sides' hooks on their loops' parts."""
  fn = getattr(obj, name)

  def timed(*a, **kw):
    t = time.perf_counter()
    out = fn(*a, **kw)
    if after is not None:
      after(out)
    spans.append((t, time.perf_counter()))
    return out
  setattr(obj, name, timed)


def side_summary(spec: dict, t0: float, spans: dict, record, **extra) -> dict:
  """A side's figures (the same code for both sides). Iteration i runs from the previous one's
  end (t0 for the first) to spans["iter_end"][i]; record(i, start, end, within) gives its figures,
  within(key) the seconds of the (start, end) spans[key] that begin inside it. The first
  spec["warmup"] iterations stay out of the medians. Then the peak memory, the device, `extra`."""
  import jax
  ends, iters = spans["iter_end"], []
  for i, (s, e) in enumerate(zip([t0] + ends[:-1], ends)):
    iters.append(record(i, s, e, lambda key: sum(b - a for a, b in spans[key] if s <= a < e)))
  warmup, iters = iters[:spec["warmup"]], iters[spec["warmup"]:]
  med = lambda k: float(statistics.median(x[k] for x in iters))
  mem, mem_kind = peak_memory_bytes()
  dev = jax.devices()[0]
  n = spec["prompts_per_iteration"] * spec["group_size"]
  return {
      "completions_per_s": n / med("iteration_s"),
      "rollout_tokens_per_s": float(statistics.median(x["generated_tokens"] / x["rollout_s"]
                                                      for x in iters)),
      "iteration_s_median": med("iteration_s"), "rollout_s": med("rollout_s"),
      "scoring_s": med("scoring_s"), "train_step_s": med("train_step_s"),
      "weight_sync_s": med("weight_sync_s"),
      "other_s": med("iteration_s") - med("rollout_s") - med("scoring_s") - med("train_step_s")
      - med("weight_sync_s"),
      "iteration_s": [round(x["iteration_s"], 4) for x in iters],
      "rollout_s_all": [round(x["rollout_s"], 4) for x in iters],
      "train_step_s_all": [round(x["train_step_s"], 4) for x in iters],
      "warmup_iteration_s": [round(x["iteration_s"], 3) for x in warmup],
      "generated_tokens_per_iteration": [x["generated_tokens"] for x in iters],
      "completions_per_iteration": [x["completions"] for x in iters],
      "peak_memory_bytes": mem, "peak_memory_kind": mem_kind,
      "device": f"{dev.platform}: {dev.device_kind}", **extra,
  }


def side_main(doc: str, run, score) -> None:
  """A side's command line: `--spec` runs `run(spec)` on the workload bench/vs_tunix.py wrote,
  `--score` prints `score(spec)`, the side's rewards of a JSON file's completions and answers
  (tests/bench/test_vs_tunix.py); either way one JSON object as the last line."""
  ap = argparse.ArgumentParser(description=doc,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--spec", help="the workload (JSON) bench/vs_tunix.py wrote")
  ap.add_argument("--score", help="print this side's rewards of a JSON file's completions")
  args = ap.parse_args()
  if not (args.spec or args.score):
    ap.error("--spec or --score is required")
  with open(args.score or args.spec) as f:
    spec = json.load(f)
  if not args.score and spec["platform"] == "cpu":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
  print(json.dumps({"rewards": score(spec)} if args.score else run(spec)), flush=True)


def versions(names) -> dict:
  """{distribution: its installed version, or None}."""
  out = {}
  for n in names:
    try:
      out[n] = md.version(n)
    except md.PackageNotFoundError:
      out[n] = None
  return out
