r"""Cold-start SFT traces in the Magistral format from GSM8K's worked solutions (paper §4).

Magistral Small is fine-tuned on reasoning traces before RL; a small instruct model (SmolLM2-135M)
never opens `<think>` on its own, so every GRPO group scores 0 and is dropped. A GSM8K row's
reference solution already is a step-by-step derivation, so it becomes the thinking part:

  <think>
  {solution, without the <<16-3-4=9>> calculator annotations and the final "#### 18" line}
  </think>

  The answer is 18.

  \boxed{18}

which passes the reward's format gate and grades correct (tests/launch/test_smollm2_rl.py checks both
with `compute_reward`).

With the interpreter (issue #67, `tool_trace`; data.sft_tool_rate of the rows): the annotations
are GSM8K's own calculator calls, so each becomes a call to the tool before the line that uses
it, with the result block the tool returns for it (what `print` writes for the expression in
Python: `48/2` gives `24.0`), and the line itself as prose:

  <think>
  <tool>
  print(16-3-4)
  </tool>
  <result>
  9
  </result>
  Janet sells 16 - 3 - 4 = 9 duck eggs a day.
  ... The traces come from GSM8K's train split and the recipe evaluates on its
test split; `write_traces` checks the traces against the held-out problems it is given (by id and
normalised question text, data/splits.py) and stops, naming them, on any overlap, so evaluation
before and after RL is on problems the policy never saw traces of.
"""
from __future__ import annotations

import ast
import hashlib
import os
import re
from typing import Iterable, Iterator, Mapping

from magistral_jax.data import jsonl, records, splits
from magistral_jax.tool_use.config import ToolConfig
from magistral_jax.tool_use.protocol import TOOL_OPEN, call_block

NAME = "gsm8k_traces"          # the SFT dataset name that launch/sft.py builds on first use
SHIPPED = "gsm8k_train"        # the shipped GSM8K split the traces (and the RL problems) come from
HELDOUT = "gsm8k_test"         # the split the recipe evaluates on, which the traces must not touch

_CALC_RE = re.compile(r"<<[^<>]*>>")
_CALL_RE = re.compile(r"<<([^<>=]*)=[^<>]*>>")   # the expression of an annotation
# What a calculator expression may hold: numbers, arithmetic and parentheses (every one of the
# 23,716 annotations of the train split does).
_ARITHMETIC = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Constant, ast.Add, ast.Sub, ast.Mult,
               ast.Div, ast.FloorDiv, ast.Mod, ast.Pow, ast.UAdd, ast.USub)
_FINAL_RE = re.compile(r"^\s*####\s*(.*?)\s*$")


def strip_calculator_annotations(text: str) -> str:
  """`9 * 2 = $<<9*2=18>>18` -> `9 * 2 = $18` (GSM8K's calculator calls are not prose)."""
  return _CALC_RE.sub("", text)


def printed(expr: str) -> str:
  """What `print(expr)` writes for a calculator expression, as the interpreter the tool runs
  computes it (Python's arithmetic: `48/2` -> `24.0`). RowError for anything but numbers,
  arithmetic and parentheses, or an exponent past 64 (the data is not run as code)."""
  try:
    tree = ast.parse(expr.strip(), mode="eval")
  except SyntaxError as e:
    raise records.RowError("calculator_syntax", str(e)) from None
  for node in ast.walk(tree):
    if (not isinstance(node, _ARITHMETIC) or isinstance(node, ast.Constant)
        and type(node.value) not in (int, float)):
      raise records.RowError("calculator_not_arithmetic", expr)
    if (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow)
        and not (isinstance(node.right, ast.Constant) and type(node.right.value) in (int, float)
                 and abs(node.right.value) <= 64)):
      raise records.RowError("calculator_large_power", expr)
  try:
    return str(eval(compile(tree, "<gsm8k>", "eval"), {"__builtins__": {}}, {}))
  except ArithmeticError as e:
    raise records.RowError("calculator_error", f"{expr}: {e}") from None


def call(expr: str) -> str:
  """One tool call that prints `expr`, with the result block the tool answers it with."""
  return call_block(f"print({expr.strip()})", printed(expr), ToolConfig.max_output_chars)


def trace(solution: str, answer: str, tool: bool = False) -> str:
  """The Magistral-format completion for one GSM8K solution and its final answer; with `tool`,
  each calculator annotation is a call to the interpreter before its line."""
  body = []
  for line in solution.strip().splitlines():
    if not _FINAL_RE.match(line):
      calls = "".join(call(e) for e in _CALL_RE.findall(line)) if tool else ""
      body.append(calls + strip_calculator_annotations(line).rstrip())
  thoughts = "\n".join(body).strip()
  if not thoughts:
    raise records.RowError("empty_solution")
  if "<think>" in thoughts or "</think>" in thoughts:
    # A second tag would break the one-pair format condition the trace must teach.
    raise records.RowError("think_tag_in_solution")
  answer = answer.strip()
  if not answer:
    raise records.RowError("missing_field:answer")
  return f"<think>\n{thoughts}\n</think>\n\nThe answer is {answer}.\n\n\\boxed{{{answer}}}"


