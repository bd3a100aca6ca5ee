"""DAPO soft overlong penalty (paper §2), in tokens."""
from __future__ import annotations


def length_penalty(num_tokens: int, l_max: int, l_cache: int, max_penalty: float = 0.1) -> float:
  """Soft overlong penalty, added to the reward:

      0                                    if |y| <= l_max - l_cache
      -0.1 * (|y| - l_max + l_cache) / l_cache   if l_max - l_cache < |y| <= l_max
      -0.1                                 if |y| > l_max
  """
  if l_cache < 0 or l_max <= 0 or l_cache > l_max:
    raise ValueError(f"need 0 <= l_cache <= l_max and l_max > 0, got l_max={l_max} l_cache={l_cache}")
  if num_tokens <= l_max - l_cache:
    return 0.0
  if num_tokens > l_max:
    return -max_penalty
  return -max_penalty * (num_tokens - l_max + l_cache) / l_cache
