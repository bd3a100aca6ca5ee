"""The tool protocol (issue #67, beyond the paper): the policy calls a Python interpreter in the
middle of its reasoning, and reads the call's output before it goes on.

A call is a block the policy writes inside its `<think>` ... `</think>` reasoning:

    <tool>
    print(52 - 17 + 8)
    </tool>

Generation stops on TOOL_CLOSE; the source between the tags runs in the sandbox (the code
verifier's namespaces, limits and verdict rules: rewards/tool_run.py), and its output comes back
into the same sequence as a result block, which the policy reads and continues after:

    <result>
    43
    </result>

The tags are plain text the Magistral format does not otherwise use, so a response with tool
calls is still one `<think>` pair, then the answer (rewards/format.py). Only the result block is
tokenized by us; the policy's own tokens, the call included, stay exactly as sampled. Result
tokens are not the policy's actions: they are masked out of the loss, the token normaliser and
the length penalty (rl/collate.Completion.action_mask).

Limits (tool_use/config.py ToolConfig): calls per sample, result tokens per call (the output is cut to fit, and
says so), and the sample's token budget, which result tokens count against. A call that fails,
times out, prints too much or comes past the call limit gets its error text as the result; it
never ends the sample or the run.

Pure text and numbers, no dependency: the generator loop, the verifiers and the data code all
read it.
"""
from __future__ import annotations

TOOL_OPEN = "<tool>"
TOOL_CLOSE = "</tool>"
RESULT_OPEN = "<result>"
RESULT_CLOSE = "</result>"

# What the recipes' system prompts add when tools are on (data/prompts.py).
SYSTEM_PROMPT_TOOLS = (
    "While you think, you may run Python to compute: write the code between " + TOOL_OPEN
    + " and " + TOOL_CLOSE + " and print what you need. Its output comes back between "
    + RESULT_OPEN + " and " + RESULT_CLOSE + ".")

# Said in place of a result that could not be had; the policy reads these, so they are short.
TOO_MANY_CALLS = "error: no more tool calls in this answer (the limit is {limit})"
EMPTY_CALL = "error: the tool call holds no code"
CUT = "\n[output cut to {kept} of {total} characters]"


def pending_call(text: str) -> str | None:
  """The source of the call that `text` (a response so far) ends with: the text between the
  last TOOL_OPEN and a final TOOL_CLOSE. None when it does not end with TOOL_CLOSE, or the close
  has no open of its own after the previous close (a stray close is not a call)."""
  body = text.rstrip()
  if not body.endswith(TOOL_CLOSE):
    return None
  body = body[:-len(TOOL_CLOSE)]
  start = body.rfind(TOOL_OPEN)
  if start < 0 or TOOL_CLOSE in body[start:]:
    return None
  return strip_fence(body[start + len(TOOL_OPEN):])


def open_call(text: str) -> bool:
  """Whether `text` (a response, or its last turn) has a call begun and never closed: what a
  sample cut off by its token budget in the middle of a call ends with."""
  start = text.rfind(TOOL_OPEN)
  return start >= 0 and TOOL_CLOSE not in text[start:]


def strip_fence(source: str) -> str:
  """A call's source without a markdown fence around it (```python ... ```), which policies
  trained on markdown often write."""
  s = source.strip("\n")
  lines = s.strip().splitlines()
  if len(lines) >= 2 and lines[0].startswith("```") and lines[-1].strip() == "```":
    return "\n".join(lines[1:-1])
  return s


def result_block(output: str, max_chars: int) -> str:
  """The result block the policy reads after a call: the output, cut to max_chars (saying how
  much was cut), between the result tags, on lines of their own."""
  output = output.rstrip("\n")
  if len(output) > max_chars:
    output = output[:max_chars] + CUT.format(kept=max_chars, total=len(output))
  return f"\n{RESULT_OPEN}\n{output}\n{RESULT_CLOSE}\n"


def call_block(source: str, output: str, max_chars: int) -> str:
  """One call as a transcript holds it: `source` between the tool tags, then the result block of
  what it printed. What a cold start's worked traces write for a policy that calls the tool."""
  return f"{TOOL_OPEN}\n{source}\n{TOOL_CLOSE}" + result_block(output, max_chars)


