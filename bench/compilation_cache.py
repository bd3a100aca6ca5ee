"""Benchmark: a short launch/train.py run without JAX's persistent compilation cache (off), on
an empty cache (cold) and on that cache again (warm): wall time, compile seconds, cache hits.

  python bench/compilation_cache.py [--config=...] [-- flags]

Last line, one JSON object: per-launch figures and warm_over_off.
"""
import json
import os
import sys
import tempfile

import common   # bench/common.py, beside the script

# Run inside each launch (through PYTHONPATH): JAX's compile and cache counters, at exit.
SITECUSTOMIZE = """
import atexit, json, os
from jax._src import monitoring   # jax reads its JAX_* variables here; no backend starts yet
_totals = {"compile_s": 0.0, "compiles": 0, "cache_hits": 0}
def _on_duration(event, duration, **kw):
  if event == "/jax/core/compile/backend_compile_duration":
    _totals["compile_s"] += duration
    _totals["compiles"] += 1
def _on_event(event, **kw):
  if event == "/jax/compilation_cache/cache_hits":
    _totals["cache_hits"] += 1
monitoring.register_event_duration_secs_listener(_on_duration)
monitoring.register_event_listener(_on_event)
# One file per process: the launch's own verifier workers run this too.
atexit.register(lambda: open(os.path.join(os.environ["BENCH_COUNTERS"], str(os.getpid())),
                             "w").write(json.dumps(_totals)))
"""


def launch(args, cache_dir: str, scratch: str, tag: str) -> dict:
  workdir = os.path.join(scratch, f"run_{tag}")
  counters = os.path.join(scratch, f"counters_{tag}")
  os.makedirs(counters)
  env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=cache_dir, BENCH_COUNTERS=counters,
             PYTHONPATH=os.pathsep.join([os.path.join(scratch, "site")] +
                                        [p for p in [os.environ.get("PYTHONPATH")] if p]))
  wall = common.run_logged([sys.executable, "launch/train.py", f"--workdir={workdir}",
                            f"--config={args.config}", *args.flags],
                           os.path.join(scratch, f"launch_{tag}.log"), env=env)
  # The launch process is the one that compiled the most (its workers compile nothing).
  out = max((json.load(open(os.path.join(counters, f))) for f in os.listdir(counters)),
            key=lambda c: c["compiles"])
  out.update(wall_s=round(wall, 1), compile_s=round(out["compile_s"], 1))
  print(f"{tag:5s} wall {out['wall_s']:7.1f} s | {out['compiles']} programs compiled or loaded in "
        f"{out['compile_s']:.1f} s | cache hits {out['cache_hits']}", flush=True)
  return out


def main():
  p = common.argument_parser(__doc__)
  p.add_argument("--config", default="configs/tiny.py:sft_steps=20,batches=3")
  p.add_argument("flags", nargs="*", default=["--config.data.heldout=16"],
                 help="more launch/train.py flags (after --)")
  args = p.parse_args()
  with tempfile.TemporaryDirectory(prefix="bench_compilation_cache_") as scratch:
    os.makedirs(os.path.join(scratch, "site"))
    with open(os.path.join(scratch, "site", "sitecustomize.py"), "w") as f:
      f.write(SITECUSTOMIZE)
    cache = os.path.join(scratch, "xla")
    runs = {tag: launch(args, c, scratch, tag) for tag, c in (("off", ""), ("cold", cache),
                                                              ("warm", cache))}
    cache_mb = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(cache)
                   for f in fs) / 2**20
  common.emit({"bench": "compilation_cache", "config": args.config, "flags": args.flags,
               **runs, "cache_MB": cache_mb, **common.host_info(),
               **{f"{k}_over_off": runs[k]["wall_s"] / runs["off"]["wall_s"]
                  for k in ("cold", "warm")}}, ndigits=3)


if __name__ == "__main__":
  main()
