"""The three kinds of records the data layer stores, and how raw JSONL rows become them.

Every dataset, whatever JSONL layout it arrives in, is turned into one canonical record per row:

  math:  id, problem, answer, source, language
  code:  id, statement, language, tests [{input, output}], test_type, test_setup, entry_point,
         solutions [{language, code}], source
  sft:   id, prompt, completion, source, language

`language` is the natural language of the text (ISO 639-1, "en" for the shipped sets); a code
solution's `language` is the programming language ("python", "cpp"). Code tests are either
stdin/stdout pairs (`test_type="stdin_stdout"`: `input` is fed on stdin, `output` is the expected
stdout) or assert programs (`test_type="assert"`: `input` is code that raises on failure, `output`
is empty).

An adapter maps one parsed JSON object to a canonical record, or raises `RowError` naming the
reason; readers count the reason and skip the row, so a bad row never stops a build.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Mapping

from magistral_jax.rewards.humaneval import prompt_helpers

KINDS = ("math", "code", "sft")
TEST_TYPES = ("stdin_stdout", "assert")

SOURCES_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sources")

# The public sets shipped in data/sources/ (see SOURCES.md): file, kind and adapter name.
SHIPPED = {
    "math500": ("math500.jsonl", "math", "math500"),
    "gsm8k_test": ("gsm8k_test.jsonl", "math", "gsm8k"),
    "gsm8k_train": ("gsm8k_train.jsonl", "math", "gsm8k"),
    "humaneval": ("humaneval_full.jsonl", "code", "humaneval"),
    "mbpp_sample20": ("mbpp_sample20.jsonl", "code", "mbpp"),
}


class RowError(ValueError):
  """A row that cannot become a record. `reason` is the counter key (e.g. 'missing_field:answer')."""

  def __init__(self, reason: str, detail: str = ""):
    super().__init__(f"{reason}: {detail}" if detail else reason)
    self.reason = reason


def shipped_path(name: str) -> str:
  if name not in SHIPPED:
    raise KeyError(f"unknown shipped dataset {name!r}; shipped: {sorted(SHIPPED)}")
  return os.path.join(SOURCES_DIR, SHIPPED[name][0])


# ---- field helpers ---------------------------------------------------------------------------
def _field(row: Mapping[str, Any], name: str, *, required: bool = True, default: Any = None):
  if name not in row or row[name] is None:
    if required:
      raise RowError(f"missing_field:{name}")
    return default
  return row[name]


def _text(row: Mapping[str, Any], name: str, *, required: bool = True, default: str = "",
          allow_empty: bool = False) -> str:
  v = _field(row, name, required=required, default=default)
  if isinstance(v, bool) or not isinstance(v, (str, int, float)):
    raise RowError(f"bad_type:{name}", f"expected a string, got {type(v).__name__}")
  v = str(v)
  if required and not allow_empty and not v.strip():
    raise RowError(f"empty_field:{name}")
  return v


def _str_list(row: Mapping[str, Any], name: str, *, required: bool = True) -> list[str]:
  v = _field(row, name, required=required, default=[])
  if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
    raise RowError(f"bad_type:{name}", "expected a list of strings")
  return v


def _row_id(row: Mapping[str, Any], key: str, source: str, row_number: int) -> str:
  v = row.get(key)
  if v is None or (isinstance(v, str) and not v.strip()):
    return f"{source}/{row_number}"
  if isinstance(v, (dict, list)):
    raise RowError(f"bad_type:{key}", "expected a string or number id")
  return str(v)


# ---- math ------------------------------------------------------------------------------------
def math_canonical(row, *, source: str, row_number: int) -> dict:
  return {
      "id": _row_id(row, "id", source, row_number),
      "problem": _text(row, "problem"),
      "answer": _text(row, "answer"),
      "source": _text(row, "source", required=False, default=source) or source,
      "language": _text(row, "language", required=False, default="en") or "en",
  }


def math500(row, *, source: str, row_number: int) -> dict:
  return {"id": _row_id(row, "unique_id", source, row_number), "problem": _text(row, "problem"),
          "answer": _text(row, "answer"), "source": source, "language": "en"}


def gsm8k(row, *, source: str, row_number: int) -> dict:
  return {"id": f"{source}/{_row_id(row, 'idx', source, row_number)}",
          "problem": _text(row, "question"), "answer": _text(row, "answer"), "source": source,
          "language": "en"}


# ---- code ------------------------------------------------------------------------------------
def _tests(v) -> list[dict]:
  if not isinstance(v, list):
    raise RowError("bad_type:tests", "expected a list")
  out = []
  for t in v:
    if isinstance(t, str):             # a bare assert line
      out.append({"input": t, "output": ""})
    elif isinstance(t, Mapping) and isinstance(t.get("input"), str) and isinstance(t.get("output", ""), str):
      out.append({"input": t["input"], "output": t.get("output", "")})
    else:
      raise RowError("bad_type:tests", "each test is a string or {input, output} strings")
  return out


def _solutions(v, default_language: str) -> list[dict]:
  if not isinstance(v, list):
    raise RowError("bad_type:solutions", "expected a list")
  out = []
  for s in v:
    if isinstance(s, str):
      out.append({"language": default_language, "code": s})
    elif isinstance(s, Mapping) and isinstance(s.get("code"), str):
      out.append({"language": str(s.get("language") or default_language), "code": s["code"]})
    else:
      raise RowError("bad_type:solutions", "each solution is a string or {language, code}")
  return out


def code_canonical(row, *, source: str, row_number: int) -> dict:
  test_type = _text(row, "test_type", required=False, default="stdin_stdout") or "stdin_stdout"
  if test_type not in TEST_TYPES:
    raise RowError("bad_value:test_type", f"{test_type!r} not in {TEST_TYPES}")
  return {
      "id": _row_id(row, "id", source, row_number),
      "statement": _text(row, "statement"),
      "language": _text(row, "language", required=False, default="en") or "en",
      "tests": _tests(_field(row, "tests")),
      "test_type": test_type,
      "test_setup": _text(row, "test_setup", required=False, default=""),
      "entry_point": _text(row, "entry_point", required=False, default=""),
      "solutions": _solutions(_field(row, "solutions", required=False, default=[]), "python"),
      "source": _text(row, "source", required=False, default=source) or source,
  }


def humaneval(row, *, source: str, row_number: int) -> dict:
  prompt = _text(row, "prompt")
  entry_point = _text(row, "entry_point")
  # HumanEval's `check(candidate)` is one program of asserts; it runs as a single assert test.
  check = _text(row, "test") + f"\n\ncheck({entry_point})\n"
  # The helpers the prompt defines beside the entry point run on our side, as the test's setup:
  # the tests must not call the candidate's copies of them (rewards/code_check.py).
  setup = prompt_helpers(prompt, entry_point)
  if setup is None:
    raise RowError("bad_value:prompt", f"the prompt does not define {entry_point!r}")
  return {
      "id": _row_id(row, "task_id", source, row_number), "statement": prompt, "language": "en",
      "tests": [{"input": check, "output": ""}], "test_type": "assert", "test_setup": setup,
      "entry_point": entry_point,
      "solutions": [{"language": "python", "code": prompt + _text(row, "canonical_solution")}],
      "source": source,
  }


def mbpp(row, *, source: str, row_number: int) -> dict:
  tests = _str_list(row, "test_list")
  text = _text(row, "text")
  # MBPP's own prompt shows the asserts: they are what names the function to write.
  statement = text + "\nYour code should pass these tests:\n" + "\n".join(tests)
  return {
      "id": f"{source}/{_row_id(row, 'task_id', source, row_number)}", "statement": statement,
      "language": "en", "tests": _tests(tests), "test_type": "assert",
      "test_setup": _text(row, "test_setup_code", required=False, default=""), "entry_point": "",
      "solutions": [{"language": "python", "code": _text(row, "code")}], "source": source,
  }


# ---- sft -------------------------------------------------------------------------------------
def sft_canonical(row, *, source: str, row_number: int) -> dict:
  return {
      "id": _row_id(row, "id", source, row_number),
      "prompt": _text(row, "prompt"),
      "completion": _text(row, "completion"),
      "source": _text(row, "source", required=False, default=source) or source,
      "language": _text(row, "language", required=False, default="en") or "en",
  }


Adapter = Callable[..., dict]
ADAPTERS: dict[str, tuple[str, Adapter]] = {
    "math": ("math", math_canonical),
    "math500": ("math", math500),
    "gsm8k": ("math", gsm8k),
    "code": ("code", code_canonical),
    "humaneval": ("code", humaneval),
    "mbpp": ("code", mbpp),
    "sft": ("sft", sft_canonical),
}


def get_adapter(kind: str, source_format: str | None) -> Adapter:
  """The adapter for `source_format` (default: the canonical layout of `kind`)."""
  if kind not in KINDS:
    raise ValueError(f"unknown record kind {kind!r}; expected one of {KINDS}")
  fmt = source_format or kind
  if fmt not in ADAPTERS:
    raise ValueError(f"unknown source format {fmt!r}; known: {sorted(ADAPTERS)}")
  fmt_kind, fn = ADAPTERS[fmt]
  if fmt_kind != kind:
    raise ValueError(f"source format {fmt!r} gives {fmt_kind} records, not {kind}")
  return fn
