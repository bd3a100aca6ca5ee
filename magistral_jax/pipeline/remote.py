"""The pipeline across processes, the trainer's side (parallel/multihost.py has the roles;
pipeline/generator_service.py the generator's side).

    trainer leader (process 0)                          generator process g
    Rollouts over RemoteGenerator g  --- "in" stream -->  serve_generator: a GeneratorLoop on
      (prompts, verifier pool, groups, batches)          its own devices, unchanged
                                     <-- "out" stream --  completions (tokens, log-probs,
                                                          versions), acks, errors + traceback
    push: WeightTransfer.stage on every trainer process, then the leader offers the copy to
          each generator serving, which pulls it (device to device) and updates its loop in
          flight: in-flight sequences go on with their KV cache
    the other trainer processes: pipeline/trainer_rollouts.py (LeaderRollouts, FollowerRollouts)

The streams are parallel.multihost.Mailbox streams (JAX's coordination service); the
completions' arrays do not go through them but through a parallel.bulk.BulkChannel (device to
device, jax.experimental.transfer), described by a message on the "out" stream.

A generator process may die. Its RemoteGenerator notices within the heartbeat timeout
(parallel.liveness) or at its error message, stops serving and says which process was lost;
Rollouts hands the groups it had in flight to the others (pipeline.rollouts). A relaunched
process of the same id (a new incarnation) rejoins: the leader reads its "ready", gives it the
current weights (the leader's staged copy: no other trainer process takes part), the running
stage and any newer push, and it serves again. The run stops only when no generator has served
for `pipeline.generator_rejoin_s`.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
import traceback
from typing import Callable

import jax

from magistral_jax.generate.counters import LoopCounters
from magistral_jax.generate.requests import Request, Sample
from magistral_jax.generate.weights import Weights
from magistral_jax.model import transformer as T
from magistral_jax.parallel.bulk import BulkChannel
from magistral_jax.parallel.multihost import Mailbox, coordination_client
from magistral_jax.parallel.weight_transfer import WeightTransfer
from magistral_jax.pipeline.errors import PipelineError
from magistral_jax.pipeline.generator_service import (completions_channel, in_stream, out_stream,
                                                      unpack_samples)

log = logging.getLogger(__name__)

# How long a trainer waits for a generator process to acknowledge a push or answer an
# evaluation before it stops with an error naming the process (a dead process is found sooner,
# by its heartbeats).
REPLY_TIMEOUT_S = 600.0


@dataclasses.dataclass
class ToolCounts:
  """A generator process's tool-call counts (generate/tool_turns.ToolTurns.counts), as its last
  completions reported them: what pipeline/generator_meter.py reads of a local loop's tools."""
  counts: collections.Counter


class GeneratorLost(PipelineError):
  """The generator process stopped serving: dead, hung, restarted or failed."""


def weight_transfer(model_cfg, mesh, rules, trainer_devices) -> WeightTransfer:
  """The push from the trainer to a generator engine on `mesh` (its param layout and serving
  dtype, generate.weights.Weights), built the same way on both ends."""
  weights = Weights(model_cfg, mesh, rules)
  dtype = model_cfg.jnp_serving_param_dtype
  abstract = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, dtype), T.param_shapes(model_cfg))
  return WeightTransfer(abstract, weights.param_shardings, trainer_devices)


# ---- the trainer side --------------------------------------------------------------------------

