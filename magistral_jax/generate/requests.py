"""What goes into the generator loop (Request), what comes out (Sample), what a dead loop raises
(GeneratorError), and a request's state while its samples are handed to slots
(RequestSamples)."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import numpy as np

from magistral_jax.generate.state import Prefixes
from magistral_jax.tool_use.protocol import graded_text


def request_key(seed: int) -> np.ndarray:
  """jax.random.PRNGKey(seed) as a host array, computed on the host where that is exact (the
  default threefry key of a 32-bit seed is [0, seed]). GeneratorLoop.submit runs in its caller's
  thread (the pipeline's feeder), so it launches no device work: only the thread that steps a
  loop launches programs onto its devices (GeneratorLoop.release)."""
  if 0 <= seed < 2**32 and jax.config.jax_default_prng_impl == "threefry2x32" \
      and not jax.config.jax_enable_x64:
    return np.array([0, seed], np.uint32)
  return np.asarray(jax.random.PRNGKey(seed))


class GeneratorError(RuntimeError):
  """The loop thread (or its prefill worker) died; the original exception is the __cause__."""


@dataclasses.dataclass
class Request:
  id: Any
  prompt_tokens: Sequence[int]
  group_size: int = 1
  max_new_tokens: int | None = None
  metadata: Any = None
  seed: int | None = None  # per-request sampling seed (default: drawn from the loop's seed)

  def __post_init__(self):
    if self.group_size < 1:
      raise ValueError(f"request {self.id!r}: group_size must be >= 1, got {self.group_size}")


def result_runs(tool_mask) -> int:
  """Tool results in a sample's mask of the tokens a tool wrote: its runs of True."""
  m = np.asarray(tool_mask, bool)
  return int(m[:1].sum() + np.sum(m[1:] & ~m[:-1]))


@dataclasses.dataclass
class Sample:
  """One finished sample of a request. logprobs[t] = log π_T(tokens[t]) under the policy version
  versions[t] that sampled it (see sampling.py). finish_reason: 'eos' | 'stop' | 'length'.
  tool_mask [tokens] bool (None: no tool call): the tokens a tool wrote (tool_use/protocol.py's
  result blocks), which the policy did not sample; their log-probs and versions mean nothing."""
  request_id: Any
  sample_index: int
  prompt_tokens: list[int]
  tokens: list[int]
  logprobs: np.ndarray
  versions: np.ndarray
  finish_reason: str
  metadata: Any = None
  prompt_truncated: bool = False
  tool_mask: np.ndarray | None = None
  _graded: str | None = dataclasses.field(default=None, repr=False, compare=False)

  def graded(self, decode: Callable[[Sequence[int]], str]) -> str:
    """The text the verifiers grade (protocol.graded_text: the tool's results left out), decoded
    once: the leader's scoring and its void-turn check both read it, with the run's one
    tokenizer."""
    if self._graded is None:
      self._graded = graded_text(decode, self.tokens, self.tool_mask)
    return self._graded

  @property
  def num_policy_tokens(self) -> int:
    """The tokens the policy sampled: what the length penalty and the normaliser count."""
    return len(self.tokens) - (0 if self.tool_mask is None else int(np.sum(self.tool_mask)))

  @property
  def num_tool_results(self) -> int:
    """The tool results the sample read (one per call)."""
    return 0 if self.tool_mask is None else result_runs(self.tool_mask)

  @property
  def action_mask(self) -> np.ndarray | None:
    """rl/collate.Completion's action_mask: the policy's own tokens (None: all of them)."""
    return None if self.tool_mask is None else ~np.asarray(self.tool_mask, bool)


@dataclasses.dataclass
class RequestSamples:
  """A submitted request (its group_size samples) while they wait for, or run in, slots: the
  prompt as prefilled, its prefix once prefilled, and the next sample index to hand out."""
  request: Request
  prompt: list[int]        # after truncation, as prefilled
  padded: np.ndarray
  true_length: int
  truncated: bool
  key: np.ndarray          # request PRNG key; sample i uses fold_in(key, i)
  max_new: int
  next_index: int = 0
  prefix: tuple[Prefixes, int] | None = None  # (prefill batch, row)
  prefix_version: int = 0
  rest: int = 0            # > 0: the prompt is the loop's shared prefix + `padded`[:rest]

  @property
  def waiting(self) -> int:
    """Samples not yet handed to a slot."""
    return self.request.group_size - self.next_index
