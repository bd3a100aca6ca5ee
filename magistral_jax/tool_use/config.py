"""The `tools` section (issue #67): whether the policy may call the interpreter mid-reasoning
(tool_use/protocol.py), and the limits of its calls."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ToolConfig:
  """The `tools` section: whether the policy may call the interpreter, and its limits."""
  enabled: bool = False
  max_calls: int = 4              # calls per sample; later ones get TOO_MANY_CALLS
  max_result_tokens: int = 64     # tokens of one result block, tags included
  max_output_chars: int = 400     # the output kept of one call, before tokenizing
  cpu_s: float = 2.0              # the sandbox's CPU limit per call (RLIMIT_CPU)
  memory_mb: int = 256            # and its address-space limit

  def __post_init__(self):
    if self.max_calls < 0 or self.max_result_tokens < 8 or self.max_output_chars < 1:
      raise ValueError(f"ToolConfig: need max_calls >= 0, max_result_tokens >= 8 (the tags) and "
                       f"max_output_chars >= 1, got {self}")
    if self.cpu_s <= 0 or self.memory_mb < 32:
      raise ValueError(f"ToolConfig: need cpu_s > 0 and memory_mb >= 32, got {self}")
