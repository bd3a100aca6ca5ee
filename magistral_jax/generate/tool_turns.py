"""Tool calls in the generator loop (issue #67): a sample that writes a call
(tool_use/protocol.py) stops decoding, keeps its slot and its KV cache while the call runs off
the decode path, and goes on in the same sequence once the result is back.

  1. After each recorded token, `maybe_call` looks at the policy's current turn: when it ends
     with a complete call, the call goes to a thread pool (`run`: the sandbox, rewards/tool_run.py,
     or whatever the caller gives) and the slot is parked (SlotTable.record). Other slots go on
     decoding; a paged slot keeps its pages.
  2. Each loop step, `resume` takes the calls that are done: the result block is tokenized (only
     the tool's output is: the policy's tokens stay as sampled), appended to the sample marked as
     the tool's (SlotTable.append_result), and the slot's pending token and the result tokens are
     put through the model on top of the cache the slot holds (Engine.extend: its positions are
     never recomputed, whatever weights have been pushed since). The slot's next token is drawn
     there under the weights of that moment and carries their policy version, as every token
     does; it is recorded like any decoded token, and the slot decodes again.
Limits (ToolConfig): a call past max_calls gets an error result without running; a result is
cut to max_result_tokens; a sample whose result would not fit its token budget ends there
('length'). A call that fails gives its error text as the result, never an exception here.
"""
from __future__ import annotations

import collections
import concurrent.futures
from typing import Callable, Sequence

import jax
import numpy as np

from magistral_jax.generate.weights import NonFiniteError
from magistral_jax.tool_use.config import ToolConfig
from magistral_jax.tool_use.protocol import (RESULT_CLOSE, RESULT_OPEN, TOOL_CLOSE, TOO_MANY_CALLS,
                                             pending_call, result_block)

# Run(source) -> (output text, error kind or None): rewards/tool_run.run_call's, unpacked.
Run = Callable[[str], tuple[str, "str | None"]]


class ToolTurns:
  """The calls of one loop's slots: which slot waits for which call, and the counts."""

  def __init__(self, cfg: ToolConfig, run: Run, tokenize: Callable[[str], Sequence[int]],
               detokenize: Callable[[Sequence[int]], str], workers: int = 2):
    self.cfg, self._run, self.tokenize, self.detokenize = cfg, run, tokenize, detokenize
    self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="tool-call")
    self.waiting: dict[int, concurrent.futures.Future] = {}
    self.counts = collections.Counter()
    # The close tag spans a few tokens: the tail a new token can complete it in.
    self._tail = len(TOOL_CLOSE) + 8

  def call_in(self, turn: np.ndarray) -> str | None:
    """The source of the call the policy's turn (its tokens since the last result) ends with."""
    if TOOL_CLOSE not in self.detokenize(turn[-self._tail:].tolist()):
      return None
    return pending_call(self.detokenize(turn.tolist()))

  def maybe_call(self, slots, slot: int) -> bool:
    """SlotTable's on_tool: starts the call `slot`'s sample just wrote, if it did."""
    source = self.call_in(slots.turn_tokens(slot))
    if source is None:
      return False
    self.counts["tool_calls"] += 1
    if slots.results(slot) >= self.cfg.max_calls:
      done = concurrent.futures.Future()
      done.set_result((TOO_MANY_CALLS.format(limit=self.cfg.max_calls), "too_many"))
      self.waiting[slot] = done
    else:
      self.waiting[slot] = self._pool.submit(self._run, source)
    return True

  def busy(self) -> bool:
    return bool(self.waiting)

  def result_tokens(self, output: str) -> list[int]:
    """The result block of `output` as tokens, at most max_result_tokens: the output is cut
    (result_block says how much) so that the tags always close the block."""
    block = result_block(output, self.cfg.max_output_chars)
    tokens = list(self.tokenize(block))
    if len(tokens) <= self.cfg.max_result_tokens:
      return tokens
    head, tail = self.tokenize(f"\n{RESULT_OPEN}\n"), self.tokenize(f"\n{RESULT_CLOSE}\n")
    body = self.tokenize(block[len(RESULT_OPEN) + 2:-len(RESULT_CLOSE) - 2])
    keep = max(0, self.cfg.max_result_tokens - len(head) - len(tail))
    return list(head) + list(body[:keep]) + list(tail)

  def resume(self, parts, params, version: int, state, wait: bool = False):
    """The slots whose calls are done (all of them, waiting for each, with `wait`) go on:
    their results into their sequences (module docstring, 2.). Returns the decode state."""
    done = [s for s, f in self.waiting.items() if wait or f.done()]
    if not done:
      return state
    slots, pages, engine = parts.slots, parts.pages, parts.engine
    parts.ahead.flush()   # the step in flight first: its token for a parked slot is dropped
    if parts.drain.compacted is not None:
      state = parts.drain.expand(state, slots.held())
    for slot in done:
      output, error = self.waiting[slot].result()
      self.counts["tool_errors"] += error is not None
      tokens = self.result_tokens(output)
      if len(tokens) + 1 > slots.room(slot):   # the result and one more token do not fit
        del self.waiting[slot]
        self.counts["tool_truncated"] += 1
        slots.finish(slot, "length")
        continue
      length = len(slots.in_cache(slot))
      if pages is not None:
        if not pages.reserve(slot, length + 1 + len(tokens)):
          continue   # no pages yet: it waits, parked, for samples to finish and free some
        state = pages.sync(state)
      pending = int(slots.turn_tokens(slot)[-1])
      state, tok, lp = engine.extend(params, state, slot, [pending] + tokens, length)
      tok, lp = jax.device_get((tok, lp))
      if not np.isfinite(lp):
        raise NonFiniteError(f"non-finite logits after a tool result in slot {slot} at policy "
                             f"version {version}; stopping instead of sampling garbage")
      del self.waiting[slot]
      self.counts["tool_result_tokens"] += len(tokens)
      slots.append_result(slot, tokens, version)
      slots.resume(slot)
      slots.device_active[slot] = True
      slots.record(np.asarray([slot]), np.asarray([tok]), np.asarray([lp]),
                   np.asarray([version]))
    return state

  def metrics(self) -> dict[str, float]:
    return {k: float(self.counts[k]) for k in ("tool_calls", "tool_errors", "tool_truncated",
                                               "tool_result_tokens")}

  def close(self) -> None:
    self._pool.shutdown(wait=True, cancel_futures=True)
