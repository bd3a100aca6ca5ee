"""A recipe (configs/*.py) loaded from its path, as `--config=PATH[:ARG]` loads it: for code that
is handed a recipe's path rather than a parsed --config flag (launch/sweep.py checks its axes
against the recipe before any run; benches load configs/tiny.py)."""
from __future__ import annotations

import os

import ml_collections as mlc
from absl import flags
from ml_collections import config_flags


def load_recipe(spec: str, root: str | None = None) -> mlc.ConfigDict:
  """The ConfigDict of `spec`, "path/to/recipe.py[:arg]" (get_config(arg)), unlocked. A relative
  path is taken from `root` (default: the current directory)."""
  path, sep, arg = spec.partition(":")
  full = path if os.path.isabs(path) or root is None else os.path.join(root, path)
  if not os.path.exists(full):
    raise FileNotFoundError(f"--config {path!r}: no such file")
  # A --config flag of its own (not the process's flags): the loading that --config does.
  fv = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, flag_values=fv, lock_config=False)
  fv(["load_recipe", f"--config={full}{sep}{arg}"])
  return fv.config
