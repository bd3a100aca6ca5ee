"""Reading a training run's workdir: its config, every checkpoint's weights, its metrics.

A run written by `launch/train.py --workdir=DIR` holds
    DIR/config.json          the full run config (ml_collections JSON)
    DIR/checkpoints/<step>/  orbax composite items 'state' (TrainState) and 'meta' (JSON)
    DIR/metrics.jsonl        one JSON object per logged step (train/metrics_writer.py)

Only the parameters are read from a checkpoint (an orbax partial restore straight into host
numpy): the optimizer moments, twice the size of the weights, are never loaded, and no model
config or device mesh is needed to read them.
"""
from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

CHECKPOINTS = "checkpoints"
CONFIG_JSON = "config.json"
METRICS_JSONL = "metrics.jsonl"


class RunError(ValueError):
  """A workdir that is missing something or holds something unreadable (names the path)."""


def _require_dir(workdir: str) -> str:
  workdir = os.path.abspath(os.fspath(workdir))
  if not os.path.isdir(workdir):
    raise RunError(f"no run at {workdir}: the directory does not exist (train one with "
                   f"`python launch/train.py --config=configs/tiny.py --workdir={workdir} "
                   "--config.checkpoint.every=1 --config.checkpoint.keep=50`)")
  return workdir


def read_config(workdir: str):
  """The run's ml_collections ConfigDict, as launch/train.py wrote it."""
  import ml_collections as mlc
  path = os.path.join(_require_dir(workdir), CONFIG_JSON)
  try:
    with open(path) as f:
      return mlc.ConfigDict(json.load(f))
  except FileNotFoundError:
    raise RunError(f"{path} is missing: not a launch/train.py workdir?") from None
  except json.JSONDecodeError as e:
    raise RunError(f"{path} is not valid JSON: {e}") from None


def checkpoint_steps(workdir: str) -> list[int]:
  """Sorted steps of the committed checkpoints (orbax's temporary, uncommitted directories and
  anything else in the folder are ignored)."""
  ck = os.path.join(_require_dir(workdir), CHECKPOINTS)
  if not os.path.isdir(ck):
    raise RunError(f"{ck} is missing: the run has no checkpoints")
  steps = []
  for name in os.listdir(ck):
    d = os.path.join(ck, name)
    if name.isdigit() and os.path.isdir(os.path.join(d, "state")):
      steps.append(int(name))
  return sorted(steps)


def _state_dir(workdir: str, step: int) -> str:
  d = os.path.join(_require_dir(workdir), CHECKPOINTS, str(int(step)), "state")
  if not os.path.isdir(d):
    raise RunError(f"checkpoint step {step} not found in {os.path.dirname(os.path.dirname(d))} "
                   f"(steps: {checkpoint_steps(workdir)})")
  return d


def load_params(workdir: str, step: int) -> Any:
  """The parameter tree of one checkpoint, as host numpy arrays in their stored dtype."""
  import jax
  import orbax.checkpoint as ocp
  from etils import epath
  path = _state_dir(workdir, step)
  # The item-level handler, not a Checkpointer: the latter looks for step-level metadata inside
  # the item directory and logs a warning per checkpoint when (rightly) it is not there.
  handler = ocp.PyTreeCheckpointHandler()
  try:
    try:
      meta = handler.metadata(epath.Path(path))
    except Exception as e:  # orbax raises several types for a torn or foreign directory
      raise RunError(f"cannot read the checkpoint metadata of {path}: "
                     f"{type(e).__name__}: {e}") from e
    tree = getattr(meta, "tree", meta)
    if not isinstance(tree, dict) or "params" not in tree:
      found = sorted(tree) if isinstance(tree, dict) else type(tree).__name__
      raise RunError(f"{path} holds no 'params' (found {found}); expected a TrainState "
                     "written by train/checkpointing.py")
    item = {"params": jax.tree.map(lambda _: 0, tree["params"])}
    restore_args = {"params": jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray),
                                           tree["params"])}
    try:
      out = handler.restore(epath.Path(path), args=ocp.args.PyTreeRestore(
          item=item, restore_args=restore_args, partial_restore=True))
    except Exception as e:
      raise RunError(f"cannot restore the params of {path}: {type(e).__name__}: {e}") from e
  finally:
    handler.close()
  return out["params"]


def load_meta(workdir: str, step: int) -> dict:
  """The checkpoint's JSON metadata (stage, batches, policy version, data position)."""
  path = os.path.join(os.path.dirname(_state_dir(workdir, step)), "meta", "metadata")
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise RunError(f"cannot read checkpoint metadata {path}: {e}") from None


def load_all_params(workdir: str, steps: list[int] | None = None) -> tuple[list[int], list[Any]]:
  """(steps, param trees) of every checkpoint of the run (or of `steps`), oldest first."""
  steps = checkpoint_steps(workdir) if steps is None else sorted(int(s) for s in steps)
  if not steps:
    raise RunError(f"no checkpoints in {os.path.join(os.path.abspath(workdir), CHECKPOINTS)}")
  return steps, [load_params(workdir, s) for s in steps]


def read_metrics(workdir: str) -> list[dict]:
  """Every row of metrics.jsonl, in file order. A torn last line (a run killed mid-write) is
  skipped; a bad line elsewhere is an error naming its line number."""
  path = os.path.join(_require_dir(workdir), METRICS_JSONL)
  if not os.path.exists(path):
    raise RunError(f"{path} is missing: the run logged no metrics")
  rows = []
  with open(path) as f:
    lines = f.read().split("\n")
  for i, line in enumerate(lines):
    if not line.strip():
      continue
    try:
      row = json.loads(line)
    except json.JSONDecodeError as e:
      if i == len(lines) - 1:   # no trailing newline: the writer was interrupted
        break
      raise RunError(f"{path}:{i + 1}: not a JSON object ({e})") from None
    if not isinstance(row, dict) or "step" not in row:
      raise RunError(f"{path}:{i + 1}: expected an object with a 'step', got {line[:80]!r}")
    rows.append(row)
  return rows


def split_metrics(rows: list[dict]) -> tuple[list[dict], list[dict]]:
  """(cold-start SFT rows, RL rows): SFT rows carry only 'sft/...' keys, and their step counter
  is the SFT step, not the RL optimizer step, so the two are plotted apart."""
  sft, rl = [], []
  for r in rows:
    keys = [k for k in r if k not in ("step", "time")]
    (sft if keys and all(k.startswith("sft/") for k in keys) else rl).append(r)
  return sft, rl


def model_and_tokenizer(config):
  """(ModelConfig, tokenizer) of the run's policy, as launch/train.py builds them, reading only
  metadata (no initial weights)."""
  from magistral_jax import config as config_lib
  from magistral_jax.model.loading import load_policy
  try:
    run = config_lib.validate(config)
    tok, model_cfg, _ = load_policy(run.model, run.init, run.tokenizer, load_weights=False)
  except ValueError as e:
    raise RunError(str(e)) from e
  return model_cfg, tok

