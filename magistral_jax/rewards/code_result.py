"""What a code check yields, shared by its runners (rewards/code_stdio.py, code_cpp.py,
code_asserts.py) and the driver (rewards/code_check.py): a verdict (CodeResult) or none
(VerifierFault); and writing a task's source into its host run dir.
"""
from __future__ import annotations

import dataclasses


class VerifierFault(Exception):
  """A limit hit on our side, not the program's doing (the wall-clock backstop on an overloaded
  host): the completion gets no verdict, and its group is dropped."""


@dataclasses.dataclass
class CodeResult:
  passed: bool
  detail: str = ""        # why it failed, for logging
  tests_run: int = 0


def write_source(path: str, text: str):
  with open(path, "w", encoding="utf-8", errors="replace") as f:
    f.write(text)
