r"""Grid sweeps over config fields, one launch/train.py run per point (docs/sweeps.md).

  python launch/sweep.py --config=configs/tiny.py \
      --sweep='rl.eps_high=0.2,0.28;rl.adv_norm=minibatch,group' \
      --workdir_root=runs/sweep [--dry_run] [--extra='--config.num_batches=5']

The cartesian product of the axes (';' separates axes, ',' values) becomes one command line per
point, `--config.X=V` for each axis, with its own workdir under --workdir_root named after the
point (eps_high_0.2-adv_norm_group). Points run one after another (each run uses the whole
machine's devices); a point whose summary.json already has its final evaluation is skipped, and an
interrupted point resumes from its checkpoint like any train.py run. At the end,
WORKDIR_ROOT/sweep.json collects every point's overrides, exit status and summary.json.

Axis names are checked against the config before anything runs. No jax import: it is a launcher.
"""
from __future__ import annotations

import importlib.util
import itertools
import json
import os
import shlex
import subprocess
import sys

from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def define_flags():
  """Flags are defined only when run as a script, so tests can import the helpers next to
  launch/train.py (whose --config flag has the same name)."""
  g = globals()
  g["_CONFIG"] = flags.DEFINE_string("config", "configs/tiny.py",
                                     "Config file (with an optional :arg).")
  g["_SWEEP"] = flags.DEFINE_string("sweep", "",
                                    "Axes: 'a.b=v1,v2;c.d=v3,v4' (cartesian product).")
  g["_ROOT"] = flags.DEFINE_string("workdir_root", "runs/sweep", "One workdir per point here.")
  g["_SCRIPT"] = flags.DEFINE_string("script", "launch/train.py", "The launcher each point runs.")
  g["_EXTRA"] = flags.DEFINE_string("extra", "",
                                    "More flags for every point (shell-quoted string).")
  g["_DRY_RUN"] = flags.DEFINE_bool("dry_run", False, "Print the command lines, run nothing.")
  g["_SKIP_DONE"] = flags.DEFINE_bool("skip_done", True, "Skip points whose run finished.")


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


def load_config(spec: str):
  path, _, arg = spec.partition(":")
  full = path if os.path.isabs(path) else os.path.join(ROOT, path)
  if not os.path.exists(full):
    raise FileNotFoundError(f"--config {path!r}: no such file")
  mod_spec = importlib.util.spec_from_file_location("sweep_config", full)
  mod = importlib.util.module_from_spec(mod_spec)
  mod_spec.loader.exec_module(mod)
  return mod.get_config(arg or None)


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


def main(argv):
  del argv
  axes = parse_sweep(_SWEEP.value)
  check_axes(load_config(_CONFIG.value), axes)
  root = os.path.abspath(_ROOT.value)   # the points run with the repository root as cwd
  points = expand(_CONFIG.value, axes, root, _SCRIPT.value, _EXTRA.value)
  print(f"sweep: {len(points)} point(s) under {root}", flush=True)
  if _DRY_RUN.value:
    for p in points:
      print(shlex.join(p["argv"]), flush=True)
    return
  os.makedirs(root, exist_ok=True)
  results, failed = [], 0
  for i, p in enumerate(points):
    if _SKIP_DONE.value and _done(p["workdir"]):
      print(f"[{i + 1}/{len(points)}] {p['name']}: already finished, skipped", flush=True)
      rc = 0
    else:
      print(f"[{i + 1}/{len(points)}] {p['name']}: {shlex.join(p['argv'])}", flush=True)
      rc = subprocess.run(p["argv"], cwd=ROOT).returncode
      failed += rc != 0
    summary = read_summary(p["workdir"])
    results.append({"name": p["name"], "overrides": p["overrides"], "workdir": p["workdir"],
                    "returncode": rc, "summary": summary})
    with open(os.path.join(root, "sweep.json"), "w") as f:
      json.dump(results, f, indent=1)
  print(f"sweep done: {len(points) - failed} ok, {failed} failed; "
        f"{os.path.join(root, 'sweep.json')}", flush=True)
  if failed:
    sys.exit(1)


if __name__ == "__main__":
  define_flags()
  app.run(main)
