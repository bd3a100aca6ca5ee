"""The generator loop's host-side view of the engine's decode slots.

Each slot's sample so far (tokens, log-probs, the policy version of each token) lives in numpy
buffers, so a decode step's bookkeeping is a few array ops; a sample finishes on EOS, a stop
string or its token budget, and goes out as a Sample. With tools (tool_turns.py) a sample may
also stop for a tool call: it keeps its slot, inactive, until the call's result tokens are
appended (marked as a tool's, not the policy's) and it goes on.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np

from magistral_jax.generate.requests import RequestSamples, Sample, result_runs
from magistral_jax.generate.config import SamplingConfig


@dataclasses.dataclass
class SlotSample:
  """Sample `index` of `group`, running in a slot."""
  group: RequestSamples
  index: int


class SlotTable:
  """samples[slot]: what each slot runs (None: free); active: the host's activity mask;
  device_active: what the device's mask currently is."""

  def __init__(self, n_slots: int, max_decode_length: int, sampling: SamplingConfig,
               detokenize: Callable[[Sequence[int]], str] | None,
               on_finish: Callable[[Sample], None],
               on_free: Callable[[int], None] | None = None,
               on_tool: Callable[["SlotTable", int], bool] | None = None):
    self.sampling, self.detokenize, self.on_finish = sampling, detokenize, on_finish
    self.on_free = on_free   # told each slot a finished sample leaves (its KV pages go back)
    # Asked of each slot whose sample goes on after a token: True when the sample stopped for a
    # tool call (tool_turns.ToolTurns.maybe_call), which parks it.
    self.on_tool = on_tool
    self.samples: list[SlotSample | None] = [None] * n_slots
    self._tokens = np.zeros((n_slots, max_decode_length), np.int32)
    self._logprobs = np.zeros((n_slots, max_decode_length), np.float32)
    self._versions = np.zeros((n_slots, max_decode_length), np.int64)
    self._tool = np.zeros((n_slots, max_decode_length), bool)   # the tokens a tool wrote
    self._turn = np.zeros((n_slots,), np.int64)   # where the policy's current turn starts
    self._count = np.zeros((n_slots,), np.int64)
    self._max_new = np.zeros((n_slots,), np.int64)
    # Prompt tokens in each slot's cache: its cache length before a step is prompt + count - 1,
    # so a step writes at positions below prompt + count (what picks the attention window).
    self._prompt_len = np.zeros((n_slots,), np.int64)
    self.active = np.zeros((n_slots,), bool)
    self.device_active = np.zeros((n_slots,), bool)
    self._max_stop = max((len(s) for s in sampling.stop_strings), default=0)

  def empty(self) -> bool:
    return all(s is None for s in self.samples)

  def held(self) -> np.ndarray:
    """[slots] bool: a sample holds the slot (decoding, or parked)."""
    return np.array([s is not None for s in self.samples])

  def free(self) -> np.ndarray:
    """The slots no sample holds (a parked sample holds its slot while inactive)."""
    return np.flatnonzero([s is None for s in self.samples])

  def park(self, slot: int) -> None:
    """The sample in `slot` stops decoding but keeps its slot and tokens (paging.py)."""
    self.active[slot] = False

  def resume(self, slot: int) -> None:
    self.active[slot] = True

  def take(self, slot: int) -> tuple:
    """The sample in `slot`, whole (what `put` restores), out of its slot, which is freed."""
    n = int(self._count[slot])
    record = (self.samples[slot], self._tokens[slot, :n].copy(), self._logprobs[slot, :n].copy(),
              self._versions[slot, :n].copy(), int(self._max_new[slot]),
              int(self._prompt_len[slot]), self._tool[slot, :n].copy(), int(self._turn[slot]))
    self.samples[slot] = None
    self.active[slot] = False
    if self.on_free is not None:
      self.on_free(slot)
    return record

  def put(self, slot: int, record: tuple) -> None:
    """A sample `take` took, back into (free) `slot`, active."""
    sample, tokens, logprobs, versions, max_new, prompt_len, tool, turn = record
    n = len(tokens)
    self.samples[slot] = sample
    self._tokens[slot, :n], self._logprobs[slot, :n], self._versions[slot, :n] = (
        tokens, logprobs, versions)
    self._tool[slot, :n], self._turn[slot] = tool, turn
    self._count[slot], self._max_new[slot], self._prompt_len[slot] = n, max_new, prompt_len
    self.active[slot] = True

  def reached(self, in_flight: np.ndarray | None = None) -> dict[int, int]:
    """{active slot: cache positions after the next step's write} (see `positions`)."""
    return dict(zip(np.flatnonzero(self.active).tolist(), self._reached(in_flight).tolist()))

  def progress(self) -> dict[int, int]:
    """{active slot: tokens generated so far}."""
    act = np.flatnonzero(self.active)
    return dict(zip(act.tolist(), self._count[act].tolist()))

  def assign(self, slot: int, group: RequestSamples, index: int) -> None:
    """Sample `index` of `group` starts in `slot` (active from now on)."""
    self.samples[slot] = SlotSample(group, index)
    self._count[slot] = self._turn[slot] = 0
    self._tool[slot] = False
    self._max_new[slot] = group.max_new
    self._prompt_len[slot] = group.true_length
    self.active[slot] = True

  def _reached(self, in_flight: np.ndarray | None) -> np.ndarray:
    """Each active slot's cache positions after the next step's write (see `positions`)."""
    act = np.flatnonzero(self.active)
    pos = self._prompt_len[act] + self._count[act]
    return pos if in_flight is None else pos + in_flight[act]

  def positions(self, in_flight: np.ndarray | None = None) -> int:
    """Cache positions the next step writes below, over the active slots. `in_flight` [slots]
    bool: the slots a dispatched step not yet recorded advances (GeneratorLoop's overlap_host),
    each one position further than its recorded tokens say."""
    return int(self._reached(in_flight).max())

  def mean_positions(self, in_flight: np.ndarray | None = None) -> float:
    """What a live decode step reads per slot (model/decode_live.py): each active slot's
    positions as in `positions`, inactive slots none, averaged over all slots."""
    return float(self._reached(in_flight).sum()) / len(self.active)

  def turn_tokens(self, slot: int) -> np.ndarray:
    """The tokens of the policy's current turn in `slot` (since the last tool result)."""
    return self._tokens[slot, self._turn[slot]:self._count[slot]]

  def results(self, slot: int) -> int:
    """Tool results in `slot`'s sample so far (runs of a tool's tokens)."""
    return result_runs(self._tool[slot, :self._count[slot]])

  def room(self, slot: int) -> int:
    """Tokens `slot`'s sample may still add before its budget ends."""
    return int(self._max_new[slot] - self._count[slot])

  def append_result(self, slot: int, tokens, version: int) -> None:
    """A tool's result tokens after the sample's last (pending) token: in its record, marked as
    the tool's (no log-prob of the policy), and the policy's next turn starts after them."""
    c, n = int(self._count[slot]), len(tokens)
    self._tokens[slot, c:c + n] = tokens
    self._logprobs[slot, c:c + n] = 0.0
    self._versions[slot, c:c + n] = version
    self._tool[slot, c:c + n] = True
    self._count[slot] = self._turn[slot] = c + n

  def finish(self, slot: int, reason: str) -> None:
    """Ends `slot`'s sample now (a tool call past its budget: 'length')."""
    self._finish(slot, reason)

  def in_cache(self, slot: int) -> list[int]:
    """The tokens in a slot's cache: the prompt and all but the pending token."""
    return self.samples[slot].group.prompt + self._tokens[slot, :self._count[slot] - 1].tolist()

  def record(self, slots: np.ndarray, tokens: np.ndarray, logprobs: np.ndarray,
             versions: np.ndarray) -> bool:
    """Appends one token per listed slot; hands the samples this finishes to on_finish and frees
    their slots. Returns whether any finished."""
    c = self._count[slots]
    self._tokens[slots, c] = tokens
    self._logprobs[slots, c] = logprobs
    self._versions[slots, c] = versions
    self._count[slots] = c + 1
    eos = (tokens == self.sampling.eos_id) if self.sampling.eos_id is not None \
        else np.zeros(slots.shape, bool)
    length = self._count[slots] >= self._max_new[slots]
    stop = np.zeros(slots.shape, bool)
    if self._max_stop:
      for j in np.flatnonzero(~eos):   # in the policy's own turn (a tool's output stops nothing)
        stop[j] = self._hit_stop(self._tokens[slots[j], self._turn[slots[j]]:c[j] + 1])
    done = eos | stop | length
    for j in np.flatnonzero(done):
      slot = int(slots[j])
      reason = "eos" if eos[j] else "stop" if stop[j] else "length"
      self._finish(slot, reason)
    if self.on_tool is not None:
      for j in np.flatnonzero(~done):
        if self.on_tool(self, int(slots[j])):
          self.active[slots[j]] = False   # parked for its call, holding its slot (and pages)
    return bool(done.any())

  def _finish(self, slot: int, reason: str) -> None:
    s, n = self.samples[slot], int(self._count[slot])
    self.samples[slot] = None
    self.active[slot] = False
    if self.on_free is not None:
      self.on_free(slot)
    g, tool = s.group, self._tool[slot, :n]
    self.on_finish(Sample(g.request.id, s.index, list(g.prompt), self._tokens[slot, :n].tolist(),
                          self._logprobs[slot, :n].copy(), self._versions[slot, :n].copy(),
                          reason, g.request.metadata, g.truncated,
                          tool.copy() if tool.any() else None))

  def _hit_stop(self, tokens) -> bool:
    # Only the tail can contain a stop string that the previous step did not already contain.
    tail = self.detokenize(tokens[-(self._max_stop + 8):].tolist())
    return any(s in tail for s in self.sampling.stop_strings)
