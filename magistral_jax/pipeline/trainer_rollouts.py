"""The trainer processes' rollouts in a many-host run (pipeline/remote.py has the generators'
side of it): the leader's Rollouts, which pushes the weights to the generator processes and sends
each minibatch on to the other trainer processes, and theirs, which receive it.

    LeaderRollouts --- "batch" stream --> FollowerRollouts on trainer processes 1..T-1, which
                   --- "rows" channel -->  train on the same batches (SPMD) and stage every push

The "batch" stream says only that a batch is ready; each minibatch's packed arrays go to each
other trainer process as only the rows its own devices hold, through a parallel.bulk.BulkChannel
(device to device, jax.experimental.transfer).
"""
from __future__ import annotations

import logging
import time

import numpy as np

from magistral_jax.parallel.bulk import BulkChannel, LocalRows, row_ranges
from magistral_jax.parallel.multihost import Mailbox
from magistral_jax.parallel.weight_transfer import WeightTransfer
from magistral_jax.pipeline.errors import PipelineError
from magistral_jax.pipeline.groups import RolloutBatch
from magistral_jax.pipeline.remote import REPLY_TIMEOUT_S, GeneratorLost
from magistral_jax.pipeline.rollouts import Rollouts
from magistral_jax.rl.minibatch import Minibatch

log = logging.getLogger(__name__)


def rows_channel(mailbox: Mailbox, stage: int, follower: int, process: int) -> BulkChannel:
  """The leader's (process 0's) channel of training rows to trainer process `process`."""
  return BulkChannel(mailbox, f"stage{stage}/rows/{follower}", 0, process)


class LeaderRollouts(Rollouts):
  """Rollouts on the trainer leader: its generators are RemoteGenerators, and the other trainer
  processes (FollowerRollouts, processes `follower_processes`) get each batch's minibatches,
  each only the rows of the global batch array (laid out by `batch_sharding`) it holds."""

  def __init__(self, *, mailbox: Mailbox, follower_processes, stage: int, batch_sharding,
               transfer: WeightTransfer, **kwargs):
    super().__init__(**kwargs)
    self.mailbox, self.stage, self.batch_sharding = mailbox, stage, batch_sharding
    self.transfer = transfer
    self.follower_processes = tuple(follower_processes)
    self.channels = [rows_channel(mailbox, stage, f, p)
                     for f, p in enumerate(self.follower_processes)]
    self._unacked: list = []   # (generator, incarnation, version): the last push, unacked
    transfer.settle = self._await_acks   # any stage (a push's, an evaluation's) waits for them

  def _broadcast(self, message):
    for f in range(len(self.follower_processes)):
      self.mailbox.send(f"stage{self.stage}/batch/{f}", message)

  def next_batch(self) -> RolloutBatch | None:
    try:
      batch = super().next_batch()
    except BaseException as e:
      self._broadcast(("error", f"the trainer leader stopped: {type(e).__name__}: {e}"))
      raise
    self._broadcast(("batch", None if batch is None else batch.wait_s))
    return batch

  def minibatches(self, batch, cfg, rng) -> list[Minibatch]:
    mbs = super().minibatches(batch, cfg, rng)
    for mb in mbs:
      fields = {k: (v.shape, v.dtype) for k, v in mb.arrays.items()}
      shape = next(iter(fields.values()))[0]   # every field's: [n_micro, rows, row_len]
      for channel, process in zip(self.channels, self.follower_processes):
        ranges = row_ranges(self.batch_sharding, shape, process)
        rows = {f"{k}/{r0}/{r1}": v[:, r0:r1] for k, v in mb.arrays.items()
                for r0, r1 in ranges}
        channel.send(rows, {"fields": fields, "stats": mb.stats, "minibatches": len(mbs)})
    for channel in self.channels:   # before the first step (see BulkChannel.wait_for_ack)
      channel.wait_for_ack(600, f"trainer process {channel.dst} to receive its rows")
    return mbs

  def push(self, params, version: int) -> float:
    """Every trainer process stages the params once (FollowerRollouts.push does the same); the
    leader offers the copy to each generator serving and returns: each generator pulls it while
    the trainer takes its next step. Their acks are awaited only before the next stage replaces
    the copy (WeightTransfer.settle: a push's stage or an evaluation's), or at the stage's end.
    A generator's requests follow the push on its stream, so it serves none of them before it
    has the weights. A generator lost meanwhile is skipped (Rollouts reassigns its groups); one
    that rejoins gets this version."""
    t = time.time()
    with self.transfer.lock:
      self.transfer.stage(params, version)   # after the last push's acks (settle)
      for g in self.generators:
        if g.serving:
          _, uuid = self.transfer.offer(REPLY_TIMEOUT_S)
          g.push_to(version, uuid)
          self._unacked.append((g, g.incarnation, int(version)))
    return time.time() - t

  def _await_acks(self) -> None:
    """The generators' acks of the last push (each has pulled its copy). A generator that was
    lost and rejoined since got the latest weights as it rejoined (under the transfer lock)."""
    pending, self._unacked = self._unacked, []
    for g, inc, version in pending:
      if g.incarnation != inc:
        continue
      try:
        g.wait_for(("ack", version), f"the push of version {version}")
      except GeneratorLost as e:
        log.warning("%s", e)

  def close(self):
    with self.transfer.lock:
      self._await_acks()
      self.transfer.settle = lambda: None
    super().close()   # the feeder first: no request may follow the end of the stage
    for g in self.generators:
      g.end_stage()


