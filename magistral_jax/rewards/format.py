"""Format check (paper §2): the gate in front of every other part of the reward.

All conditions must hold, else the reward is 0 and grading stops:
  1. the response starts with `<think>` and has exactly one `<think>` and one `</think>`;
  2. math: a `\\boxed{}` answer after `</think>`;
  3. code: at least one fenced markdown code block with a language tag after `</think>`;
  4. beyond the paper (issue #67, tool_use/protocol.py): tool calls and their results belong to
     the reasoning: no `<tool>` or `<result>` block after `</think>`.
"""
from __future__ import annotations

import dataclasses
import re

from magistral_jax.tool_use.protocol import RESULT_OPEN, TOOL_OPEN

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"

# Names of the conditions, reported in parts["failed_condition"].
STARTS_WITH_THINK = "starts_with_think"
ONE_THINK_PAIR = "one_think_pair"
BOXED_AFTER_THINK = "boxed_after_think"
CODE_BLOCK_AFTER_THINK = "code_block_after_think"
TOOLS_INSIDE_THINK = "tools_inside_think"

# ```lang\n ... ``` or an untagged ```\n ... ```; a tag is a word (python, cpp, c++, py3 ...).
# Each match runs from an opening fence to the next fence, which closes it, so successive matches
# are the blocks in order and a closing fence is never read as an opening one. Bounded character
# classes keep the scan linear on 1 MB inputs; the optional tag group starts with a letter, so the
# blanks before and after it never compete for the same characters (which would be quadratic).
CODE_BLOCK_RE = re.compile(r"```[ \t]*(?:([A-Za-z][\w+#.-]{0,30})[ \t]*)?\r?\n(.*?)```",
                           re.DOTALL)

# \boxed{...}, \boxed 5 and \fbox{...}.
_BOX_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")


@dataclasses.dataclass(frozen=True)
class FormatResult:
  ok: bool
  failed_condition: str | None
  thoughts: str = ""   # text between <think> and </think>
  answer: str = ""     # text after </think>


def find_boxed(text: str) -> list[str]:
  """Contents of every `\\boxed{..}` / `\\fbox{..}` / `\\boxed x` in `text`, in order.

  Braces are matched by depth so nested groups (`\\boxed{\\frac{1}{2}}`) stay whole. An unbalanced
  `\\boxed{` (never closed) yields nothing rather than the rest of the response.
  """
  out = []
  for m in _BOX_RE.finditer(text):
    i = m.end()
    n = len(text)
    while i < n and text[i] in " \t":
      i += 1
    if i >= n:
      continue
    if text[i] == "{":
      depth, j = 0, i
      while j < n:
        c = text[j]
        if c == "\\":        # skip escaped characters such as \{ and \}
          j += 2
          continue
        if c == "{":
          depth += 1
        elif c == "}":
          depth -= 1
          if depth == 0:
            break
        j += 1
      if depth == 0 and j < n:
        out.append(text[i + 1:j])
    elif m.group(0) == "\\boxed":
      # `\boxed 5`: the argument is the next token, up to whitespace or `$`.
      tok = re.match(r"[^\s$]+", text[i:])
      if tok:
        out.append(tok.group(0))
  return out


def code_blocks(text: str):
  """(tag, code) of each fenced block of `text`, in order; tag None for an untagged block."""
  for m in CODE_BLOCK_RE.finditer(text):
    yield m.group(1), m.group(2)


def check_format(response: str, kind: str) -> FormatResult:
  """Checks paper §2's format conditions for a `math` or `code` task."""
  if kind not in ("math", "code"):
    raise ValueError(f"task kind must be 'math' or 'code', got {kind!r}")
  if not response.startswith(THINK_OPEN):
    return FormatResult(False, STARTS_WITH_THINK)
  if response.count(THINK_OPEN) != 1 or response.count(THINK_CLOSE) != 1:
    return FormatResult(False, ONE_THINK_PAIR)
  close = response.index(THINK_CLOSE)
  thoughts = response[len(THINK_OPEN):close]
  answer = response[close + len(THINK_CLOSE):]
  if TOOL_OPEN in answer or RESULT_OPEN in answer:
    return FormatResult(False, TOOLS_INSIDE_THINK, thoughts, answer)
  if kind == "math" and not find_boxed(answer):
    return FormatResult(False, BOXED_AFTER_THINK, thoughts, answer)
  if kind == "code" and not any(tag for tag, _ in code_blocks(answer)):
    return FormatResult(False, CODE_BLOCK_AFTER_THINK, thoughts, answer)
  return FormatResult(True, None, thoughts, answer)
