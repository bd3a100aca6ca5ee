"""A run's problems: the held-out evaluation set and the RL prompt stream, both resumable.

data.source is "synthetic" (the tiny arithmetic task, an endless seeded stream) or
comma-separated dataset names; shipped public sets (records.SHIPPED, with the short names of
SHIPPED_ALIASES) are built into data.data_dir (default WORKDIR/data) on first use. The RL stream
is seeded shuffled epochs of data.source without end. The held-out problems are the first
data.heldout of one seeded shuffled epoch of data.heldout_source (e.g. GSM8K's test split for a
run that trains on its train split), or of data.source itself when that is empty: then the
stream skips them.

No evaluation may include a problem the run trained on (splits.py: by id and by normalised
question text): the stream skips every problem that matches a held-out one, the synthetic task
keeps a bucket of its problem space for evaluation only (synthetic.py), and
`check_heldout_unseen` raises, naming them, when a held-out set shares problems with what
data.source trains on, before any work (launch/train.py, launch/eval.py). What the run did train
on is recorded besides (trained_on.TrainedOn), and every evaluation counts against it.
"""
from __future__ import annotations

import os
from typing import Iterable, Mapping

from magistral_jax.data import records, synthetic
from magistral_jax.data.loader import ProblemLoader
from magistral_jax.data.splits import HeldOutOverlapError, KeySet, check_disjoint, problem_key
from magistral_jax.data.synthetic import TINY_SYSTEM_PROMPT, TINY_SYSTEM_PROMPT_TOOLS
from magistral_jax.model.tokenizer import MAGISTRAL_SYSTEM_PROMPT
from magistral_jax.tool_use.protocol import SYSTEM_PROMPT_TOOLS

# Short names for the public sets shipped in magistral_jax/data/sources (records.SHIPPED).
SHIPPED_ALIASES = {"gsm8k": "gsm8k_test", "mbpp": "mbpp_sample20"}


def system_prompt_for(name: str, tools: bool = False) -> str | None:
  """The run config's `system_prompt` name -> its text: "magistral" (paper §2), "tiny" (the
  one-line prompt of the synthetic task) or "none"; with `tools` (tools.enabled), followed by
  what the policy needs to know to call the interpreter (tool_use/protocol.py)."""
  table = {"magistral": MAGISTRAL_SYSTEM_PROMPT, "tiny": TINY_SYSTEM_PROMPT, "none": None}
  if name not in table:
    raise ValueError(f"system_prompt must be one of {sorted(table)}, got {name!r}")
  if not tools:
    return table[name]
  if name == "tiny":   # a template around the problem, kept short
    return TINY_SYSTEM_PROMPT_TOOLS
  return "\n\n".join(p for p in (table[name], SYSTEM_PROMPT_TOOLS) if p)


def source_names(source: str) -> list[str]:
  """The dataset names of a comma-separated source, aliases resolved."""
  return [SHIPPED_ALIASES.get(n, n) for n in source.split(",") if n]


def heldout_source(config) -> str:
  """Where the held-out problems come from: data.heldout_source, or data.source when empty."""
  return config.data.heldout_source or config.data.source


def data_dir_for(config, workdir: str | None = None) -> str:
  """data.data_dir, or WORKDIR/data when it is unset."""
  if config.data.data_dir:
    return config.data.data_dir
  if workdir is None:
    raise ValueError(f"data.source={config.data.source!r}: set data.data_dir (or give a workdir)")
  return os.path.join(workdir, "data")


def problem_loader(config, num_epochs: int | None, workdir: str | None = None,
                   source: str | None = None, **loader_kw) -> ProblemLoader:
  """A seeded ProblemLoader over `source` (default data.source); shipped sets are built on first
  use. `loader_kw` go to ProblemLoader (e.g. code_languages, shuffle)."""
  from magistral_jax.data.tfds_builders import build_shipped
  names = source_names(config.data.source if source is None else source)
  data_dir = data_dir_for(config, workdir)
  shipped = [n for n in names if n in records.SHIPPED]
  if shipped:
    build_shipped(data_dir, shipped)
  loader_kw = {"shuffle": True, **loader_kw}
  return ProblemLoader(data_dir, names, seed=config.seed, num_epochs=num_epochs, **loader_kw)


def heldout_problems(config, workdir: str | None = None, **loader_kw) -> list[dict]:
  """The held-out evaluation problems: the first data.heldout of a seeded epoch of
  heldout_source(config)."""
  n, source = config.data.heldout, heldout_source(config)
  if source == "synthetic":
    return synthetic.take(n, config.seed, "heldout", **synthetic.options(config.data))
  return problem_loader(config, 1, workdir, source, **loader_kw).take(n)


def dataset_problems(config, source: str, workdir: str | None = None) -> list[dict]:
  """Every problem of the datasets in `source` (comma-separated names): one unshuffled epoch (the
  built datasets' order), every data-parallel shard, stdin/stdout code problems in each
  language."""
  return list(problem_loader(config, 1, workdir, source, shuffle=False, shard_index=0,
                             shard_count=1))