class RemoteGenerator:
  """A generator process as the trainer leader sees it, for the whole run, across its
  incarnations; as Rollouts sees a GeneratorLoop (the generate.protocol.Generator it implements):
  submit requests, samples back through `callback`, `serving`, the loop's counters (those the
  process sends with its samples). One reader thread per incarnation reads its "out" stream and
  watches its heartbeat."""

  def __init__(self, mailbox: Mailbox, index: int, process: int, transfer: WeightTransfer,
               watch, timeout_s: float):
    self.mailbox, self.index, self.process = mailbox, index, process
    self.transfer, self.watch, self.timeout_s = transfer, watch, timeout_s
    self.engine = None   # the running stage's engine: limits and layout only, never run here
    self.stage: int | None = None
    self.callback: Callable[[Sample], None] | None = None
    self.counters = LoopCounters()
    self.tools: ToolCounts | None = None   # the process's tool-call counts, when it calls tools
    self.incarnation = 0
    self.serving = False
    self.lost_reason: str | None = None
    self._acks: dict = {}
    self._cond = threading.Condition()
    self._reader: threading.Thread | None = None
    self._completions: BulkChannel | None = None   # the incarnation's completions channel
    self._closed = threading.Event()

  @property
  def name(self) -> str:
    return f"generator {self.index} (process {self.process})"

  def send(self, message) -> None:
    self.mailbox.send(in_stream(self.index, self.incarnation), message)

  # -- life ----------------------------------------------------------------------------------
  def connect(self, timeout_s: float = REPLY_TIMEOUT_S) -> "RemoteGenerator":
    """The run's start: waits for the process's first heartbeat and its "ready"."""
    inc = int(coordination_client("RemoteGenerator").blocking_key_value_get(
        f"incarnation/{self.process}", int(1000 * timeout_s)))
    self._join(inc, timeout_s)
    return self

  def _join(self, inc: int, timeout_s: float) -> None:
    """Reads incarnation `inc`'s "ready" and starts reading its stream (serving from then on)."""
    self._await_ready(inc, timeout_s)
    self._serve(inc)

  def _await_ready(self, inc: int, timeout_s: float) -> None:
    """Incarnation `inc`'s first message: "ready" (GeneratorLost for its error or its death)."""
    msg = self.mailbox.receive(out_stream(self.index, inc), timeout_s,
                               what=f"{self.name} to start", between=lambda: self._check_alive(inc))
    if msg[0] == "error":
      raise GeneratorLost(f"{self.name} failed:\n{msg[1]}")
    if msg != ("ready",):
      raise GeneratorLost(f"{self.name}: expected ready, got {str(msg)[:2000]}")

  def _serve(self, inc: int) -> None:
    """Incarnation `inc` serves: its stream is read from now on."""
    with self._cond:
      self.incarnation, self.serving, self.lost_reason = inc, True, None
      self._acks.clear()
    self._completions = completions_channel(self.mailbox, self.index, inc, self.process,
                                            jax.process_index())
    self._reader = threading.Thread(target=self._read, args=(inc,), daemon=True,
                                    name=f"remote-gen{self.index}.{inc}")
    self._reader.start()

  def _check_alive(self, inc: int) -> None:
    silent = self.watch.silent_s(self.process)
    if self.watch.incarnation(self.process) > inc:
      raise GeneratorLost(f"{self.name} was relaunched (incarnation "
                          f"{self.watch.incarnation(self.process)} replaces {inc})")
    if silent > self.timeout_s:
      raise GeneratorLost(f"{self.name} stopped sending heartbeats {silent:.0f}s ago")

  def lose(self, reason: str, inc: int | None = None) -> None:
    """Stops serving (Rollouts reassigns its groups); tells the process to exit, in case it is
    alive but hung, so that its relaunch can rejoin. `inc`: only if that incarnation serves."""
    with self._cond:
      if not self.serving or inc not in (None, self.incarnation):
        return
      self.serving, self.lost_reason = False, reason
      self._cond.notify_all()
    log.error("%s lost: %s. The run goes on with the other generators; a relaunched process "
              "rejoins.", self.name, reason)
    try:
      self.send(("exit",))
    except Exception:
      pass

  def begin_stage(self, stage: int, engine) -> None:
    """A stage starts: the engine its samples come from; a serving process starts the stage on
    the latest staged weights (the caller holds transfer.lock)."""
    self.stage, self.engine = stage, engine
    if self.serving:
      version, uuid = self.transfer.offer(REPLY_TIMEOUT_S)
      self.send(("stage", stage, version, uuid))

  def end_stage(self) -> None:
    self.stage, self.callback = None, None
    if self.serving:
      try:
        self.send(("end",))
      except Exception as e:   # a dead service: the processes are going down anyway
        log.warning("could not end the stage on %s: %s", self.name, e)

  def close(self) -> None:
    """The run's end: the process exits, the reader stops."""
    self._closed.set()
    try:
      self.send(("exit",))
    except Exception as e:
      log.warning("could not end %s: %s", self.name, e)
    if self._reader is not None:
      self._reader.join(timeout=5)

  # -- Generator -----------------------------------------------------------------------------
  def start(self) -> "RemoteGenerator":
    return self

  def stop(self, timeout: float | None = 30.0) -> None:
    """The stage's pipeline closes (LeaderRollouts.close ends the stage)."""

  def submit(self, request: Request) -> None:
    self.send(("requests", [request]))

  def check(self) -> None:
    """Nothing to raise: a lost generator stops serving instead (Rollouts watches `serving`)."""

  def push_to(self, version: int, uuid: int) -> None:
    self.send(("push", int(version), int(uuid)))

  def wait_for(self, key, what: str, timeout_s: float = REPLY_TIMEOUT_S):
    """The reply `key` of this incarnation; GeneratorLost once it stops serving."""
    deadline = time.time() + timeout_s
    inc = self.incarnation
    while True:
      with self._cond:
        if self.incarnation != inc:
          raise GeneratorLost(f"{self.name} was relaunched while waiting for {what}")
        if key in self._acks:
          return self._acks.pop(key)
        if not self.serving:
          raise GeneratorLost(f"{self.name} lost while waiting for {what}: {self.lost_reason}")
        if time.time() > deadline:
          raise PipelineError(f"{self.name} did not answer {what} in {timeout_s:.0f}s")
        self._cond.wait(timeout=0.2)
      try:   # the reader watches too, between messages; this does not rely on it alone
        self._check_alive(inc)
      except GeneratorLost as e:
        self.lose(str(e), inc)

  # -- the reader ----------------------------------------------------------------------------
  def _read(self, inc: int):
    stream = out_stream(self.index, inc)
    while not self._closed.is_set() and self.serving and self.incarnation == inc:
      try:
        self._check_alive(inc)
        msg = self.mailbox.receive(stream, timeout_s=1.0)
      except TimeoutError:
        continue
      except GeneratorLost as e:
        self.lose(str(e), inc)
        break
      except Exception as e:   # the service is going away (the leader is stopping)
        self.lose(f"lost contact: {type(e).__name__}: {e}", inc)
        break
      try:
        if not self._handle(msg, inc):
          break
      except GeneratorLost as e:
        self.lose(str(e), inc)
        break
      except Exception as e:   # a fault of ours: the generator is let go, the run goes on
        log.error("%s: handling %s failed: %s", self.name, str(msg)[:200], traceback.format_exc())
        self.lose(f"its message could not be handled: {type(e).__name__}: {e}", inc)
        break
    self._watch_for_rejoin(inc)

  def _handle(self, msg, inc: int) -> bool:
    """One message of incarnation `inc`'s stream; False when it ends the incarnation."""
    kind = msg[0]
    if kind == "bulk":   # completions: their arrays come through the completions channel
      # A pull from a process that died before its buffer was read never completes: the
      # liveness check ends it (bulk.BulkChannel.open); one that dies during it fails it.
      try:
        arrays, (_, rest, counters) = self._completions.open(
            msg, between=lambda: self._check_alive(inc))
      except GeneratorLost:
        raise
      except Exception as e:
        raise GeneratorLost(f"{self.name}: its completions could not be pulled: "
                            f"{type(e).__name__}: {e}") from e
      samples = unpack_samples(arrays, rest)
      if "tool_counts" in counters:
        self.tools = ToolCounts(collections.Counter(counters.pop("tool_counts")))
      for name, value in counters.items():
        setattr(self.counters, name, value)
      callback = self.callback
      for s in samples:   # (sample, result) when the generator process scored it
        if callback is not None:
          callback(*s) if isinstance(s, tuple) else callback(s)
    elif kind == "error":
      self.lose(f"failed:\n{msg[1]}", inc)
      return False
    else:   # ("ack", version) | ("eval", tag, result) | ("stage", si)
      with self._cond:
        self._acks[msg[:2]] = msg[2:] if len(msg) > 2 else None
        self._cond.notify_all()
    return True

  def _watch_for_rejoin(self, lost_inc: int):
    """After a loss: waits for a relaunched process (a newer incarnation beating), brings it in."""
    while not self._closed.is_set():
      inc = self.watch.incarnation(self.process)
      if inc > lost_inc and self.watch.silent_s(self.process) < self.timeout_s:
        try:
          self._rejoin(inc)
          return
        except GeneratorLost as e:
          log.warning("%s: incarnation %d did not rejoin: %s", self.name, inc, e)
          lost_inc = inc
        except Exception as e:
          log.warning("%s: incarnation %d did not rejoin: %s: %s", self.name, inc,
                      type(e).__name__, e)
          lost_inc = inc
      time.sleep(0.5)

  def _rejoin(self, inc: int):
    """Incarnation `inc`: its "ready", the running stage on the current weights, then any push
    made meanwhile, and it serves (samples then reach the pipeline again)."""
    log.info("%s: incarnation %d is up; rejoining it", self.name, inc)
    stream = out_stream(self.index, inc)
    wait = dict(timeout_s=REPLY_TIMEOUT_S, between=lambda: self._check_alive(inc))
    self._await_ready(inc, REPLY_TIMEOUT_S)
    send = lambda m: self.mailbox.send(in_stream(self.index, inc), m)
    version = None
    with self.transfer.lock:
      if self.stage is not None and self.transfer.latest is not None:
        version, uuid = self.transfer.offer(REPLY_TIMEOUT_S)
        send(("stage", self.stage, version, uuid))
    if version is not None:
      self._expect(stream, ("stage", self.stage), wait)
    with self.transfer.lock:   # no push may slip between this check and serving
      while (version is not None and self.stage is not None
             and self.transfer.latest[0] != version):
        version, uuid = self.transfer.offer(REPLY_TIMEOUT_S)
        send(("push", version, uuid))
        self._expect(stream, ("ack", version), wait)
      self._serve(inc)
    log.info("%s rejoined (incarnation %d)%s", self.name, inc,
             f" at policy version {version}" if version is not None else "")

  def _expect(self, stream: str, want: tuple, wait: dict) -> None:
    """The next message of `stream` (this thread reads it while the process rejoins)."""
    while True:
      msg = self.mailbox.receive(stream, what=f"{self.name}'s {want[0]}", **wait)
      if msg[0] == "bulk":   # completions of a stage start racing the push: nobody waits
        continue
      if msg[0] == "error":
        raise GeneratorLost(f"failed:\n{msg[1]}")
      if tuple(msg[:2]) != want:
        raise GeneratorLost(f"expected {want}, got {str(msg)[:2000]}")
      return


