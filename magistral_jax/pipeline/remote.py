"""The pipeline across processes (many hosts; parallel/multihost.py has the roles).

    trainer leader (process 0)                          generator process g
    Rollouts over RemoteGenerator g  --- "in" stream -->  serve_generator: a GeneratorLoop on
      (prompts, verifier pool, groups, batches)          its own devices, unchanged
                                     <-- "out" stream --  completions (tokens, log-probs,
                                                          versions), acks, errors + traceback
    push: WeightTransfer.send on every trainer process --> WeightTransfer.receive, then
          (device to device)                                update_params: in-flight sequences
                                                            go on with their KV cache
    LeaderRollouts --- "batch" stream --> FollowerRollouts on trainer processes 1..T-1, which
                   --- "rows" channel -->  train on the same batches (SPMD) and take part in
                                          every push

The streams are parallel.multihost.Mailbox streams (JAX's coordination service). The training
data does not go through them: each minibatch's packed arrays go to each other trainer process
as only the rows its own devices hold, through a parallel.bulk.BulkChannel (device to device,
jax.experimental.transfer); the "batch" stream says only that a batch is ready. What a
generator process does is driven by its "in" stream: ("eval", ...), ("stage", ...), requests,
("push", version), ("end",), ("exit",); so a restarted run needs no state on the generator hosts.
"""
from __future__ import annotations

import logging
import threading
import time
import traceback
from typing import Callable

import jax
import numpy as np

from magistral_jax.generate.counters import LoopCounters
from magistral_jax.generate.requests import Request, Sample
from magistral_jax.generate.weights import Weights
from magistral_jax.model import transformer as T
from magistral_jax.parallel.bulk import BulkChannel, LocalRows, row_ranges
from magistral_jax.parallel.multihost import Mailbox, WeightTransfer
from magistral_jax.pipeline.groups import RolloutBatch
from magistral_jax.pipeline.errors import PipelineError
from magistral_jax.pipeline.rollouts import Rollouts
from magistral_jax.rl.minibatch import Minibatch

log = logging.getLogger(__name__)

# How long a trainer waits for a generator process to acknowledge a push or answer an
# evaluation before it stops with an error naming the process (a dead process is reported
# sooner, by the coordination service's heartbeats).
REPLY_TIMEOUT_S = 600.0
ERROR_LINGER_S = 60.0   # how long a failed generator process waits for the leader to read its error
FLUSH_S = 0.05   # a generator process sends its finished samples at least this often


def in_stream(g: int) -> str:
  return f"gen{g}/in"


def out_stream(g: int) -> str:
  return f"gen{g}/out"


def weight_transfer(model_cfg, mesh, rules, trainer_devices) -> WeightTransfer:
  """The push from the trainer to a generator engine on `mesh` (its param layout and serving
  dtype, generate.weights.Weights), built the same way on both ends."""
  weights = Weights(model_cfg, mesh, rules)
  dtype = model_cfg.jnp_serving_param_dtype
  abstract = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, dtype), T.param_shapes(model_cfg))
  return WeightTransfer(abstract, weights.param_shardings, trainer_devices)


# ---- the trainer side --------------------------------------------------------------------------

