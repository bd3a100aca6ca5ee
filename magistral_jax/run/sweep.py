"""Grid sweeps over config fields, one launcher run per point (docs/sweeps.md): what
launch/sweep.py runs.

The cartesian product of the axes (';' separates axes, ',' values) becomes one command line per
point, `--config.X=V` for each axis, with its own workdir under the root named after the point
(eps_high_0.2-adv_norm_group). Points run one after another (each run uses the whole machine's
devices); a point whose summary.json already has its final evaluation is skipped, and an
interrupted point resumes from its checkpoint like any train.py run. At the end,
WORKDIR_ROOT/sweep.json collects every point's overrides, exit status and summary.json.

Axis names are checked against the config before anything runs. No jax import: the points run
as their own processes.
"""
from __future__ import annotations

import itertools
import json
import os
import shlex
import subprocess
import sys

from magistral_jax.run.recipes import load_recipe


def parse_sweep(spec: str) -> list[tuple[str, list[str]]]:
  """'rl.eps_high=0.2,0.28;rl.adv_norm=minibatch,group' -> [(key, [values]), ...]."""
  axes = []
  for part in (p.strip() for p in spec.split(";")):
    if not part:
      continue
    key, eq, values = part.partition("=")
    key = key.strip()
    vals = [v.strip() for v in values.split(",") if v.strip()]
    if not eq or not key or not vals:
      raise ValueError(f"--sweep axis {part!r}: expected 'dotted.key=v1,v2,...'")
    if any(key == k for k, _ in axes):
      raise ValueError(f"--sweep names {key!r} twice")
    axes.append((key, vals))
  if not axes:
    raise ValueError("--sweep is empty: give at least one axis 'dotted.key=v1,v2'")
  return axes


def check_axes(config, axes):
  """Every key names an existing field and every value parses as that field's type."""
  for key, vals in axes:
    node = config
    parts = key.split(".")
    for i, part in enumerate(parts):
      try:
        node = node[part]
      except (KeyError, TypeError, AttributeError):
        raise ValueError(f"--sweep axis {key!r}: config has no field {'.'.join(parts[:i + 1])!r}")
    if isinstance(node, bool):
      bad = [v for v in vals if v.lower() not in ("true", "false")]
    elif isinstance(node, (int, float)):
      bad = []
      for v in vals:
        try:
          type(node)(v)
        except ValueError:
          bad.append(v)
    else:   # strings, and None-valued optional fields: the launcher's flag parser decides
      bad = []
    if bad:
      raise ValueError(f"--sweep axis {key!r} is {type(node).__name__}; cannot parse {bad}")


def point_name(point: dict) -> str:
  leaves = [k.rsplit(".", 1)[-1] for k in point]
  keys = leaves if len(set(leaves)) == len(leaves) else list(point)
  name = "-".join(f"{k}_{v}" for k, v in zip(keys, point.values()))
  return "".join(c if c.isalnum() or c in "._-" else "_" for c in name)


def expand(config_spec: str, axes, workdir_root: str, script: str = "launch/train.py",
           extra: str = "") -> list[dict]:
  """One {name, overrides, workdir, argv} per point of the grid, in a fixed order."""
  points = []
  for values in itertools.product(*[v for _, v in axes]):
    point = dict(zip([k for k, _ in axes], values))
    name = point_name(point)
    workdir = os.path.join(workdir_root, name)
    argv = [sys.executable, script, f"--config={config_spec}", f"--workdir={workdir}",
            *[f"--config.{k}={v}" for k, v in point.items()], *shlex.split(extra)]
    points.append({"name": name, "overrides": point, "workdir": workdir, "argv": argv})
  if len({p["name"] for p in points}) != len(points):
    raise ValueError("two sweep points map to the same workdir name; use distinct values")
  return points


def read_summary(workdir: str) -> dict | None:
  """train.py's summary.json, or sft.py's sft_summary.json; None before the run wrote one."""
  for name in ("summary.json", "sft_summary.json"):
    path = os.path.join(workdir, name)
    if os.path.exists(path):
      with open(path) as f:
        return json.load(f)
  return None


def _done(workdir: str) -> bool:
  summary = read_summary(workdir)
  # train.py writes summary.json after its first evaluation; the final one marks the end.
  return summary is not None and ("heldout_accuracy_after" in summary or "sft_steps" in summary)


def run_sweep(config_spec: str, spec: str, workdir_root: str, repo: str,
              script: str = "launch/train.py", extra: str = "", dry_run: bool = False,
              skip_done: bool = True) -> int:
  """Checks the axes of `spec` against the recipe, then runs (or with dry_run prints) every
  point, each from the directory `repo` (where the recipe's and the script's relative paths
  start); returns how many failed."""
  axes = parse_sweep(spec)
  check_axes(load_recipe(config_spec, repo), axes)
  root = os.path.abspath(workdir_root)   # absolute: the points run from `repo`
  points = expand(config_spec, axes, root, script, extra)
  print(f"sweep: {len(points)} point(s) under {root}", flush=True)
  if dry_run:
    for p in points:
      print(shlex.join(p["argv"]), flush=True)
    return 0
  os.makedirs(root, exist_ok=True)
  results, failed = [], 0
  for i, p in enumerate(points):
    if skip_done and _done(p["workdir"]):
      print(f"[{i + 1}/{len(points)}] {p['name']}: already finished, skipped", flush=True)
      rc = 0
    else:
      print(f"[{i + 1}/{len(points)}] {p['name']}: {shlex.join(p['argv'])}", flush=True)
      rc = subprocess.run(p["argv"], cwd=repo).returncode
      failed += rc != 0
    summary = read_summary(p["workdir"])
    results.append({"name": p["name"], "overrides": p["overrides"], "workdir": p["workdir"],
                    "returncode": rc, "summary": summary})
    with open(os.path.join(root, "sweep.json"), "w") as f:
      json.dump(results, f, indent=1)
  print(f"sweep done: {len(points) - failed} ok, {failed} failed; "
        f"{os.path.join(root, 'sweep.json')}", flush=True)
  return failed