def remote_eval(layout, gens: list[RemoteGenerator] | None, transfer: WeightTransfer, params,
                version: int, tag: str, problems, wait_s: float):
  """Held-out evaluation in multihost runs, on the first generator serving (its engine, its
  verifier pool), another if it is lost meanwhile; the weights reach it as a push's do. Every
  trainer process calls this (they all stage the weights); the leader gets the result, the
  others None. `wait_s`: how long to wait for a generator to serve when none does."""
  with transfer.lock:
    transfer.stage(params, version)
  if not layout.is_leader:
    return None
  deadline = time.time() + wait_s
  while True:
    gen = next((g for g in gens if g.serving), None)
    if gen is None:
      if time.time() > deadline:
        raise PipelineError(f"no generator process served for {wait_s:.0f}s: the {tag} "
                            "evaluation cannot run (lost: " + "; ".join(
                                f"{g.name}: {g.lost_reason}" for g in gens) + ")")
      time.sleep(0.5)
      continue
    # The lock covers the offer only: a generator rejoining during the evaluation (it gets the
    # same weights, the latest staged) need not wait for it.
    with transfer.lock:
      _, uuid = transfer.offer(REPLY_TIMEOUT_S)
      gen.send(("eval", tag, problems, uuid))
    try:
      return gen.wait_for(("eval", tag), f"the {tag} evaluation")[0]
    except GeneratorLost as e:
      log.warning("%s; the %s evaluation moves to another generator", e, tag)
