"""Recipes (configs/*.py): the one parser of their `:ARG` (recipe_args), and a recipe loaded from
its path, as `--config=PATH[:ARG]` loads it, for code that is handed a recipe's path rather than
a parsed --config flag (launch/sweep.py checks its axes against the recipe before any run;
benches load configs/tiny.py)."""
from __future__ import annotations

import importlib.util
import os

import ml_collections as mlc
from absl import flags
from ml_collections import config_flags


def recipe_args(arg: str | None, recipe: str, switches=(), values=()) -> dict:
  """A recipe's argument, `a,b,key=value`, as {"a": True, "b": True, "key": "value"} in the
  order given: each item a switch (no `=`) or a key with a value; anything else stops with the
  recipe's name and what it takes."""
  out = {}
  for item in (arg or "").split(","):
    item = item.strip()
    if not item:
      continue
    key, eq, value = item.partition("=")
    key, value = key.strip(), value.strip()
    if key in switches and not eq:
      out[key] = True
    elif key in values and eq and value:
      out[key] = value
    else:
      takes = ", ".join(list(switches) + [f"{v}=..." for v in values])
      raise ValueError(f"{recipe}: bad config argument {item!r}; it takes {takes}")
  return out


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


def recipe_module(path: str):
  """The recipe module at `path`, for a recipe built on another (configs/smollm2_learn.py on
  configs/smollm2.py): recipes are loaded by path, not imported as a package."""
  if not os.path.exists(path):
    raise FileNotFoundError(f"recipe {path!r}: no such file")
  spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module
