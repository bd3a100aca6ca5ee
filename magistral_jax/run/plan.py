"""Will a recipe fit? The bytes per device of a run's trainer and generators, before launching.

`plan(run, model_cfg, devices)` adds up, for a model shape and a validated run config
(magistral_jax/config.py validate) laid out on named devices ('v5p-128', '8xH100', ...), what
one device of each role holds at its peak (run/footprint.py: the trainer's weights, optimizer
state, gradients, batch and activations; the generator's weights, pushed copy and decode
state), and whether it fits the device's usable memory. Colocated: one device holds both roles'
bytes. `relayout` tries the same run on another layout of the devices; `plan_stages` plans
every stage of a recipe, `largest` picks the fullest.
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

from magistral_jax import config as config_lib
from magistral_jax.config import RunConfig
from magistral_jax.model import config as model_config_lib
from magistral_jax.model.config import ModelConfig
from magistral_jax.model.loading import RUN_MODEL_FIELDS
from magistral_jax.run.footprint import generator_bytes, mesh_sizes, trainer_bytes
from magistral_jax.run.stages import stages as stage_list

GIB = 2**30
# Usable memory per device, GiB: what a JAX process can allocate, a little under the card's
# nominal capacity (the runtime and its libraries keep some). --device_memory_gb overrides.
DEVICE_MEMORY_GIB = {"H100": 78.0, "H200": 139.0, "v5p": 95.0, "v5e": 16.0, "cpu": 64.0}
PLATFORMS = {"H100": "cuda", "H200": "cuda", "v5p": "tpu", "v5e": "tpu", "cpu": "cpu"}
LAYOUTS = ("recipe", "colocated", "split")


# ---- devices --------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Devices:
  """What the run is planned on: `count` devices (None: as many as the layout asks for) of
  `kind`, each with `memory_bytes` usable."""
  kind: str
  count: int | None
  memory_bytes: int

  @property
  def platform(self) -> str:
    return PLATFORMS[self.kind]


def parse_devices(spec: str, memory_gib: float | None = None) -> Devices:
  """'v5p-128' (TPU names count TensorCores: 2 per v5p chip, 1 per v5e chip), 'v5e-16',
  '8xH100', '16xH200', 'H100' (as many as the layout asks for), 'cpu'."""
  s = spec.strip()
  m = re.fullmatch(r"(?:(\d+)\s*[x*]\s*)?(H100|H200|cpu)", s, re.IGNORECASE)
  if m:
    kind = {"h100": "H100", "h200": "H200", "cpu": "cpu"}[m.group(2).lower()]
    count = int(m.group(1)) if m.group(1) else None
  else:
    m = re.fullmatch(r"(v5p|v5e|v5litepod)(?:-(\d+))?", s, re.IGNORECASE)
    if not m:
      raise ValueError(f"--devices={spec!r}: expected e.g. v5p-128, v5e-16, 8xH100, 16xH200, "
                       "H100 or cpu")
    kind = "v5p" if m.group(1).lower() == "v5p" else "v5e"
    cores = int(m.group(2)) if m.group(2) else None
    count = None if cores is None else cores // 2 if kind == "v5p" else cores
  gib = DEVICE_MEMORY_GIB[kind] if memory_gib is None else float(memory_gib)
  return Devices(kind, count, int(gib * GIB))


# ---- model shapes -----------------------------------------------------------------------------

def named_shapes() -> dict[str, ModelConfig]:
  """The public shapes model/config.py defines (SMOLLM2_135M, ...), by lower-case name."""
  return {name.lower(): v for name, v in vars(model_config_lib).items()
          if isinstance(v, ModelConfig) and name.isupper()}


def model_from_spec(spec: str, run_model: ModelConfig) -> ModelConfig:
  """The policy's shape from `spec` with the run's dtypes, remat and head / attention knobs (as
  model/loading.py keeps them over a checkpoint's architecture). `spec`: a named shape
  (named_shapes), a checkpoint's config.json (or its folder), 'run' (the config's own model
  section), or comma-separated ModelConfig fields over the run's model section
  ('hidden_size=12288,num_layers=88,...')."""
  keep = {f: getattr(run_model, f) for f in RUN_MODEL_FIELDS}
  if spec in ("", "run"):
    return run_model
  shapes = named_shapes()
  if spec.lower() in shapes:
    return shapes[spec.lower()].replace(**keep)
  if spec.endswith(".json") or "=" not in spec:
    return ModelConfig.from_hf_config(spec, **keep)
  fields = {f.name: f.type for f in dataclasses.fields(ModelConfig)}
  kw = {}
  for item in spec.split(","):
    key, _, value = item.partition("=")
    key = key.strip()
    if key not in fields:
      raise ValueError(f"--model: unknown ModelConfig field {key!r}")
    current = getattr(run_model, key)
    kw[key] = (value.strip().lower() in ("1", "true", "yes") if isinstance(current, bool)
               else type(current)(value) if isinstance(current, (int, float)) and current
               is not None else int(value) if value.strip().isdigit() else value.strip())
  return run_model.replace(**kw)


# ---- the plan ---------------------------------------------------------------------------------

def relayout(run: RunConfig, num_devices: int, layout: str) -> RunConfig:
  """`run` on `num_devices` devices. 'recipe': unchanged. 'colocated': the trainer on all of
  them (FSDP) and one generator sharing them (tensor parallel as the recipe's generator mesh,
  capped at the slice, data parallel over the rest). 'split': the first half trains, the second
  half holds one generator. Both keep the recipe's row length and rows per data-parallel
  trainer device (microbatch_rows scales with the trainer's devices)."""
  if layout == "recipe":
    return run
  if layout not in LAYOUTS:
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
  d = run.devices
  old_dp = mesh_sizes(d.trainer_mesh, d.trainer)
  old_dp = math.prod(old_dp[a] for a in ("data", "fsdp"))
  trainer = num_devices if layout == "colocated" else num_devices // 2
  gen = num_devices if layout == "colocated" else num_devices - trainer
  if trainer < 1 or gen < 1:
    raise ValueError(f"layout {layout!r} needs at least 2 devices, got {num_devices}")
  tp = min(int(d.generator_mesh.get("tensor", 1)) if d.generator_mesh.get("tensor", 1) != -1
           else gen, gen)
  while gen % tp:
    tp -= 1
  devices = dataclasses.replace(d, trainer=trainer, generators=() if layout == "colocated"
                                else (gen,), colocated=layout == "colocated",
                                trainer_mesh={"fsdp": -1},
                                generator_mesh={"tensor": tp, "data": -1})
  per_device = max(1, run.rl.microbatch_rows // old_dp)
  rows = per_device * trainer
  rl = run.rl.replace(microbatch_rows=rows, microbatch_tokens=rows * run.rl.row_len)
  return dataclasses.replace(run, devices=devices, rl=rl)


def plan(run: RunConfig, model_cfg: ModelConfig, devices: Devices | str,
         layout: str = "recipe") -> dict[str, Any]:
  """The bytes per device of the run's trainer and generators on `devices` (a Devices or its
  spec, e.g. '8xH100'), and whether each fits. `layout`: see relayout (needs devices.count)."""
  if isinstance(devices, str):
    devices = parse_devices(devices)
  if layout != "recipe":
    if devices.count is None:
      raise ValueError(f"layout {layout!r} needs a device count (e.g. 8xH100)")
    run = relayout(run, devices.count, layout)
  d = run.devices
  needed = d.trainer if d.colocated else d.trainer + sum(d.generators)
  tr = trainer_bytes(run, model_cfg, devices.platform)
  no_remat = (tr if model_cfg.remat == "none" else
              trainer_bytes(run, model_cfg, devices.platform, remat="none"))
  gens = [] if d.colocated else sorted(set(d.generators))
  gen = {g: generator_bytes(run, model_cfg, devices.platform, g) for g in gens}
  if d.colocated:
    gen[d.trainer] = generator_bytes(run, model_cfg, devices.platform, d.trainer)
  cap = devices.memory_bytes
  roles = {}
  if d.colocated:
    g = gen[d.trainer]
    roles["trainer+generator"] = {"devices": d.trainer, "total": tr["total"] + g["total"]}
  else:
    roles["trainer"] = {"devices": d.trainer, "total": tr["total"]}
    for n, g in gen.items():
      roles[f"generator ({n} devices)"] = {"devices": n, "total": g["total"]}
  for r in roles.values():
    r["fits"] = r["total"] <= cap
  enough = devices.count is None or needed <= devices.count
  return {"devices": devices, "layout": layout, "devices_needed": needed,
          "enough_devices": enough, "colocated": d.colocated, "trainer": tr,
          "trainer_without_remat": no_remat, "generators": gen, "roles": roles,
          "fits": enough and all(r["fits"] for r in roles.values()),
          "model": {"params": model_cfg.num_params(), "layers": model_cfg.num_layers,
                    "hidden": model_cfg.hidden_size, "param_dtype": model_cfg.param_dtype,
                    "dtype": model_cfg.dtype, "remat": model_cfg.remat},
          "run": run}


def plan_stages(config, model_spec: str, devices: Devices | str, layout: str = "recipe"
                ) -> list[tuple[str, dict]]:
  """plan() of every stage of a ConfigDict (its overrides applied and validated), as
  [(stage name, plan)]; a config without stages is one stage named 'rl'."""
  run = config_lib.validate(config)
  model_cfg = model_from_spec(model_spec, run.model)
  return [(s.name, plan(s.run, model_cfg, devices, layout)) for s in stage_list(config, run)]


def largest(stage_plans: list[tuple[str, dict]]) -> tuple[str, dict]:
  """The stage whose devices hold the most (the fullest device, then all roles together)."""
  def key(sp):
    totals = [r["total"] for r in sp[1]["roles"].values()]
    return max(totals), sum(totals)
  return max(stage_plans, key=key)


def _gib(b: int) -> str:
  return f"{b / GIB:8.2f}"


def format_plan(p: dict, stage: str = "") -> str:
  """The plan as a text table (GiB per device)."""
  dev, tr, run = p["devices"], p["trainer"], p["run"]
  m = p["model"]
  lines = [f"model: {m['params'] / 1e9:.2f}B params, {m['layers']} layers, hidden "
           f"{m['hidden']}, param_dtype {m['param_dtype']}, dtype {m['dtype']}, remat "
           f"{m['remat']}" + (f" | stage {stage}" if stage else ""),
           f"devices: {dev.count or 'as needed'} x {dev.kind} ({dev.memory_bytes / GIB:.1f} "
           f"GiB usable each) | layout {p['layout']}: "
           + (f"colocated on {run.devices.trainer}" if p["colocated"] else
              f"trainer {run.devices.trainer} + generators {list(run.devices.generators)}")
           + f" = {p['devices_needed']} devices",
           f"trainer mesh {tr['mesh']}: {tr['rows_per_device']} row(s) x {tr['row_len']} "
           f"tokens per device per microbatch, attention {tr['attention']}",
           "", f"{'GiB per device':<34}{'':>8}"]
  for k, v in tr["parts"].items():
    lines.append(f"  trainer {k:<25}{_gib(v)}")
  lines.append(f"  trainer total (remat={tr['remat']}){'':<6}{_gib(tr['total'])}")
  if tr["remat"] != "none":
    nr = p["trainer_without_remat"]
    lines.append(f"  trainer total (remat=none){'':<8}{_gib(nr['total'])}   (activations "
                 f"{nr['parts']['activations'] / GIB:.2f})")
  for n, g in p["generators"].items():
    lines.append(f"  generator on {n} devices, mesh {g['mesh']}: {g['slots']} slots x "
                 f"{g['cache_length']} positions")
    for k, v in g["parts"].items():
      lines.append(f"    generator {k:<23}{_gib(v)}")
    lines.append(f"    generator total{'':<17}{_gib(g['total'])}")
  lines.append("")
  for role, r in p["roles"].items():
    lines.append(f"{role:<34}{_gib(r['total'])} GiB  {'fits' if r['fits'] else 'DOES NOT FIT'}"
                 f" ({dev.memory_bytes / GIB:.1f} GiB)")
  if not p["enough_devices"]:
    lines.append(f"the layout needs {p['devices_needed']} devices; {dev.count} given")
  lines.append(f"verdict: {'fits' if p['fits'] else 'does not fit'}")
  return "\n".join(lines)


def summary_row(p: dict) -> dict[str, float]:
  """GiB per device of each role, for tables."""
  return {role: round(r["total"] / GIB, 1) for role, r in p["roles"].items()}


__all__ = ["Devices", "parse_devices", "model_from_spec", "plan", "plan_stages", "largest",
           "format_plan", "relayout", "summary_row"]