# What stands for a result in the text the verifiers grade (`graded_text`).
GRADED_RESULT = f"\n{RESULT_OPEN}\n{RESULT_CLOSE}\n"


def graded_text(decode, tokens, tool_mask) -> str:
  """The response as the verifiers read it: the policy's own tokens decoded, each result in
  between replaced by an empty result block. What a tool printed is never graded: an output that
  holds "</think>" or "\\boxed{...}" cannot pass the format or give the answer for the policy,
  and the language bonus reads the policy's words. tool_mask None: every token is the policy's.
  The full transcript (results included) is what the logs and samples.jsonl show."""
  if tool_mask is None:
    return decode(tokens)
  pieces, start = [], 0
  for i in range(1, len(tokens) + 1):
    if i == len(tokens) or bool(tool_mask[i]) != bool(tool_mask[start]):
      pieces.append(GRADED_RESULT if tool_mask[start] else decode(list(tokens[start:i])))
      start = i
  return "".join(pieces)


def count_calls(text: str) -> int:
  """Complete calls in a response: each TOOL_CLOSE preceded by its own TOOL_OPEN."""
  n, i = 0, 0
  while True:
    start = text.find(TOOL_OPEN, i)
    if start < 0:
      return n
    end = text.find(TOOL_CLOSE, start + len(TOOL_OPEN))
    if end < 0:
      return n
    n += 1
    i = end + len(TOOL_CLOSE)


def void_turn(turn: str) -> bool:
  """SimpleTIR's void turn: a turn (the policy's text between two results, or after the last)
  with neither a complete call nor a final answer. A trajectory holding one is dropped from
  training: its turns after a tool output far from the policy's distribution are what drives
  multi-turn training to collapse."""
  return count_calls(turn) == 0 and "\\boxed" not in turn and "</think>" not in turn


def void_trajectory(text: str) -> bool:
  """A multi-turn response (one that read at least one result) with a void turn: what
  GRPOConfig.drop_void_turns keeps out of training. A single-turn response is never one: the
  paper trains on those whatever they hold (the length penalty handles a cut-off one)."""
  turns = policy_turns(text)
  return len(turns) > 1 and any(void_turn(t) for t in turns)


def policy_turns(text: str) -> list[str]:
  """A response's text cut at its result blocks: the policy's turns, in order (the results'
  text dropped)."""
  turns, i = [], 0
  while True:
    start = text.find(RESULT_OPEN, i)
    if start < 0:
      turns.append(text[i:])
      return turns
    end = text.find(RESULT_CLOSE, start)
    turns.append(text[i:start])
    if end < 0:
      return turns
    i = end + len(RESULT_CLOSE)


def split_results(text: str) -> list[tuple[str, bool]]:
  """A transcript cut at its result blocks: (piece, is a tool's result) in order, the pieces
  joining back to `text`. A result block is what `result_block` writes, from the newline before
  RESULT_OPEN to the newline after RESULT_CLOSE; an unclosed one runs to the end."""
  out, i = [], 0
  while True:
    start = text.find("\n" + RESULT_OPEN, i)
    if start < 0:
      break
    end = text.find(RESULT_CLOSE, start)
    end = len(text) if end < 0 else end + len(RESULT_CLOSE) + text.startswith(
        "\n", end + len(RESULT_CLOSE))
    if start > i:
      out.append((text[i:start], False))
    out.append((text[start:end], True))
    i = end
  if i < len(text):
    out.append((text[i:], False))
  return out


def encode_transcript(text: str, encode) -> tuple[list[int], list[bool]]:
  """A response's tokens as the generator loop makes them (the policy's text, and each result
  block tokenized on its own: `split_results`) and their action mask: True for the policy's
  tokens, False for a tool's. What a cold start on traces with calls trains on."""
  ids, mask = [], []
  for piece, is_result in split_results(text):
    tokens = list(encode(piece))
    ids += tokens
    mask += [not is_result] * len(tokens)
  return ids, mask
