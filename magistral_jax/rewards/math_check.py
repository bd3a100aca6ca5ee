r"""Math correctness: the LAST boxed answer after </think> against the reference, with math-verify.

math-verify (latex2sympy2 + SymPy) is configured for RL: the prediction is parsed only from the
box we extracted (no fallback to the last bare number in the text), with unit, percent and
thousands-separator normalisation on. A percent sign matches either reading, `\boxed{25\%}` the
reference 25 and the reference 0.25, on purpose: the datasets write a "what percent" answer
without its sign (GSM8K's "#### 25", MATH's "25"), so refusing `25\%` for 25 would teach the
policy that a correct answer with its unit is wrong, and a bare number is never read as a percent
(`\boxed{284}` fails for 2.84). Its timeouts use SIGALRM, so they only fire in a process's
main thread: the verifier pool runs this in worker main threads and adds a hard kill on top.

Relations in the box. math-verify grades an equation by its right-hand side, so `\boxed{1000 =
284}` passed for the reference 284: a box of two numbers is a hedge, not an answer. When the
reference has no `=` and the box is a relation with a top-level `=` (one outside braces, brackets
and parentheses, and not part of `<=`, `>=`, `!=`, `:=`, `\not=`; `==` counts as one `=`; `\leq`,
`\geq`, `\neq` hold no `=` character), the box is split into its sides and
  - every side without a variable must equal the reference: `\boxed{2+3 = 5}` passes for 5,
    `\boxed{1000 = 284}` fails for 284;
  - sides with a variable are names, not graded: `\boxed{x = 5}` and `\boxed{f(2) = 5}` pass for 5;
  - at least one side must be checked when the reference is itself variable-free: `\boxed{x = y}`
    fails for 5;
  - and math-verify's own reading of the whole box must pass too, so the rule only ever turns a
    pass into a fail (`\boxed{x = 3 \text{ or } x = 5}` stays wrong for 5).
A side has a variable when a letter is left once LaTeX commands (`\frac`, `\sqrt`, `\cdot`,
`\left`, `\sin` ...) and the words of `\text{..}`-like commands (units such as `10\text{ cm}`) are
set aside; `\pi` is a constant, the other Greek letters are variables. A box of more than
MAX_RELATION_SIDES sides is a chain, not an answer, and is wrong. References that hold `=`
(`y=2x+3`) are graded as before.
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
# Each side of a relation is parsed and verified on its own, under its own timeout.
MAX_RELATION_SIDES = 4

# Commands whose braced argument is words or units (`10\text{ cm}`), not variables.
_TEXT_COMMANDS = frozenset({"text", "textrm", "textbf", "textit", "textnormal", "mbox", "mathrm",
                            "operatorname"})
# Greek letters name variables (`\theta = 30`); `\pi` is the number and is left out.
_GREEK_VARIABLES = frozenset(
    "alpha beta gamma delta epsilon varepsilon zeta eta theta vartheta iota kappa lambda mu nu xi "
    "omicron varpi rho varrho sigma varsigma tau upsilon phi varphi chi psi omega Gamma Delta "
    "Theta Lambda Xi Sigma Upsilon Phi Psi Omega".split())


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


def _command(expr: str, i: int) -> tuple[str, int]:
  """(name, end) of the LaTeX command at expr[i] == "\\": `\\frac` -> "frac", `\\{` -> "{"."""
  j = i + 1
  while j < len(expr) and expr[j].isalpha():
    j += 1
  if j == i + 1:   # a one-character command: \{ \} \, \% ...
    j = min(i + 2, len(expr))
  return expr[i + 1:j], j


def relation_sides(expr: str) -> list[str]:
  """The sides of `expr` split at its top-level `=` signs; [expr] when it has none.

  Top level: outside (), [], {} and \\{ \\} (intervals such as `[1,3)` close at any bracket).
  An `=` after `<`, `>`, `!`, `:` or `\\not` belongs to that operator; `==` is one sign.
  """
  sides, start, depth, i, n = [], 0, 0, 0, len(expr)
  not_end = -1   # where the last `\not` ended
  while i < n:
    c = expr[i]
    if c == "\\":
      name, i = _command(expr, i)
      if name == "{":
        depth += 1
      elif name == "}":
        depth = max(0, depth - 1)
      elif name == "not":
        not_end = i
      continue
    if c in "([{":
      depth += 1
    elif c in ")]}":
      depth = max(0, depth - 1)
    elif (c == "=" and depth == 0 and (i == 0 or expr[i - 1] not in "<>!:")
          and not (not_end >= 0 and not expr[not_end:i].strip())):
      sides.append(expr[start:i])
      i += 2 if expr[i + 1:i + 2] == "=" else 1
      start = i
      continue
    i += 1
  sides.append(expr[start:])
  return sides


def has_variable(expr: str) -> bool:
  """True when `expr` holds a letter outside LaTeX command names and `\\text{..}`-like words,
  or a Greek letter other than `\\pi`."""
  i, n = 0, len(expr)
  while i < n:
    c = expr[i]
    if c == "\\":
      name, i = _command(expr, i)
      if name in _GREEK_VARIABLES:
        return True
      if name in _TEXT_COMMANDS:
        while i < n and expr[i] == " ":
          i += 1
        if i < n and expr[i] == "{":   # skip the braced words
          depth = 0
          while i < n:
            if expr[i] == "\\":
              i += 2
              continue
            depth += {"{": 1, "}": -1}.get(expr[i], 0)
            i += 1
            if depth == 0:
              break
      continue
    if c.isalpha():
      return True
    i += 1
  return False


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


def _parse_box(content: str, timeout_s: int) -> list:
  from math_verify import parse
  latex_cfg, _ = _configs()
  return parse("\\boxed{" + content + "}", latex_cfg, fallback_mode="no_fallback",
               parsing_timeout=timeout_s)


def math_equal(predicted: str, reference: str, timeout_s: int = 5) -> bool:
  """True when the boxed content `predicted` equals `reference` symbolically.

  A relation in the box (`x = 5`, `1000 = 284`) is graded side by side: see the module docstring.
  """
  from math_verify import verify
  if not predicted.strip() or len(predicted) > MAX_ANSWER_CHARS:
    return False
  gold = parse_reference(reference, timeout_s)
  if not gold:
    raise ValueError(f"reference answer could not be parsed: {reference[:200]!r}")
  predicted = _normalise(predicted)
  pred = _parse_box(predicted, timeout_s)
  if not pred or not verify(list(gold), pred, timeout_seconds=timeout_s):
    return False
  if "=" in reference:
    return True
  sides = relation_sides(predicted)
  if len(sides) == 1:
    return True
  if len(sides) > MAX_RELATION_SIDES:
    return False
  constants = [side for side in sides if side.strip() and not has_variable(side)]
  if not constants:   # nothing but names (`x = y`): only a symbolic reference is graded as before
    return has_variable(reference)
  for side in constants:
    side_pred = _parse_box(side.strip(), timeout_s)
    if not side_pred or not verify(list(gold), side_pred, timeout_seconds=timeout_s):
      return False
  return True