class RemoteGenerator:
  """A generator running in another process, as Rollouts sees a GeneratorLoop (the
  generate.protocol.Generator it implements): submit requests, samples back through `callback`,
  pushes, check(), the loop's counters (those the process sends with its samples)."""

  def __init__(self, mailbox: Mailbox, index: int, process: int, engine, transfer: WeightTransfer):
    self.mailbox, self.index, self.process = mailbox, index, process
    self.engine, self.transfer = engine, transfer   # engine: limits and layout only, never run
    self.callback: Callable[[Sample], None] | None = None
    self.counters = LoopCounters()
    self._acks: dict = {}
    self._error: str | None = None
    self._cond = threading.Condition()
    self._reader: threading.Thread | None = None
    self._stop = threading.Event()
    self._pending: list[Request] = []

  @property
  def name(self) -> str:
    return f"generator {self.index} (process {self.process})"

  def send(self, message) -> None:
    self.mailbox.send(in_stream(self.index), message)

  def start(self) -> "RemoteGenerator":
    if self._reader is None:
      self._reader = threading.Thread(target=self._read, name=f"remote-gen{self.index}",
                                      daemon=True)
      self._reader.start()
    return self

  def submit(self, request: Request) -> None:
    self.check()
    self.send(("requests", [request]))

  def push(self, params, version: int, cast: dict | None = None) -> None:
    """One push (Rollouts.push; every trainer process calls transfer.send in the same order):
    the message first, so the generator joins the transfer, then the transfer, then its ack.
    `cast` is unused: the transfer casts to the generator's serving dtype itself."""
    self.send(("push", int(version)))
    self.transfer.send(params)
    self.wait_for(("ack", int(version)), f"the push of version {version}")
    self.transfer.done()

  def wait_for(self, key, what: str, timeout_s: float = REPLY_TIMEOUT_S):
    deadline = time.time() + timeout_s
    with self._cond:
      while key not in self._acks:
        self._raise_error()
        if time.time() > deadline:
          raise PipelineError(f"{self.name} did not answer {what} in {timeout_s:.0f}s")
        self._cond.wait(timeout=0.2)
      return self._acks.pop(key)

  def check(self) -> None:
    with self._cond:
      self._raise_error()

  def _raise_error(self):
    if self._error is not None:
      raise PipelineError(f"{self.name} failed:\n{self._error}")

  def stop(self, timeout: float | None = 30.0) -> None:
    """Stops reading its stream (joined: the next reader of the stream, e.g. an evaluation's,
    must not lose a message to this one)."""
    self._stop.set()
    if self._reader is not None:
      self._reader.join(timeout=timeout)
      self._reader = None

  def _read(self):
    stream = out_stream(self.index)
    while not self._stop.is_set():
      try:
        msg = self.mailbox.receive(stream, timeout_s=1.0)
      except TimeoutError:
        continue
      except Exception as e:   # the service is going away (a peer died): say so, stop reading
        with self._cond:
          self._error = self._error or f"lost contact: {type(e).__name__}: {e}"
          self._cond.notify_all()
        return
      kind = msg[0]
      if kind == "samples":
        _, samples, counters = msg
        for name, value in counters.items():
          setattr(self.counters, name, value)
        for s in samples:
          if self.callback is not None:
            self.callback(s)
      elif kind == "error":
        with self._cond:
          self._error = msg[1]
          self._cond.notify_all()
        log.error("%s failed:\n%s", self.name, msg[1])
        return
      else:   # ("ack", version) | ("eval", tag, result) | ("stage", si)
        with self._cond:
          self._acks[msg[:2]] = msg[2:] if len(msg) > 2 else None
          self._cond.notify_all()


def rows_channel(mailbox: Mailbox, stage: int, follower: int, process: int) -> BulkChannel:
  """The leader's (process 0's) channel of training rows to trainer process `process`."""
  return BulkChannel(mailbox, f"stage{stage}/rows/{follower}", 0, process)


class LeaderRollouts(Rollouts):
  """Rollouts on the trainer leader: its generators are RemoteGenerators, and the other trainer
  processes (FollowerRollouts, processes `follower_processes`) get each batch's minibatches,
  each only the rows of the global batch array (laid out by `batch_sharding`) it holds."""

  def __init__(self, *, mailbox: Mailbox, follower_processes, stage: int, batch_sharding,
               **kwargs):
    super().__init__(**kwargs)
    self.mailbox, self.stage, self.batch_sharding = mailbox, stage, batch_sharding
    self.follower_processes = tuple(follower_processes)
    self.channels = [rows_channel(mailbox, stage, f, p)
                     for f, p in enumerate(self.follower_processes)]

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

  def close(self):
    super().close()   # the feeder first: no request may follow the end of the stage
    for g in self.generators:
      try:
        g.send(("end",))
      except Exception as e:   # a dead service: the processes are going down anyway
        log.warning("could not end %s: %s", g.name, e)


class FollowerBatch:
  """A batch as a follower knows it: how long the leader waited for it; its groups stay there."""

  def __init__(self, wait_s: float):
    self.groups, self.wait_s = (), wait_s


class FollowerRollouts:
  """Rollouts as trainer processes 1..T-1 see them (a train.rollout_source.RolloutSource): the
  leader's word that a batch is ready, then its minibatches, of which this process receives only
  the rows its own devices hold (parallel.bulk.LocalRows, which train.step.shard_batch takes), and
  their part of every push (the staging program runs on the whole trainer mesh)."""

  def __init__(self, *, mailbox: Mailbox, follower: int, process: int, stage: int, transfers,
               batch_timeout_s: float):
    self.mailbox, self.transfers = mailbox, transfers
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
    for transfer in self.transfers:
      transfer.send(params)
      transfer.done()
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


def remote_eval(layout, mailbox, transfer: WeightTransfer, params, tag: str, problems):
  """Held-out evaluation in multihost runs: generator 0 evaluates (its engine, its verifier
  pool); the weights reach it by the push's transfer. Every trainer process calls this (they
  all take part in the transfer); the leader gets the result, the others None."""
  if layout.is_leader:
    mailbox.send(in_stream(0), ("eval", tag, problems))
  transfer.send(params)
  if not layout.is_leader:
    return None
  gen = _eval_reader(mailbox, layout)
  result = gen.wait_for(("eval", tag), f"the {tag} evaluation")
  gen.stop()
  transfer.done()
  return result[0]


