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
with `compute_reward`). The traces come from GSM8K's train split and the recipe evaluates on its
test split; `write_traces` checks the traces against the held-out problems it is given (by id and
normalised question text, data/splits.py) and stops, naming them, on any overlap, so evaluation
before and after RL is on problems the policy never saw traces of.
"""
from __future__ import annotations

import os
import re
from typing import Iterable, Iterator, Mapping

from magistral_jax.data import jsonl, records, splits

NAME = "gsm8k_traces"          # the SFT dataset name that launch/sft.py builds on first use
SHIPPED = "gsm8k_train"        # the shipped GSM8K split the traces (and the RL problems) come from
HELDOUT = "gsm8k_test"         # the split the recipe evaluates on, which the traces must not touch

_CALC_RE = re.compile(r"<<[^<>]*>>")
_FINAL_RE = re.compile(r"^\s*####\s*(.*?)\s*$")


def strip_calculator_annotations(text: str) -> str:
  """`9 * 2 = $<<9*2=18>>18` -> `9 * 2 = $18` (GSM8K's calculator calls are not prose)."""
  return _CALC_RE.sub("", text)


def trace(solution: str, answer: str) -> str:
  """The Magistral-format completion for one GSM8K solution and its final answer."""
  lines = strip_calculator_annotations(solution).strip().splitlines()
  body = [l.rstrip() for l in lines if not _FINAL_RE.match(l)]
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


def sft_rows(rows: Iterable[tuple[int, Mapping]], exclude_ids: Iterable[str] = (),
             source: str = SHIPPED) -> Iterator[dict]:
  """(row_number, GSM8K row) -> canonical SFT rows {id, prompt, completion, source, language},
  minus the ids in `exclude_ids` (ids as the problem loader names them: "gsm8k_train/17")."""
  exclude = set(exclude_ids)
  for row_number, row in rows:
    problem = records.gsm8k(row, source=source, row_number=row_number)
    if problem["id"] in exclude:
      continue
    solution = records._text(row, "solution")
    yield {"id": problem["id"], "prompt": problem["problem"],
           "completion": trace(solution, problem["answer"]), "source": f"{source}_traces",
           "language": "en"}


def write_traces(out_path: str, exclude_ids: Iterable[str] = (), source_path: str | None = None,
                 source: str = SHIPPED, heldout: Iterable[Mapping] = (),
                 heldout_name: str = "the held-out set") -> dict:
  """Writes the SFT JSONL of every usable GSM8K row not in `exclude_ids`; returns counts.

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
      got = list(sft_rows([(row_number, row)], exclude, source))
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
          "read": report.to_json()}


def build_trace_dataset(data_dir: str, exclude_ids: Iterable[str] = (), name: str = NAME,
                        source_path: str | None = None, heldout: Iterable[Mapping] = (),
                        heldout_name: str = "the held-out set") -> dict:
  """Builds (or reuses, when the traces are unchanged) the SFT dataset `name` under `data_dir`:
  what `launch/sft.py` reads with data.source=`name`, data.data_dir=`data_dir`. `heldout`: the
  problems the traces must not include (write_traces)."""
  from magistral_jax.data import tfds_builders
  path = os.path.join(data_dir, f"{name}.jsonl")
  counts = write_traces(path, exclude_ids, source_path, heldout=heldout,
                        heldout_name=heldout_name)
  report = tfds_builders.build_dataset("sft", name, path, data_dir)
  return {**counts, "dataset": report["dir"]}
