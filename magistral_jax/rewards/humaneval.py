"""The helpers a HumanEval prompt defines beside the function to write. The code reward runs them
on its own side, as the assert tests' setup, when a task gives none (code_check.py, code_asserts.py
says why); the data adapters store them as a HumanEval task's test setup (data/records.py).
"""
from __future__ import annotations

import ast


def prompt_helpers(prompt: str, entry_point: str) -> str | None:
  """The prompt's own code less the function to write: the helpers a HumanEval prompt defines
  beside the entry point (`poly` beside `find_zero`, `encode_shift` beside `decode_shift`), its
  imports and constants. None when the prompt is not Python that defines `entry_point`."""
  try:
    tree = ast.parse(prompt)
  except (SyntaxError, ValueError, RecursionError, MemoryError):
    return None
  is_entry = lambda n: (isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                        and n.name == entry_point)
  if not any(is_entry(n) for n in tree.body):
    return None
  tree.body = [n for n in tree.body if not is_entry(n)]
  return ast.unparse(tree)
