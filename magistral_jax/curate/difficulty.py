"""The paper's two-stage difficulty filter (paper §3: 501k -> 38k math problems).

Each stage samples k completions per problem (16 in the paper), grades them, and keeps the
problems whose pass rate lies in [min_pass_rate, max_pass_rate]:
  stage 1 (a strong model): drops never-solved (pass rate 0) and mostly-solved problems;
  stage 2 (an RL-trained checkpoint, re-grading stage 1's pool): drops the easiest and the
  still-unsolved, and drops problems where most samples agree on an answer that differs from the
  reference (the reference is probably wrong).
The thresholds are NOT STATED in the paper: they are fields of `DifficultyStage`.

Sampling and grading are injected, so the filter runs with the real generator and verifier pool
(`generator_sample_fn`, `pool_score_fn`) or with any callables of the same shape:
  sample_fn(problems, k) -> completions[len(problems)][k]                   (strings)
  score_fn(problems, completions) -> grades[len(problems)][k]               (`Grade`s)

Resumable: every graded problem is appended (and flushed) to a journal JSONL before the next
batch starts. A rerun reads the journal, skips the problems already graded and continues; a line
cut short by a kill is ignored (and that problem graded again).
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import logging
import os
import re
from typing import Callable, Iterable, NamedTuple, Sequence

from magistral_jax.data import jsonl

log = logging.getLogger(__name__)


class Grade(NamedTuple):
  correct: bool
  answer: str | None      # the extracted final answer (e.g. the last \boxed{}), None if absent


SampleFn = Callable[[list, int], list]
ScoreFn = Callable[[list, list], list]


@dataclasses.dataclass(frozen=True)
class DifficultyStage:
  name: str = "stage1"
  k: int = 16                       # samples per problem (paper: 16)
  min_pass_rate: float = 1 / 16     # below: too hard (0 = never solved)
  max_pass_rate: float = 12 / 16    # above: too easy. NOT STATED: a config choice
  drop_wrong_consensus: bool = False  # stage 2: most samples agree on a non-reference answer
  consensus_fraction: float = 0.5   # "most": strictly more than this fraction of the k samples
  batch_problems: int = 32          # problems per sample/score round (one journal flush each)

  def __post_init__(self):
    if self.k < 1:
      raise ValueError(f"k must be >= 1, got {self.k}")
    if not 0.0 <= self.min_pass_rate <= self.max_pass_rate <= 1.0:
      raise ValueError(f"need 0 <= min_pass_rate <= max_pass_rate <= 1, got "
                       f"{self.min_pass_rate}, {self.max_pass_rate}")
    if not re.fullmatch(r"[A-Za-z0-9_.\-]+", self.name):
      raise ValueError(f"stage name {self.name!r} becomes a file name: use [A-Za-z0-9_.-]")


PAPER_STAGES = (
    DifficultyStage("stage1", min_pass_rate=1 / 16, max_pass_rate=12 / 16),
    DifficultyStage("stage2", min_pass_rate=1 / 16, max_pass_rate=10 / 16, drop_wrong_consensus=True),
)


def normalize_answer(answer: str) -> str:
  """A cheap canonical form for counting agreeing answers ("\\frac{1}{2}" = "\\dfrac12" is
  not caught; sympy-level equality per pair would cost k^2 verifier calls per problem)."""
  a = re.sub(r"\\(?:left|right|displaystyle|!|,|;|:)|\\text\{\s*\}", "", answer)
  a = re.sub(r"\\[dt]frac", r"\\frac", a)
  return re.sub(r"\s+", "", a).strip("$.")


def summarize(grades: Sequence[Grade]) -> dict:
  """Pass rate and the most common wrong answer of one problem's k grades."""
  k = len(grades)
  n_correct = sum(bool(g.correct) for g in grades)
  wrong = collections.Counter(normalize_answer(g.answer) for g in grades
                              if not g.correct and g.answer)
  top_wrong, top_wrong_n = wrong.most_common(1)[0] if wrong else (None, 0)
  return {"k": k, "n_correct": n_correct, "pass_rate": n_correct / k if k else 0.0,
          "top_wrong_answer": top_wrong, "top_wrong_count": top_wrong_n}


def decide(summary: dict, stage: DifficultyStage) -> str | None:
  """None to keep, else the drop reason."""
  if stage.drop_wrong_consensus and summary["top_wrong_count"] > stage.consensus_fraction * summary["k"]:
    return "wrong_consensus"
  if summary["pass_rate"] < stage.min_pass_rate:
    return "never_solved" if summary["n_correct"] == 0 else "too_hard"
  if summary["pass_rate"] > stage.max_pass_rate:
    return "too_easy"
  return None


def _read_journal(path: str) -> dict:
  done = {}
  if not os.path.exists(path):
    return done
  with open(path, "rb") as f:
    for n, raw in enumerate(f, 1):
      try:
        row = json.loads(raw.decode("utf-8"))
        done[row["id"]] = row
      except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError):
        log.warning("journal %s line %d is incomplete (killed run?): that problem is regraded", path, n)
  return done


