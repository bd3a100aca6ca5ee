"""The paper's format filter for math problems (paper §3: 699k -> 501k).

Drops proofs and multi-part problems, drops problems whose answer the math verifier cannot parse,
and rewrites multiple choice as an open question where the chosen option can be stated as an
answer. Every drop is counted under one reason (the first that applies, in this order):

  proof                        the problem asks for a proof, or the answer is a proof marker
  multi_part                   (a)/(b), (i)/(ii), "part 1 ... part 2" sub-questions
  multiple_choice_unstatable   multiple choice whose answer cannot stand without the options
                               ("which of the following", several letters, "none of the above",
                               options not found)
  unverifiable_answer          math_verify.parse finds nothing in \\boxed{answer}

Detection is by regular expressions over the problem text: a heuristic, tuned to the competition
sources (MATH, AMC/AIME style) the paper draws from. Each rule is a named function so it can be
tested and changed on its own.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import re
import threading
from typing import Iterable, Mapping

log = logging.getLogger(__name__)

REASONS = ("proof", "multi_part", "multiple_choice_unstatable", "unverifiable_answer")
MAX_IDS_PER_REASON = 20


@dataclasses.dataclass(frozen=True)
class FormatFilterConfig:
  drop_proofs: bool = True
  drop_multi_part: bool = True
  rewrite_multiple_choice: bool = True   # False: drop every multiple-choice problem instead
  parsing_timeout: int = 5               # seconds per math_verify.parse (main thread only)


# ---- proofs ----------------------------------------------------------------------------------
# "prove" anywhere; "show that" only as an instruction (clause start), not "needs to show that".
_PROOF_PROBLEM = re.compile(
    r"\b(?:prove|disprove)\b|(?<!-)\bproof\b"
    r"|(?:^|[.!?:;]\s+|\n\s*|\b(?:and|then)\s+)"
    r"(?:show|demonstrate|verify|justify|establish|explain why)\s+(?:that|why)\b",
    re.IGNORECASE | re.MULTILINE)
_PROOF_ANSWERS = {"proof", "seeproof", "qed", "\\blacksquare", "\\square", "\\qed", "q.e.d."}


def _answer_key(answer: str) -> str:
  a = re.sub(r"\\(?:text|textbf|mathrm|mbox)\s*\{([^{}]*)\}", r"\1", answer)
  return re.sub(r"[\s$]", "", a).lower()


def is_proof(problem: str, answer: str) -> bool:
  return bool(_PROOF_PROBLEM.search(problem)) or _answer_key(answer) in _PROOF_ANSWERS


# ---- multi-part ------------------------------------------------------------------------------
# A part marker stands alone: not f(a), not (a, b). Lower-case letters only: upper-case labels
# are multiple-choice options.
_PART_LETTER = re.compile(r"(?:(?<=^)|(?<=[\s:.;]))\(([a-e])\)(?=[\s:.])", re.MULTILINE)
_PART_LETTER_LINE = re.compile(r"^\s*([a-e])[).]\s", re.MULTILINE)
_PART_ROMAN = re.compile(r"(?:(?<=^)|(?<=[\s:.;]))\((i{1,3}|iv|v)\)(?=[\s:.])", re.MULTILINE)
_PART_WORD = re.compile(r"\bpart\s*\(?([a-d1-4]|i{1,3})\)?[\s:.)]", re.IGNORECASE)


def is_multi_part(problem: str, answer: str) -> bool:
  letters = set(_PART_LETTER.findall(problem)) | set(_PART_LETTER_LINE.findall(problem))
  if {"a", "b"} <= letters:
    return True
  if {"i", "ii"} <= set(_PART_ROMAN.findall(problem)):
    return True
  if len({p.lower() for p in _PART_WORD.findall(problem)}) >= 2:
    return True
  # An answer with its own part labels answers several questions.
  return {"a", "b"} <= set(re.findall(r"\(([ab])\)", answer))


# ---- multiple choice -------------------------------------------------------------------------
_WRAP = r"(?:\\(?:textbf|text|mathrm|mbox)\s*\{\s*)?"
_OPTION_INLINE = re.compile(_WRAP + r"\(([A-F])\)(?:\s*\})?")
_OPTION_LINE = re.compile(r"^[ \t]*" + _WRAP + r"\(?([A-F])[.)](?:\s*\})?[ \t]+", re.MULTILINE)
_LETTER_ANSWER = re.compile(r"^\(?([A-F])\)?$")
_REFERS_TO_OPTIONS = re.compile(
    r"\bwhich\b|\ball of the above\b|\bnone of the above\b|\bboth\b.*\band\b|\bneither\b",
    re.IGNORECASE)
_INSTRUCTION = re.compile(r"\b(?:letter|option|choice)s?\b", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class MultipleChoice:
  stem: str                  # the question without its options
  options: dict              # label -> option text
  tail: str                  # text after the options that is not an answering instruction


def _option_sequence(matches) -> list:
  """The longest run of labels A, B, C, ... in order (other "(X)" are positions, points...)."""
  run, want = [], "A"
  for m in matches:
    if m.group(1) == want:
      run.append(m)
      want = chr(ord(want) + 1)
    elif m.group(1) == "A":         # a new run starts
      run, want = [m], "B"
  return run


def _clean_option(text: str) -> str:
  text = re.sub(r"\\q?quad|\\[ ,;!]|\\\\", " ", text)
  text = text.replace("$", " ")
  return re.sub(r"\s+", " ", text).strip(" ,;.")


def parse_multiple_choice(problem: str) -> MultipleChoice | None:
  """Finds labelled options (A)...(B)... or lines "A. ..."; None if there are fewer than two."""
  for pattern in (_OPTION_INLINE, _OPTION_LINE):
    run = _option_sequence(pattern.finditer(problem))
    if len(run) >= 2:
      break
  else:
    return None
  options = {}
  for m, nxt in zip(run, run[1:] + [None]):
    end = nxt.start() if nxt else problem.find("\n", m.end())
    end = len(problem) if end == -1 else end
    options[m.group(1)] = _clean_option(problem[m.end():end])
  stem = problem[:run[0].start()].rstrip()
  stem = re.sub(r"\$\s*$", "", stem).rstrip()      # the opening $ of an inline option list
  last_end = problem.find("\n", run[-1].end())
  tail_lines = problem[last_end:].split("\n") if last_end != -1 else []
  tail = "\n".join(l for l in tail_lines if l.strip() and not _INSTRUCTION.search(l)).strip()
  return MultipleChoice(stem=stem, options=options, tail=tail)


def _as_answer(option: str) -> str:
  # A bare word ("Plane") must be one symbol for the verifier, not the product P*l*a*n*e.
  if re.fullmatch(r"[A-Za-z][A-Za-z \-']*", option):
    return f"\\text{{{option}}}"
  return option


def rewrite_multiple_choice(problem: str, answer: str) -> tuple[str, str] | str | None:
  """(open problem, stated answer); a drop reason string; or None if not multiple choice."""
  key = _answer_key(answer).upper()
  letter = _LETTER_ANSWER.match(key)
  multi_letters = re.fullmatch(r"\(?[A-F]\)?(?:[,;]|AND)\(?[A-F]\)?(?:(?:[,;]|AND)\(?[A-F]\)?)*", key)
  mc = parse_multiple_choice(problem)
  if mc is None:
    return "multiple_choice_unstatable" if multi_letters else None
  if multi_letters:
    return "multiple_choice_unstatable"
  if not letter:
    return None        # the answer is already stated in the open; options are only a hint
  option = mc.options.get(letter.group(1))
  if not option or _REFERS_TO_OPTIONS.search(mc.stem + "\n" + option) or not mc.stem:
    return "multiple_choice_unstatable"
  open_problem = mc.stem + ("\n" + mc.tail if mc.tail else "")
  return open_problem, _as_answer(option)


# ---- verifiable answer -----------------------------------------------------------------------
def parses(answer: str, timeout: int | None = 5) -> bool:
  """True if math_verify extracts a mathematical object from \\boxed{answer}."""
  import math_verify   # heavy (SymPy); only the filter needs it
  text = answer if "\\boxed" in answer else f"\\boxed{{{answer}}}"
  if threading.current_thread() is not threading.main_thread():
    timeout = None       # its SIGALRM timeout works only in the main thread
  try:
    parsed = math_verify.parse(text, parsing_timeout=timeout)
  except Exception as e:   # noqa: BLE001  a parser crash means "cannot verify"
    log.info("math_verify.parse failed on %r: %s", answer, e)
    return False
  return bool(parsed) and not isinstance(parsed[0], str)


# ---- the filter ------------------------------------------------------------------------------
def check(rec: Mapping[str, str], config: FormatFilterConfig = FormatFilterConfig()):
  """(reason, None) for a dropped problem, (None, record) for a kept one (maybe rewritten)."""
  problem, answer = rec["problem"], rec["answer"]
  if config.drop_proofs and is_proof(problem, answer):
    return "proof", None
  if config.drop_multi_part and is_multi_part(problem, answer):
    return "multi_part", None
  out = dict(rec)
  mc = rewrite_multiple_choice(problem, answer)
  if isinstance(mc, str):
    return mc, None
  if mc is not None:
    if not config.rewrite_multiple_choice:
      return "multiple_choice_unstatable", None
    out["problem"], out["answer"] = mc
    out["rewritten"] = "multiple_choice"
  if not parses(out["answer"], config.parsing_timeout):
    return "unverifiable_answer", None
  return None, out


# Process-pool entry points (this module imports little, so spawned workers start fast).
_worker_config = FormatFilterConfig()


def init_worker(config: FormatFilterConfig):
  global _worker_config
  _worker_config = config


def worker_check(rec):
  return check(rec, _worker_config)


@dataclasses.dataclass
class DropReport:
  """What a filter stage kept and dropped: counts per reason and the first MAX_IDS_PER_REASON
  record ids of each (the format and code filters' reports extend it)."""
  seen: int = 0
  kept: int = 0
  dropped: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  dropped_ids: dict = dataclasses.field(default_factory=dict)

  def drop(self, rec_id, reason: str):
    self.dropped[reason] += 1
    ids = self.dropped_ids.setdefault(reason, [])
    if len(ids) < MAX_IDS_PER_REASON:
      ids.append(rec_id)

  def to_json(self) -> dict:
    return {"seen": self.seen, "kept": self.kept, "dropped": dict(self.dropped),
            "dropped_ids": self.dropped_ids}


@dataclasses.dataclass
class FilterReport(DropReport):
  rewritten: collections.Counter = dataclasses.field(default_factory=collections.Counter)

  def add(self, rec_id: str, reason: str | None, kept: dict | None):
    self.seen += 1
    if reason is None:
      self.kept += 1
      if kept.get("rewritten"):
        self.rewritten[kept["rewritten"]] += 1
      return
    self.drop(rec_id, reason)

  def to_json(self) -> dict:
    return {**super().to_json(), "rewritten": dict(self.rewritten)}


def format_filter(recs: Iterable[Mapping[str, str]], config: FormatFilterConfig = FormatFilterConfig(),
                  report: FilterReport | None = None):
  """Yields the kept (possibly rewritten) math records; counts drops per reason in `report`."""
  report = report if report is not None else FilterReport()
  for rec in recs:
    reason, out = check(rec, config)
    report.add(rec["id"], reason, out)
    if out is not None:
      yield out
