"""Projects one RL step of configs/medium.py and configs/small.py onto named clusters, with the
step-time model of magistral_jax/analysis/scale_model.py (which bench/scale_model.py checks
against the 3-process CPU run). Each stage of each recipe on each of `--clusters`: half the chips
training (FSDP), the rest generators of the recipe's size and mesh with as many decode slots (up
to the recipe's) as fit a chip by run/plan.py's estimate. Chip figures: ACCELERATORS. Assumed
workload: --keep, --prompt_tokens, --length_frac, --code_share; the CPU-side rates from
--message_s and --math_verify_s (bench/scale_model.py measures the message latency). Policy:
Small is Mistral Small 3 (24B); Medium 3's shape is not public (--medium_models: the 24B shape,
Magistral Medium's smallest stated base, and README.md's 125B stand-in). VARIANTS say what the
bottleneck costs: 3/4 of the chips generating; `live read`, a decode step reading only each
slot's live positions (model/decode_live.py, decode_attention auto on NVIDIA GPUs), as many slots
as a dense cache fits; `paged` (engine.kv_cache), a slot also holding only its live positions
(more slots fit; its reads times --paged_read_over_live);
`push spread` (analysis/scale_model.push_seconds).

A table on stderr; the last line, one JSON object: every projection and the assumptions.

  python tools/project_recipes.py [--clusters 64xH100,128xH100,256xH100,v5p-128,v5p-256]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from magistral_jax.analysis import scale_model as M
from magistral_jax.run import footprint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MEDIUM_125B = ("vocab_size=131072,hidden_size=12288,intermediate_size=28672,num_layers=88,"
               "num_heads=96,num_kv_heads=8,head_dim=128")
# Chip figures. H100: mfu, decode_frac and stage_gbps are BENCHMARKS.md "First accelerator run
# (H100)" rows (`train` 1 x 8,192: MFU 0.274; `roofline` Llama-3.2-1B shape: 0.41 of the spec
# bandwidth; `push` 1B shape: 8.57 ms for its 2.47 GB of bf16 weights); the rest are the
# vendor's figures (M.VENDOR_PEAKS) or assumptions (see BENCHMARKS.md "Many hosts: a model of
# one step"). TPU v5p: the vendor's peak and bandwidth with the H100's measured efficiencies (an
# assumption).
ACCELERATORS = {
    "H100": M.Accelerator("H100", *M.vendor_peak("H100"), memory_gib=78.0,
                          chips_per_host=8, mfu=0.274, decode_frac=0.41,
                          stage_gbps=2.47 / 8.57e-3, link_gbps=50.0, transfer_gbps=10.0,
                          verifier_cores=100, platform="cuda"),
    "v5p": M.Accelerator("v5p", *M.vendor_peak("TPU v5p"), memory_gib=95.0,
                         chips_per_host=4, mfu=0.274, decode_frac=0.41,
                         stage_gbps=2.47 / 8.57e-3 * M.vendor_peak("TPU v5p")[1]
                         / M.vendor_peak("H100")[1], link_gbps=100.0,
                         transfer_gbps=25.0, verifier_cores=200, platform="tpu"),
}
# A code completion's CPU seconds: 20 tests, each a sandboxed program run (BENCHMARKS.md
# "Rewards and verifier pool": 30.3 programs/s on 2 workers).
CODE_VERIFY_S = 20 / (30.3 / 2)


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
  # What a step reads per slot: the whole cache, or the live positions (paged: times the read
  # ratio measured for the paged attention, --paged_read_over_live).
  read = cache if not live_read else live * (args.paged_read_over_live if paged else 1.0)
  cl = M.ClusterLayout(trainer, n_gen, gen_chips, tensor, slots, read,
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
    config = load_recipe(spec, ROOT)
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


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--clusters", default="64xH100,128xH100,256xH100,v5p-128,v5p-256")
  p.add_argument("--medium_models", default=f"mistral_small_3_24b;{MEDIUM_125B}",
                 help="';'-separated plan.py model specs")
  p.add_argument("--math_verify_s", type=float, default=1 / 195.2,
                 help="a math verification's CPU s (BENCHMARKS.md, MATH-500: 195.2/s)")
  p.add_argument("--message_s", type=float, default=0.002,
                 help="a message's latency (bench/scale_model.py's rates.message_s)")
  p.add_argument("--keep", type=float, default=0.5, help="assumed share of groups kept")
  p.add_argument("--prompt_tokens", type=float, default=512.0, help="assumed mean prompt")
  p.add_argument("--length_frac", type=float, default=0.5,
                 help="assumed mean response / (l_max - l_cache)")
  p.add_argument("--code_share", type=float, default=0.5, help="assumed share of code tasks")
  p.add_argument("--padding", type=float, default=0.06, help="collation's padding share")
  p.add_argument("--paged_read_over_live", type=float, default=1.05,
                 help="KV positions a paged decode step reads over the live ones "
                      "(bench/paged_decode.py's kv_read_over_live)")
  args = p.parse_args(argv)
  # The math share at MATH-500's verification rate, the code share at CODE_VERIFY_S.
  verify_core_s = (1 - args.code_share) * args.math_verify_s + args.code_share * CODE_VERIFY_S
  rows = projections(args, verify_core_s, args.message_s)
  show(rows)
  print(json.dumps({"projections": [rounded(r) for r in rows], "assumptions": dict(
      {k: getattr(args, k) for k in ("keep", "prompt_tokens", "length_frac", "code_share",
                                     "padding", "math_verify_s", "message_s",
                                     "paged_read_over_live")},
      verify_core_s=verify_core_s,
      accelerators={k: dataclasses.asdict(v) for k, v in ACCELERATORS.items()})}), flush=True)


if __name__ == "__main__":
  main()