def _batches(it: Iterable, n: int):
  it = iter(it)
  while batch := list(itertools.islice(it, n)):
    yield batch


def histogram(rates: Iterable[float], k: int) -> dict:
  """Counts of problems per number of correct samples: {"0/16": n, "1/16": n, ...}."""
  counts = collections.Counter(round(r * k) for r in rates)
  return {f"{i}/{k}": counts.get(i, 0) for i in range(k + 1)}


def run_stage(problems: Sequence[dict], stage: DifficultyStage, sample_fn: SampleFn,
              score_fn: ScoreFn, work_dir: str) -> tuple[list[dict], dict]:
  """Grades `problems` (resuming from the journal in work_dir) and returns (kept, report)."""
  os.makedirs(work_dir, exist_ok=True)
  journal_path = os.path.join(work_dir, f"{stage.name}.journal.jsonl")
  done = _read_journal(journal_path)
  # Rewrite the journal without a torn last line, so appends start on a clean line.
  jsonl.write_jsonl(journal_path, done.values())
  ids = [p["id"] for p in problems]
  if len(set(ids)) != len(ids):
    raise ValueError("problem ids must be unique for the journal to resume correctly")
  todo = [p for p in problems if p["id"] not in done]
  log.info("%s: %d problems, %d already graded, %d to go", stage.name, len(problems),
           len(problems) - len(todo), len(todo))
  with open(journal_path, "a", encoding="utf-8") as journal:
    for batch in _batches(todo, stage.batch_problems):
      completions = sample_fn(batch, stage.k)
      if len(completions) != len(batch) or any(len(c) != stage.k for c in completions):
        raise ValueError(f"sample_fn must return {stage.k} completions for each of {len(batch)} problems")
      grades = score_fn(batch, completions)
      if len(grades) != len(batch) or any(len(g) != stage.k for g in grades):
        raise ValueError(f"score_fn must return {stage.k} grades for each of {len(batch)} problems")
      for p, g in zip(batch, grades):
        row = {"id": p["id"], **summarize([Grade(*x) for x in g])}
        done[p["id"]] = row
        journal.write(json.dumps(row, ensure_ascii=False) + "\n")
      journal.flush()
      os.fsync(journal.fileno())

  kept, reasons, rates = [], collections.Counter(), []
  for p in problems:
    s = done[p["id"]]
    rates.append(s["pass_rate"])
    reason = decide(s, stage)
    if reason is None:
      kept.append({**p, f"{stage.name}_pass_rate": s["pass_rate"]})
    else:
      reasons[reason] += 1
  report = {"stage": dataclasses.asdict(stage), "seen": len(problems), "kept": len(kept),
            "dropped": dict(reasons), "pass_rate_histogram": histogram(rates, stage.k)}
  return kept, report


def difficulty_filter(problems: Sequence[dict], stages: Sequence[tuple[DifficultyStage, SampleFn]],
                      score_fn: ScoreFn, work_dir: str) -> tuple[list[dict], dict]:
  """Runs the stages in order, each on the previous stage's survivors, each with its own sampler
  (stage 2 samples from another checkpoint). Returns (kept, {stage name: report})."""
  reports = {}
  for stage, sample_fn in stages:
    problems, reports[stage.name] = run_stage(problems, stage, sample_fn, score_fn, work_dir)
  return list(problems), reports


# ---- the real sampler and grader -------------------------------------------------------------
def generator_sample_fn(loop, tokenizer, *, max_new_tokens: int | None = None,
                        system_prompt: str | None = None) -> SampleFn:
  """k completions per problem from a `generate.loop.GeneratorLoop` (one group per problem).

  Prompts go through the tokenizer's chat template with the paper's system prompt (default).
  Runs the loop in the calling thread (`run_until_idle`); a started loop thread must not run.
  """
  from magistral_jax.generate.requests import Request
  counter = itertools.count()
  kw = {} if system_prompt is None else {"system_prompt": system_prompt}

  def sample(problems, k):
    base = next(counter) * 1_000_000   # request ids unique across calls
    for i, p in enumerate(problems):
      loop.submit(Request(id=base + i, prompt_tokens=tokenizer.apply_chat_template(p["problem"], **kw),
                          group_size=k, max_new_tokens=max_new_tokens))
    out = [[None] * k for _ in problems]
    for c in loop.run_until_idle():
      out[c.request_id - base][c.sample_index] = tokenizer.decode(c.tokens)
    missing = sum(x is None for row in out for x in row)
    if missing:
      raise RuntimeError(f"generator returned {missing} fewer completions than requested")
    return out
  return sample


def pool_score_fn(pool, *, group_seed: int = 0) -> ScoreFn:
  """Grades with a `verify.pool.VerifierPool`: correct = the correctness part of the reward."""
  def score(problems, completions):
    items = [(p, c, None, group_seed) for p, cs in zip(problems, completions) for c in cs]
    results = pool.map(items)
    grades, i = [], 0
    for cs in completions:
      row = []
      for _ in cs:
        r = results[i]
        i += 1
        row.append(Grade(bool(r.parts.get("correct", 0.0) > 0), (r.info or {}).get("boxed")))
      grades.append(row)
    return grades
  return score