def wait_for_generators(layout, mailbox: Mailbox, timeout_s: float = REPLY_TIMEOUT_S) -> None:
  """The leader, once, before anything else goes to the generator processes: each says it is
  serving (it may still be starting up, e.g. importing or starting its verifier pool)."""
  for g, process in enumerate(layout.generator_processes):
    msg = mailbox.receive(out_stream(g), timeout_s,
                          what=f"generator {g} (process {process}) to start")
    if msg[0] == "error":
      raise PipelineError(f"generator {g} (process {process}) failed:\n{msg[1]}")
    if msg != ("ready",):
      raise PipelineError(f"generator {g} (process {process}): expected ready, got {msg[0]!r}")


def _eval_reader(mailbox, layout) -> RemoteGenerator:
  return RemoteGenerator(mailbox, 0, layout.generator_processes[0], None, None).start()


# ---- the generator side --------------------------------------------------------------------------

class _Outbox:
  """Finished samples of this process's GeneratorLoop, sent in small batches."""

  def __init__(self, mailbox: Mailbox, index: int):
    self.mailbox, self.stream = mailbox, out_stream(index)
    self._samples: list[Sample] = []
    self._lock = threading.Lock()
    self._last = time.time()

  def add(self, sample: Sample):
    with self._lock:
      self._samples.append(sample)

  def flush(self, loop=None, force: bool = False):
    with self._lock:
      if not self._samples or not (force or time.time() - self._last >= FLUSH_S):
        return
      samples, self._samples = self._samples, []
    self._last = time.time()
    c = None if loop is None else loop.counters
    counters = {} if c is None else dict(
        decode_time_s=c.decode_time_s, steps=c.steps, active_slot_steps=c.active_slot_steps,
        idle_time_s=c.idle_time_s, shared_prefix_hits=c.shared_prefix_hits)
    self.mailbox.send(self.stream, ("samples", samples, counters))


def _await_exit(mailbox: Mailbox, stream: str, timeout_s: float = ERROR_LINGER_S) -> None:
  """After sending its error, a generator process stays until the leader answers ("exit",) (or
  `timeout_s`): a process that exits at once can take the coordination service's connection down
  before the leader has read the error, which then arrives as "lost contact", without traceback."""
  deadline = time.time() + timeout_s
  while time.time() < deadline:
    try:
      msg = mailbox.receive(stream, max(0.1, deadline - time.time()))
    except TimeoutError:
      return
    if msg == ("exit",):
      return


def serve_generator(layout, mailbox: Mailbox, *, make_loop, make_eval, transfer: WeightTransfer,
                    poll_s: float = 0.01) -> None:
  """The life of a generator process: obey its "in" stream until ("exit",).

  make_loop(stage, params, version) -> a GeneratorLoop for that stage (not started);
  make_eval(tag, params, problems) -> an evaluation's result dict. An exception anywhere is sent
  to the leader with its traceback, then re-raised (the process exits with an error)."""
  g = layout.generator_index
  out = _Outbox(mailbox, g)
  stream = in_stream(g)
  loop = None
  # From here on this process answers (wait_for_generators): a transfer never starts before
  # its receiver is listening.
  mailbox.send(out.stream, ("ready",))
  try:
    while True:
      msg = mailbox.poll(stream)
      if msg is None:
        if loop is not None:
          loop.check()
          out.flush(loop)
        time.sleep(poll_s)
        continue
      kind = msg[0]
      if kind == "requests":
        if loop is None:   # sent before the stage ended: nobody waits for them any more
          continue
        for r in msg[1]:
          loop.submit(r)
      elif kind == "push":
        params = transfer.receive()
        loop.update_params(params, msg[1])
        mailbox.send(out.stream, ("ack", msg[1]))
      elif kind == "stage":
        _, stage, version = msg
        loop = make_loop(stage, transfer.receive(), version)
        loop.callback = out.add
        loop.start()
        log.info("generator %d: stage %d, policy version %d", g, stage, version)
        mailbox.send(out.stream, ("stage", stage))
      elif kind == "end":
        if loop is not None:
          loop.stop()
          out.flush(loop, force=True)
          loop = None
      elif kind == "eval":
        _, tag, problems = msg
        result = make_eval(tag, transfer.receive(), problems)
        mailbox.send(out.stream, ("eval", tag, result))
      elif kind == "exit":
        return
      else:
        raise ValueError(f"generator {g}: unknown message {kind!r}")
  except BaseException:
    tb = traceback.format_exc()
    log.error("generator %d failed:\n%s", g, tb)
    try:
      mailbox.send(out.stream, ("error", f"(process {layout.process_id})\n{tb}"))
      _await_exit(mailbox, stream)
    except Exception:
      pass
    raise
  finally:
    if loop is not None:
      try:
        loop.stop()
      except Exception:
        pass