def calls_tool(problem_id: str, tool_rate: float) -> bool:
  """Whether the trace of `problem_id` calls the interpreter: a coin of probability tool_rate
  that is the same for a problem in every build (a hash of its id, not a stream position)."""
  coin = int.from_bytes(hashlib.sha256(problem_id.encode()).digest()[:8], "big") / 2.0**64
  return coin < tool_rate


def sft_rows(rows: Iterable[tuple[int, Mapping]], exclude_ids: Iterable[str] = (),
             source: str = SHIPPED, tool_rate: float = 0.0) -> Iterator[dict]:
  """(row_number, GSM8K row) -> canonical SFT rows {id, prompt, completion, source, language},
  minus the ids in `exclude_ids` (ids as the problem loader names them: "gsm8k_train/17"); the
  traces of a `tool_rate` share of them call the interpreter (`calls_tool`)."""
  exclude = set(exclude_ids)
  for row_number, row in rows:
    problem = records.gsm8k(row, source=source, row_number=row_number)
    if problem["id"] in exclude:
      continue
    solution = records._text(row, "solution")
    completion = trace(solution, problem["answer"], calls_tool(problem["id"], tool_rate))
    yield {"id": problem["id"], "prompt": problem["problem"], "completion": completion,
           "source": f"{source}_traces", "language": "en"}


def write_traces(out_path: str, exclude_ids: Iterable[str] = (), source_path: str | None = None,
                 source: str = SHIPPED, heldout: Iterable[Mapping] = (),
                 heldout_name: str = "the held-out set", tool_rate: float = 0.0) -> dict:
  """Writes the SFT JSONL of every usable GSM8K row not in `exclude_ids`; returns counts (with
  `tool_traces`: how many call the interpreter, at `tool_rate`).

  Rows that cannot become a trace are skipped and counted by reason (never a stopped build).
  Raises splits.HeldOutOverlapError, before writing, when a trace is one of the `heldout`
  problems (RL problem dicts) by id or normalised question text.
  """
  source_path = source_path or records.shipped_path(SHIPPED)
  exclude = set(exclude_ids)
  report = jsonl.ReadReport()
  out, skipped_excluded = [], 0
  for row_number, row in jsonl.iter_rows(source_path, report):
    try:
      got = list(sft_rows([(row_number, row)], exclude, source, tool_rate))
    except records.RowError as e:
      report.skip(source_path, row_number, e.reason, str(e))
      continue
    if not got:
      skipped_excluded += 1
    report.kept += len(got)
    out.extend(got)
  if not out:
    raise ValueError(f"no GSM8K trace could be built from {source_path} "
                     f"({skipped_excluded} excluded, skipped: {report.to_json()})")
  heldout = list(heldout)
  splits.check_disjoint([splits.problem_key(p) for p in heldout], map(splits.sft_key, out),
                        heldout_name=heldout_name, trained_name=f"the SFT traces of {source_path}")
  os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
  jsonl.write_jsonl(out_path, out)
  return {"traces": len(out), "excluded": skipped_excluded, "heldout_checked": len(heldout),
          "tool_traces": sum(TOOL_OPEN in r["completion"] for r in out),
          "read": report.to_json()}


def build_trace_dataset(data_dir: str, exclude_ids: Iterable[str] = (), name: str = NAME,
                        source_path: str | None = None, heldout: Iterable[Mapping] = (),
                        heldout_name: str = "the held-out set", tool_rate: float = 0.0) -> dict:
  """Builds (or reuses, when the traces are unchanged) the SFT dataset `name` under `data_dir`:
  what `launch/sft.py` reads with data.source=`name`, data.data_dir=`data_dir`. `heldout`: the
  problems the traces must not include (write_traces); `tool_rate`: the share that calls the
  interpreter (another rate writes other traces, so the dataset is built again)."""
  from magistral_jax.data import tfds_builders
  path = os.path.join(data_dir, f"{name}.jsonl")
  counts = write_traces(path, exclude_ids, source_path, heldout=heldout,
                        heldout_name=heldout_name, tool_rate=tool_rate)
  report = tfds_builders.build_dataset("sft", name, path, data_dir)
  return {**counts, "dataset": report["dir"]}
