"""A run's problems: the held-out evaluation set and the RL prompt stream, both resumable.

data.source is "synthetic" (the tiny arithmetic task, an endless seeded stream) or
comma-separated dataset names; shipped public sets (records.SHIPPED, with the short names of
SHIPPED_ALIASES) are built into data.data_dir (default WORKDIR/data) on first use. The held-out
problems are the first data.heldout of one seeded shuffled epoch; the RL stream is every epoch
after that, minus them.
"""
from __future__ import annotations

import os

from magistral_jax.data import records, synthetic
from magistral_jax.data.loader import ProblemLoader

# Short names for the public sets shipped in magistral_jax/data/sources (records.SHIPPED).
SHIPPED_ALIASES = {"gsm8k": "gsm8k_test", "mbpp": "mbpp_sample20"}


def data_dir_for(config, workdir: str | None = None) -> str:
  """data.data_dir, or WORKDIR/data when it is unset."""
  if config.data.data_dir:
    return config.data.data_dir
  if workdir is None:
    raise ValueError(f"data.source={config.data.source!r}: set data.data_dir (or give a workdir)")
  return os.path.join(workdir, "data")


def problem_loader(config, num_epochs: int | None, workdir: str | None = None,
                   **loader_kw) -> ProblemLoader:
  """A seeded ProblemLoader over data.source; shipped sets are built on first use. `loader_kw`
  go to ProblemLoader (e.g. code_languages)."""
  from magistral_jax.data.tfds_builders import build_shipped
  names = [SHIPPED_ALIASES.get(n, n) for n in config.data.source.split(",") if n]
  data_dir = data_dir_for(config, workdir)
  shipped = [n for n in names if n in records.SHIPPED]
  if shipped:
    build_shipped(data_dir, shipped)
  return ProblemLoader(data_dir, names, seed=config.seed, shuffle=True, num_epochs=num_epochs,
                       **loader_kw)


def heldout_problems(config, workdir: str | None = None, **loader_kw) -> list[dict]:
  """The held-out evaluation problems (data.heldout of them)."""
  n = config.data.heldout
  if config.data.source == "synthetic":
    return synthetic.take(n, config.seed, "heldout", **synthetic.options(config.data))
  return problem_loader(config, 1, workdir, **loader_kw).take(n)


class SyntheticPrompts:
  """The synthetic-arithmetic prompt stream with a resumable position."""

  def __init__(self, seed: int, data_cfg, consumed: int = 0):
    self._it = synthetic.problems(seed, "train", **synthetic.options(data_cfg))
    self.consumed = 0
    for _ in range(consumed):
      next(self)

  def __iter__(self):
    return self

  def __next__(self):
    self.consumed += 1
    return next(self._it)

  def state(self) -> dict:
    return {"consumed": self.consumed}


class TrainProblems:
  """RL prompts from problem datasets: seeded shuffled epochs without end, minus the held-out
  problems; `state()` is the loader's position (saved in the checkpoint meta)."""

  def __init__(self, config, heldout_ids, state=None, workdir: str | None = None):
    self.loader = problem_loader(config, None, workdir)
    if state:
      self.loader.restore(state)
    self.heldout = set(heldout_ids)

  def __iter__(self):
    return self

  def __next__(self):
    # An epoch is a permutation, so a run of held-out ids is at most two epochs' worth.
    for _ in range(2 * len(self.heldout) + 1):
      p = next(self.loader)
      if p["id"] not in self.heldout:
        return p
    raise ValueError(f"every problem of data.source={list(self.loader._fingerprint['datasets'])} "
                     f"is held out (data.heldout={len(self.heldout)}); lower data.heldout")

  def state(self) -> dict:
    return self.loader.state()


def train_prompts(config, heldout_ids, state: dict | None, workdir: str | None = None):
  """The RL prompt stream of data.source, resumed from a checkpoint's `state()` if given."""
  state = state or {}
  if config.data.source == "synthetic":
    return SyntheticPrompts(config.seed, config.data, state.get("consumed", 0))
  return TrainProblems(config, heldout_ids, state if "iterator" in state else None, workdir)
