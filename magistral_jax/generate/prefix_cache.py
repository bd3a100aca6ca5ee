"""Shared-prefix caching: a prompt prefix most requests start with (e.g. the rendered system prompt
of an RL run) is prefilled once per weights version, and a prompt that starts with it and goes on
is prefilled as its rest only, continuing the cached prefix (Engine.prefill_many
existing_prefix). Other prompts are prefilled whole. The cache, the first token and the
log-probs equal the whole prompt's prefill up to float rounding, and sampling draws the same
stream (tests/generate/test_engine_and_loop.py).
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Sequence

import jax
import numpy as np

from magistral_jax.generate.counters import LoopCounters
from magistral_jax.generate.state import Prefix

# A shared prompt prefix shorter than this is not worth its own prefill programs.
SHARED_PREFIX_MIN_TOKENS = 16


def common_prefix(prompts: Sequence[Sequence[int]]) -> list[int]:
  """The longest token prefix all `prompts` start with."""
  prompts = [list(p) for p in prompts]
  if not prompts:
    return []
  n = min(len(p) for p in prompts)
  for i in range(n):
    if any(p[i] != prompts[0][i] for p in prompts[1:]):
      return prompts[0][:i]
  return prompts[0][:n]


def useful_shared_prefix(prefix: Sequence[int], max_prefill_length: int) -> list[int] | None:
  """`prefix` as a GeneratorLoop shared_prefix when caching it pays: at least
  SHARED_PREFIX_MIN_TOKENS tokens, and room left for a prompt's own tokens; else None."""
  prefix = list(prefix)
  return prefix if SHARED_PREFIX_MIN_TOKENS <= len(prefix) < max_prefill_length else None


class SharedPrefixCache:
  """One loop's shared prefix (`tokens`) and its Prefix under the current weights. `lock` is the
  loop's (it guards the loop's version, read through current_version, and the counters);
  `temperature` the loop's (only the prefix's cache is continued, but a prefill draws a token)."""

  def __init__(self, engine, tokens: Sequence[int], lock: threading.Lock,
               current_version: Callable[[], int], counters: LoopCounters, temperature: float):
    padded, n, _ = engine.pad_prompt(tokens, truncate=False)
    if n >= engine.max_prefill_length:
      raise ValueError(f"shared_prefix of {n} tokens leaves no room for a prompt's own tokens "
                       f"under max_prefill_length={engine.max_prefill_length}")
    self.engine = engine
    self.tokens = np.asarray(tokens).reshape(-1).tolist()
    self._padded, self._temperature = padded, temperature
    self._lock, self._current_version, self._counters = lock, current_version, counters
    self._cached: tuple[int, Prefix] | None = None   # (version, Prefix under its weights)

  def clear(self) -> None:
    """Drops the cached Prefix (its KV cache); the next `get` prefills again. Caller holds the
    loop's lock."""
    self._cached = None

  def rest_length(self, prompt: list[int]) -> int:
    """Tokens of `prompt` after the shared prefix when it starts with it and goes on, else 0."""
    p = len(self.tokens)
    return len(prompt) - p if len(prompt) > p and prompt[:p] == self.tokens else 0

  def get(self, params: Any, version: int) -> Prefix:
    """The prefix's Prefix under weights `version` (`params`): the cached one, or prefilled now
    (in the thread that needs it: the loop's or the prefill worker's, never in the weights swap)
    and cached while `version` is current."""
    with self._lock:
      if self._cached is not None and self._cached[0] == version:
        return self._cached[1]
    prefix = jax.block_until_ready(self.engine.prefill(params, self._padded, len(self.tokens),
                                                      temperature=self._temperature))
    with self._lock:
      self._counters.shared_prefix_prefills += 1
      if version == self._current_version():
        self._cached = (version, prefix)
    return prefix
