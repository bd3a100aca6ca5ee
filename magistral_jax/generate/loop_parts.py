"""What the generator loop's parts share, as one object (GeneratorLoop builds it, its refill and
its own step read it), so no part hands another a list of the loop's members.

Each field has one owner: `requests` is filled by GeneratorLoop.submit and taken by the loop
thread (or the prefill worker); `groups` (the requests whose samples wait for slots, in queue
order) and `slots` are the loop thread's own; `drain` holds the compacted state, `ahead` the
step in flight and the first tokens not yet fetched; `prefiller` the background prefill worker;
`pages` the KV pages of a paged engine's slots (paging.py; None on a dense engine).
`sampling` is the loop's: the temperature its inserts hand the engine is `sampling.temperature`.
"""
from __future__ import annotations

import collections
import dataclasses
import queue

from magistral_jax.generate.compaction import Drain
from magistral_jax.generate.config import EngineConfig, SamplingConfig
from magistral_jax.generate.engine import Engine
from magistral_jax.generate.inflight import DeviceLead
from magistral_jax.generate.paging import LoopPages
from magistral_jax.generate.prefill_worker import PrefillWorker
from magistral_jax.generate.slots import SlotTable


@dataclasses.dataclass(frozen=True)
class LoopParts:
  engine: Engine
  options: EngineConfig
  sampling: SamplingConfig
  requests: queue.Queue
  groups: collections.deque
  slots: SlotTable
  drain: Drain
  ahead: DeviceLead
  prefiller: PrefillWorker
  pages: LoopPages | None = None
