"""Math correctness: the LAST boxed answer after </think> against the reference, with math-verify.

math-verify (latex2sympy2 + SymPy) is configured for RL: the prediction is parsed only from the
box we extracted (no fallback to the last bare number in the text), with unit, percent and
thousands-separator normalisation on. Its timeouts use SIGALRM, so they only fire in a process's
main thread: the verifier pool runs this in worker main threads and adds a hard kill on top.
"""
from __future__ import annotations

import functools
import re

from magistral_jax.rewards.format import find_boxed

# `\frac12`, `\dfrac34`, `\frac{270}7`, `\frac1{2}`: shorthand latex2sympy does not read in a box.
_FRAC_SHORT_RES = [
  (re.compile(r"\\([dt]?frac)\s*(\d)\s*(\d)"), r"\\\1{\2}{\3}"),
  (re.compile(r"\\([dt]?frac)\s*(\{[^{}]*\})\s*(\d)"), r"\\\1\2{\3}"),
  (re.compile(r"\\([dt]?frac)\s*(\d)\s*\{"), r"\\\1{\2}{"),
]
# Sizes past which no honest answer goes and SymPy can spend unbounded time (e.g. printing or
# simplifying `9^{9^{9^{9}}}` is stopped by the timeout, but a 100 kB box is refused up front).
MAX_ANSWER_CHARS = 1000


@functools.lru_cache(maxsize=1)
def _configs():
  from latex2sympy2_extended import NormalizationConfig
  from math_verify import ExprExtractionConfig, LatexExtractionConfig
  norm = NormalizationConfig(basic_latex=True, units=True, malformed_operators=False, nits=True,
                             boxed="all")
  latex = LatexExtractionConfig(boxed_match_priority=0, try_extract_without_anchor=False,
                                normalization_config=norm)
  return [latex], [ExprExtractionConfig()]


def _normalise(expr: str) -> str:
  expr = expr.strip()
  for pattern, repl in _FRAC_SHORT_RES:
    expr = pattern.sub(repl, expr)
  return expr


def last_boxed_answer(answer_text: str) -> str | None:
  """The content of the LAST `\\boxed{}` (or `\\fbox{}`, `\\boxed x`) in the answer text."""
  boxes = find_boxed(answer_text)
  return boxes[-1] if boxes else None


@functools.lru_cache(maxsize=4096)
def parse_reference(reference: str, timeout_s: int = 5) -> tuple:
  """Parses a reference answer; cached because every completion of a group shares it."""
  from math_verify import parse
  latex_cfg, expr_cfg = _configs()
  ref = _normalise(reference)
  gold = parse("\\boxed{" + ref + "}", latex_cfg, fallback_mode="no_fallback",
               parsing_timeout=timeout_s)
  if not gold:   # plain-text references such as "18" or "x**2"
    gold = parse(ref, expr_cfg, fallback_mode="no_fallback", parsing_timeout=timeout_s)
  return tuple(gold)


def math_equal(predicted: str, reference: str, timeout_s: int = 5) -> bool:
  """True when the boxed content `predicted` equals `reference` symbolically."""
  from math_verify import parse, verify
  if not predicted.strip() or len(predicted) > MAX_ANSWER_CHARS:
    return False
  gold = parse_reference(reference, timeout_s)
  if not gold:
    raise ValueError(f"reference answer could not be parsed: {reference[:200]!r}")
  latex_cfg, _ = _configs()
  pred = parse("\\boxed{" + _normalise(predicted) + "}", latex_cfg, fallback_mode="no_fallback",
               parsing_timeout=timeout_s)
  if not pred:
    return False
  return bool(verify(list(gold), pred, timeout_seconds=timeout_s))
