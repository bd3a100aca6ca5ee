"""The guard that cannot be forgotten: what a run trained on, recorded as it is drawn, and every
evaluation of the run counted against it (`heldout_trained_on` in summary.json and each
eval_*.json; it must be 0 and the run fails otherwise).

The streams keep held-out problems out by construction (data/synthetic.py's evaluation bucket,
prompts.TrainProblems' skips, the SFT traces' checks). This record is independent of how they do
it: it only records and counts, so a stream that breaks the rule (a new source, a refactor, the
streams as they were before the bucket rule) is caught by the run itself, not by a reader.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from typing import Iterable, Iterator

from magistral_jax.data.splits import SHOWN, HeldOutOverlapError, Key

log = logging.getLogger(__name__)


def text_digest(text: str) -> str:
  """A normalised question text's short digest (what a TrainedOn file stores in its place)."""
  return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


class TrainedOn:
  """Every problem a run trained on (its cold start's traces and its RL prompts, as they are
  drawn), by id and by normalised text's digest, kept in WORKDIR/trained_on.json so that a
  resumed run and any later evaluation of its checkpoints count against all of it; an evaluation
  that meets a problem the run trained on fails (`check`).

  `watch(keys)` names an evaluation set to count against as problems arrive (`hits`: its ids
  trained on so far), so a run stops at the first batch that broke the rule instead of at its
  end. An SFT pair is known by its text alone (id ""). Thread-safe: the RL prompts are drawn on
  the pipeline's threads."""

  FILE = "trained_on.json"

  def __init__(self, path: str | None = None):
    self.path, self.ids, self.digests = path, set(), set()
    self._watched: dict[str, set[str]] = {}   # digest -> the held-out ids of that text
    self._watched_ids: set[str] = set()
    self.hits: set[str] = set()
    self._lock = threading.Lock()
    if path and os.path.exists(path):
      self.merge(path)

  def merge(self, path: str) -> None:
    """Adds another record's problems (a cold start's, run on its own by launch/sft.py)."""
    try:
      with open(path) as f:
        d = json.load(f)
      ids, digests = d["ids"], d["digests"]
    except (OSError, ValueError, KeyError, TypeError) as e:
      raise ValueError(f"{path}: not a readable record of trained problems ({e}); it lists what "
                       "a run trained on, so its evaluations cannot be checked without it") from e
    for i in ids:
      self.add((i, ""))
    for dg in digests:
      self._add_digest(dg)

  def _add_digest(self, dg: str) -> None:
    with self._lock:
      self.digests.add(dg)
      if dg in self._watched:
        self.hits.update(self._watched[dg])

  def add(self, key: Key) -> None:
    pid, text = key
    with self._lock:
      if pid:
        self.ids.add(pid)
        if pid in self._watched_ids:
          self.hits.add(pid)
    if text:
      self._add_digest(text_digest(text))

  def watch(self, keys: Iterable[Key]) -> None:
    keys = list(keys)
    with self._lock:
      for pid, text in keys:
        if text:
          self._watched.setdefault(text_digest(text), set()).add(pid)
        self._watched_ids.add(pid)
    self.hits.update(self.trained_on(keys))   # what was recorded before (a resumed run's)

  def tracked(self, stream: Iterable, key) -> Iterator:
    """`stream` with each item recorded (`key(item)` -> Key) as it is drawn."""
    for item in stream:
      self.add(key(item))
      yield item

  def trained_on(self, keys: Iterable[Key]) -> list[str]:
    """The ids of `keys` (an evaluation set) the run trained on, by id or normalised text."""
    with self._lock:
      return [pid for pid, text in keys
              if pid in self.ids or (text and text_digest(text) in self.digests)]

  def count(self, keys: Iterable[Key]) -> int:
    return len(self.trained_on(keys))

  def check(self, keys: Iterable[Key], what: str) -> int:
    """0, or raises HeldOutOverlapError naming the problems of `what` the run trained on."""
    hit = self.trained_on(list(keys))
    if hit:
      more = f" and {len(hit) - SHOWN} more" if len(hit) > SHOWN else ""
      raise HeldOutOverlapError(
          f"{what}: {len(hit)} problem(s) the run trained on ({', '.join(hit[:SHOWN])}{more}; "
          f"recorded in {self.path or 'the run'}). No evaluation may include a problem the run "
          "trained on.")
    return 0

  def save(self) -> None:
    if not self.path:
      return
    with self._lock:
      d = {"ids": sorted(self.ids), "digests": sorted(self.digests)}
    tmp = f"{self.path}.tmp"
    with open(tmp, "w") as f:
      json.dump(d, f)
    os.replace(tmp, self.path)


def trained_on_for(run, workdir: str) -> TrainedOn:
  """The record of the run in `workdir` (resumed when the file exists), with the record of the
  cold start its weights come from when that ran on its own (init.source=orbax with
  init.path=SFT_WORKDIR/params: SFT_WORKDIR/trained_on.json, written by launch/sft.py)."""
  trained = TrainedOn(os.path.join(workdir, TrainedOn.FILE))
  if run.init.source == "orbax" and run.init.path:
    sft = os.path.join(os.path.dirname(os.path.abspath(run.init.path.rstrip("/"))),
                       TrainedOn.FILE)
    if os.path.exists(sft):
      trained.merge(sft)
      log.info("counting the held-out sets against the cold start's record too: %s", sft)
    else:
      log.warning("init.path=%s has no %s beside it: its cold start's problems are not "
                  "counted against the held-out sets", run.init.path, TrainedOn.FILE)
  return trained