def check_heldout_unseen(config, problems: Iterable[Mapping], workdir: str | None = None,
                         what: str = "the held-out set") -> None:
  """Raises splits.HeldOutOverlapError, naming them, when any of `problems` is one the RL stream
  of data.source trains on (by id or normalised question text). The stream skips the held-out
  head when the held-out set is drawn from data.source itself, so only problems beyond that head
  can be trained on then (an evaluation of more problems than data.heldout)."""
  if config.data.source == "synthetic":
    # The synthetic streams never draw a problem of the evaluation bucket (synthetic.py), so only
    # a problem of the task's shape outside it can be one they train on.
    trainable = [p for p in problems if synthetic.is_task_text(p["problem"])
                 and not synthetic.is_heldout(p["problem"])]
    if trainable:
      shown = ", ".join(f"{p['id']} {p['problem']!r}" for p in trainable[:5])
      raise HeldOutOverlapError(
          f"{what} has {len(trainable)} synthetic problem(s) outside the evaluation bucket, which "
          f"the synthetic training streams may draw ({shown}). Evaluate on a synthetic set's "
          "held-out split (synthetic.take(n, seed, 'heldout')) or on another dataset.")
    return
  keys = [problem_key(p) for p in problems]
  skipped = KeySet([])
  if not config.data.heldout_source:
    skipped = KeySet(problem_key(p) for p in heldout_problems(config, workdir))
    keys = [k for k in keys if k not in skipped]
    if not keys:
      return
  trained = [k for k in map(problem_key, dataset_problems(config, config.data.source, workdir))
             if k not in skipped]
  check_disjoint(keys, trained, heldout_name=what,
                 trained_name=f"the RL stream (data.source={config.data.source!r})")


def heldout_keyset(heldout) -> KeySet:
  """The KeySet of held-out problem dicts (or bare ids, matched as they are)."""
  return KeySet(problem_key(h) if isinstance(h, Mapping) else (str(h), "") for h in heldout)


class SyntheticPrompts:
  """The synthetic-arithmetic prompt stream with a resumable position: the task's "train" split,
  which never draws a problem of the evaluation bucket (synthetic.py), less any problem matching
  `heldout` (a held-out set from elsewhere). `consumed` counts the problems yielded; a resumed
  stream replays the same draws and skips, so it continues where the run stopped."""

  def __init__(self, seed: int, data_cfg, consumed: int = 0, heldout=()):
    self.heldout = heldout_keyset(heldout)
    self._it = (p for p in synthetic.problems(seed, "train", **synthetic.options(data_cfg))
                if problem_key(p) not in self.heldout)
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
  """RL prompts from problem datasets: seeded shuffled epochs without end, minus every problem
  that matches a held-out one by id or normalised question text (a code problem's other
  programming language included); `state()` is the loader's position (saved in the checkpoint
  meta). `heldout`: the held-out problem dicts (or bare ids, matched as they are)."""

  def __init__(self, config, heldout, state=None, workdir: str | None = None):
    self.loader = problem_loader(config, None, workdir)
    if state:
      self.loader.restore(state)
    self.heldout = heldout_keyset(heldout)
    fp = self.loader._fingerprint
    # An epoch is a permutation, so a run of skipped problems is at most two epochs' worth.
    self._max_skips = 2 * sum(fp["datasets"].values()) * len(fp["code_languages"]) + 1

  def __iter__(self):
    return self

  def __next__(self):
    for _ in range(self._max_skips):
      p = next(self.loader)
      if p["id"] not in self.heldout.ids and problem_key(p) not in self.heldout:
        return p
    raise ValueError(f"every problem of data.source={list(self.loader._fingerprint['datasets'])} "
                     f"is held out (data.heldout={len(self.heldout)}); lower data.heldout")

  def state(self) -> dict:
    return self.loader.state()


class RecordedPrompts:
  """A prompt stream whose every problem is recorded as drawn (trained_on.TrainedOn)."""

  def __init__(self, stream, trained):
    self.stream, self.trained = stream, trained

  def __iter__(self):
    return self

  def __next__(self):
    p = next(self.stream)
    self.trained.add(problem_key(p))
    return p

  def state(self) -> dict:
    return self.stream.state()


def train_prompts(config, heldout, state: dict | None, workdir: str | None = None,
                  trained=None):
  """The RL prompt stream of data.source, resumed from a checkpoint's `state()` if given; with
  `trained` (a trained_on.TrainedOn) every problem drawn is recorded in it."""
  state = state or {}
  if config.data.source == "synthetic":
    stream = SyntheticPrompts(config.seed, config.data, state.get("consumed", 0), heldout)
  else:
    stream = TrainProblems(config, heldout, state if "iterator" in state else None, workdir)
  return stream if trained is None else RecordedPrompts(stream, trained)