class FollowerBatch:
  """A batch as a follower knows it: how long the leader waited for it; its groups stay there."""

  def __init__(self, wait_s: float):
    self.groups, self.wait_s = (), wait_s


class FollowerRollouts:
  """Rollouts as trainer processes 1..T-1 see them (a train.rollout_source.RolloutSource): the
  leader's word that a batch is ready, then its minibatches, of which this process receives only
  the rows its own devices hold (parallel.bulk.LocalRows, which train.step.shard_batch takes), and
  their part of every push (the staging program runs on the whole trainer mesh)."""

  def __init__(self, *, mailbox: Mailbox, follower: int, process: int, stage: int,
               transfer: WeightTransfer, batch_timeout_s: float):
    self.mailbox, self.transfer = mailbox, transfer
    self.stream = f"stage{stage}/batch/{follower}"
    self.channel = rows_channel(mailbox, stage, follower, process)
    self.batch_timeout_s = batch_timeout_s

  def next_batch(self) -> FollowerBatch | None:
    kind, value = self.mailbox.receive(self.stream, self.batch_timeout_s + 60,
                                       what="the trainer leader's next batch")
    if kind == "error":
      raise PipelineError(value)
    return None if value is None else FollowerBatch(value)

  def minibatches(self, batch, cfg, rng) -> list[Minibatch]:
    """The leader's minibatches of `batch`, this process's rows of each."""
    out, count = [], None
    while count is None or len(out) < count:
      rows, meta = self.channel.receive(self.batch_timeout_s + 60,
                                        what="the trainer leader's minibatch rows")
      count = meta["minibatches"]
      blocks: dict = {k: {} for k in meta["fields"]}
      for name, a in rows.items():
        key, r0, r1 = name.rsplit("/", 2)
        blocks[key][(int(r0), int(r1))] = a
      arrays = {k: LocalRows(tuple(shape), dtype, blocks[k])
                for k, (shape, dtype) in meta["fields"].items()}
      out.append(Minibatch(arrays, [], np.zeros((0, 3), np.int64), meta["stats"]))
    self.channel.ack()
    return out

  def push(self, params, version: int) -> float:
    t = time.time()
    self.transfer.stage(params, version)
    return time.time() - t

  def done(self, batch) -> None:
    pass

  def check(self) -> None:
    pass

  def metrics(self, batch: FollowerBatch, trained_version: int) -> dict:
    """Empty: the batch's groups, and the metrics writer, are the leader's."""
    return {}

  def sample_text(self, batch: FollowerBatch) -> str:
    """Empty: no metrics writer runs on these processes (the leader's writes the samples)."""
    return ""

  def close(self) -> None:
    pass

  def __enter__(self) -> "FollowerRollouts":
    return self

  def __exit__(self, *exc):
    self.close()
