"""A generator that stops serving (a generator process died, hung or was relaunched:
pipeline/remote.py) as Rollouts (pipeline/rollouts.py) handles it: the part of Rollouts that
keeps track of which generator each open group went to, so that a lost generator's groups can be
given up and their prompts submitted again to the others, and a generator serving again takes
requests again.

No prompt is lost: each open group of a lost generator goes back to the prompt queue (first in
line) and is generated again, whole, by another generator as a new group. None is trained twice:
the samples the lost generator had returned for it are discarded (those already scored leave
the off-policy bound at once, the rest as they are scored), and any that arrive late are
dropped. The n_async bound stays exact: the samples that will never return leave `generating`
at once.
"""
from __future__ import annotations

import collections
import logging
import time

from magistral_jax.generate.requests import Sample
from magistral_jax.pipeline.errors import PipelineError
from magistral_jax.rewards.reward import RewardResult

log = logging.getLogger(__name__)


class LostGenerators:
  """Rollouts' handling of lost generators (see the module docstring); Rollouts holds the state
  it works on (its lock, counters, queues and group assembler)."""

  def _init_lost_generators(self) -> None:
    # Which generator each open group went to, how many of its samples came back, the groups
    # given up with a lost generator, and the prompts to submit again.
    self._serving = [True] * len(self.generators)
    self._assigned: dict[int, tuple[int, dict]] = {}   # gid -> (generator, task)
    self._returned: collections.Counter = collections.Counter()
    self._abandoned: set[int] = set()
    self._retry: collections.deque[dict] = collections.deque()
    self._none_serving_since: float | None = None

  def _on_sample(self, i: int, sample: Sample, result: RewardResult | None = None):
    """A generator's finished sample (scored already when its generator process scores:
    verifier.placement="generators")."""
    with self._lock:
      gid = int(sample.request_id)
      if gid in self._abandoned:   # its group was given up with a lost generator
        return
      self._returned[gid] += 1
      if self._returned[gid] == self.group_size:   # every sample of the group is back
        self._assigned.pop(gid, None)
        del self._returned[gid]
    self._generated.put((i, sample, result))

  def _serving_generator(self) -> int | None:
    """The least-loaded generator that serves (under self._lock)."""
    live = [i for i, g in enumerate(self.generators)
            if self._serving[i] and getattr(g, "serving", True)]
    return min(live, key=lambda i: self._gen_load[i]) if live else None

  def _watch_generators(self) -> None:
    """Main thread, while waiting for a batch: a generator that stopped serving (a
    RemoteGenerator whose process died; generate.protocol) has its open groups handed to the
    others; one serving again takes requests again. With none serving for
    pipeline.generator_rejoin_s, the run stops."""
    for i, g in enumerate(self.generators):
      serving = getattr(g, "serving", True)
      if serving != self._serving[i]:
        if serving:
          with self._lock:
            self._serving[i], self._gen_load[i] = True, 0
          log.info("generator %d serves again", i)
        else:
          self._generator_lost(i, getattr(g, "lost_reason", None) or "stopped serving")
    if any(self._serving):
      self._none_serving_since = None
      return
    now = time.time()
    if self._none_serving_since is None:
      self._none_serving_since = now
      log.warning("no generator serves: waiting up to %.0fs for one to rejoin",
                  self.cfg.generator_rejoin_s)
    elif now - self._none_serving_since > self.cfg.generator_rejoin_s:
      reasons = "; ".join(f"{getattr(g, 'name', i)}: {getattr(g, 'lost_reason', None)}"
                          for i, g in enumerate(self.generators))
      raise PipelineError(f"every generator was lost and none rejoined in "
                          f"{self.cfg.generator_rejoin_s:.0f}s (pipeline.generator_rejoin_s): "
                          f"{reasons}")

  def _generator_lost(self, i: int, reason: str) -> None:
    """Generator i's open groups are given up, and their prompts submitted again as new groups:
    samples it had returned are discarded (those already scored leave the off-policy bound at
    once, the rest as they are scored), so no prompt is lost and none trained twice."""
    with self._room:
      self._serving[i] = False
      gids = [gid for gid, (j, _) in self._assigned.items() if j == i]
      released = 0
      for gid in gids:
        _, task = self._assigned.pop(gid)
        back = self._returned.pop(gid, 0)
        self._generating -= self.group_size - back   # never coming back
        self._abandoned.add(gid)
        pending = self._groups.pending.pop(gid, None)
        released += len(pending.scored) if pending is not None else 0
        self._retry.append(task)
      self._gen_load[i] = 0
      self._queued -= released
      self._groups.counters["groups_reassigned"] += len(gids)
      self._room.notify_all()
    log.warning("generator %d lost (%s): its %d open group(s) go to the other generators",
                i, reason.splitlines()[0] if reason else reason, len(gids))

