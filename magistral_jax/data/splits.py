"""Held-out versus trained-on: no evaluation may include a problem the run trained on.

A problem is known by two keys: its id, and its question text normalised (Unicode NFKC, case
folded, whitespace collapsed). Both matter: GSM8K's train and test ids differ ("gsm8k_train/3",
"gsm8k_test/3") whatever their text, and the same question may sit in two datasets under two ids.
A code problem posed in one programming language ("x#cpp", its statement plus a line naming the
language; loader.problem_dict) keys as the record it came from, so its Python version matches
it. Punctuation is kept: "2+3" and "2-3" are different problems.

`check_disjoint` raises `HeldOutOverlapError` naming the overlapping ids and texts; the data
layer calls it where a held-out set meets a training set (data/prompts.py: the RL stream;
data/gsm8k_traces.py: the SFT traces). Pure functions; what a run did train on is recorded by
data/trained_on.py, which every evaluation of the run counts against.
"""
from __future__ import annotations

import unicodedata
from typing import Iterable, Mapping

Key = tuple[str, str]   # (id, normalised text)

# How many overlapping ids and texts an error names (the count is always given).
SHOWN = 5


class HeldOutOverlapError(ValueError):
  """A held-out (evaluation) set shares problems with what the run trains on."""


def normalise_text(text: str) -> str:
  return " ".join(unicodedata.normalize("NFKC", text).casefold().split())


def problem_key(p: Mapping) -> Key:
  """The keys of an RL problem dict (loader.problem_dict): those of the record it was posed
  from."""
  pid, text = str(p["id"]), p["problem"]
  if p.get("kind") == "code":
    # Here, not at the top: the loader brings grain and TFDS, which math-only callers (the SFT
    # traces) do without.
    from magistral_jax.data.loader import PROGRAMMING_LANGUAGES, language_line
    lang = p.get("language")
    if lang in PROGRAMMING_LANGUAGES and pid.endswith(f"#{lang}"):
      pid = pid[:-len(lang) - 1]
      text = text.removesuffix(language_line(lang))
  return pid, normalise_text(text)


def sft_key(row: Mapping) -> Key:
  """The keys of a canonical SFT row (records.sft_canonical): its prompt is the question."""
  return str(row["id"]), normalise_text(row["prompt"])


class KeySet:
  """Held-out keys to skip: a problem matches by id or by normalised text."""

  def __init__(self, keys: Iterable[Key]):
    keys = list(keys)
    self.ids = {i for i, _ in keys}
    self.texts = {t for _, t in keys if t}

  def __contains__(self, key: Key) -> bool:
    return key[0] in self.ids or key[1] in self.texts

  def __len__(self) -> int:
    return len(self.ids)


def overlap(heldout: Iterable[Key], trained: Iterable[Key]
            ) -> tuple[list[str], list[tuple[str, str, str]]]:
  """(held-out ids also trained on, [(normalised text, held-out id, trained id)] for held-out
  questions trained on under another id), in held-out order."""
  trained = list(trained)
  trained_ids = {i for i, _ in trained}
  trained_texts = {}
  for i, t in trained:
    trained_texts.setdefault(t, i)
  same_id, same_text = [], []
  for i, t in heldout:
    if i in trained_ids:
      same_id.append(i)
    elif t in trained_texts:
      same_text.append((t, i, trained_texts[t]))
  return same_id, same_text


def check_disjoint(heldout: Iterable[Key], trained: Iterable[Key], *, heldout_name: str,
                   trained_name: str) -> None:
  """Raises HeldOutOverlapError when a held-out problem is among the trained ones, by id or by
  normalised question text; the message names them (the first few) and counts them."""
  same_id, same_text = overlap(heldout, trained)
  if not same_id and not same_text:
    return
  parts = []
  if same_id:
    more = f" and {len(same_id) - SHOWN} more" if len(same_id) > SHOWN else ""
    parts.append(f"{len(same_id)} by id: {', '.join(same_id[:SHOWN])}{more}")
  if same_text:
    shown = "; ".join(f"{t[:80]!r}{'...' if len(t) > 80 else ''} (held out as {h}, trained as "
                      f"{tr})" for t, h, tr in same_text[:SHOWN])
    more = f"; and {len(same_text) - SHOWN} more" if len(same_text) > SHOWN else ""
    parts.append(f"{len(same_text)} by question text: {shown}{more}")
  raise HeldOutOverlapError(
      f"{heldout_name} shares {len(same_id) + len(same_text)} problem(s) with {trained_name}: "
      + " | ".join(parts) + ". No evaluation may include a problem the run trained on: evaluate "
      "on another set or take these problems out of the training data.")

