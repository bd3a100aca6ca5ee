"""The generator side of a many-host run (pipeline/remote.py has the trainer side): a generator
process obeys its "in" stream and answers on its "out" stream.

Its streams are named by its generator index and incarnation (parallel.liveness: how many times
that process id has started), so a relaunched process talks to the leader on fresh streams and
nothing the leader sent its predecessor reaches it. What it does is driven by the messages:

    ("stage", stage, version, uuid)   pull the weights (WeightTransfer offer `uuid`), start a
                                      GeneratorLoop for `stage`; answer ("stage", stage)
    ("requests", [Request, ...])      submit them; finished samples go back through the
                                      completions channel (their arrays device to device, the
                                      rest as a "bulk" message on the "out" stream), scored
                                      here with verifier.placement="generators"
    ("push", version, uuid)           pull the weights, update the loop in flight; ("ack", version)
    ("end",)                          stop the loop, send the last samples
    ("eval", tag, problems, uuid)     an evaluation on the pulled weights; ("eval", tag, result)
    ("exit",)                         return
so a restarted run, or a relaunched process, needs no state on the generator hosts.
"""
from __future__ import annotations

import logging
import threading
import time
import traceback

import numpy as np

from magistral_jax.generate.requests import Sample
from magistral_jax.parallel.bulk import BulkChannel
from magistral_jax.parallel.multihost import Mailbox
from magistral_jax.parallel.weight_transfer import WeightTransfer
from magistral_jax.pipeline.scoring import settled

log = logging.getLogger(__name__)

ERROR_LINGER_S = 60.0   # how long a failed generator process waits for the leader to read its error
FLUSH_S = 0.05   # a generator process sends its finished samples at least this often


def in_stream(g: int, incarnation: int) -> str:
  return f"gen{g}.{incarnation}/in"


def out_stream(g: int, incarnation: int) -> str:
  return f"gen{g}.{incarnation}/out"


def completions_channel(mailbox: Mailbox, g: int, incarnation: int, process: int,
                        leader: int) -> BulkChannel:
  """Generator g's completions to the leader: their arrays device to device, described on its
  "out" stream among its other messages (both ends build it the same way)."""
  return BulkChannel(mailbox, out_stream(g, incarnation), process, leader)


def pack_samples(items) -> tuple[dict[str, np.ndarray], list]:
  """Finished samples (or (sample, RewardResult) pairs) as a few flat arrays (their tokens,
  log-probs and versions, the bulk of them) and, per sample, the small rest."""
  samples = [x[0] if isinstance(x, tuple) else x for x in items]
  cat = lambda xs, dt: np.concatenate([np.asarray(x, dt).reshape(-1) for x in xs] or
                                      [np.zeros(0, dt)])
  arrays = {
      "prompt_lengths": np.asarray([len(s.prompt_tokens) for s in samples], np.int64),
      "lengths": np.asarray([len(s.tokens) for s in samples], np.int64),
      "prompt_tokens": cat([s.prompt_tokens for s in samples], np.int32),
      "tokens": cat([s.tokens for s in samples], np.int32),
      "logprobs": cat([s.logprobs for s in samples], np.float32),
      "versions": cat([s.versions for s in samples], np.int32),
      # All False for a sample without tool calls (Sample.tool_mask None).
      "tool_mask": cat([np.zeros(len(s.tokens), bool) if s.tool_mask is None else s.tool_mask
                        for s in samples], bool)}
  rest = [(s.request_id, s.sample_index, s.finish_reason, s.metadata, s.prompt_truncated,
           x[1] if isinstance(x, tuple) else None) for s, x in zip(samples, items)]
  return arrays, rest


def unpack_samples(arrays: dict[str, np.ndarray], rest: list) -> list:
  """pack_samples' items back."""
  out = []
  p_ends = np.cumsum(arrays["prompt_lengths"])
  ends = np.cumsum(arrays["lengths"])
  for i, (rid, index, finish, metadata, truncated, result) in enumerate(rest):
    p0, p1 = (p_ends[i - 1] if i else 0), p_ends[i]
    t0, t1 = (ends[i - 1] if i else 0), ends[i]
    tool = arrays["tool_mask"][t0:t1]
    s = Sample(rid, index, arrays["prompt_tokens"][p0:p1].tolist(),
               arrays["tokens"][t0:t1].tolist(), arrays["logprobs"][t0:t1].copy(),
               arrays["versions"][t0:t1].copy(), finish, metadata, truncated,
               tool.copy() if tool.any() else None)
    out.append(s if result is None else (s, result))
  return out


class _Outbox:
  """Finished samples of this process's GeneratorLoop, sent in small batches through its
  completions channel."""

  def __init__(self, mailbox: Mailbox, stream: str, channel: BulkChannel):
    self.mailbox, self.stream, self.channel = mailbox, stream, channel
    self._samples: list = []   # Sample, or (Sample, RewardResult) when scored here
    self._lock = threading.Lock()
    self._last = time.time()

  def add(self, sample):
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
    if loop is not None and loop.tools is not None:   # the tool calls' counts, for the meter
      counters["tool_counts"] = dict(loop.tools.counts)
    arrays, rest = pack_samples(samples)
    self.channel.send(arrays, ("samples", rest, counters))


def _await_exit(mailbox: Mailbox, stream: str, timeout_s: float = ERROR_LINGER_S) -> None:
  """After sending its error, a generator process stays until the leader answers ("exit",) (or
  `timeout_s`): a process that exits at once can take its key-value writes with it before the
  leader has read the error, which then arrives as a lost process, without traceback."""
  deadline = time.time() + timeout_s
  while time.time() < deadline:
    try:
      msg = mailbox.receive(stream, max(0.1, deadline - time.time()))
    except TimeoutError:
      return
    if msg == ("exit",):
      return


def scored_by(score, add):
  """A loop callback that scores each finished sample (`score(sample)` -> Future[RewardResult],
  a verifier pool's submit) and hands `add` the pair once it is scored."""
  def on_sample(sample: Sample):
    fut = score(sample)   # blocks while the pool's queue is full: generation waits for scoring

    fut.add_done_callback(lambda f: add((sample, settled(f))))
  return on_sample


def serve_generator(layout, mailbox: Mailbox, *, incarnation: int, make_loop, make_eval,
                    transfer: WeightTransfer, score=None, poll_s: float = 0.01) -> None:
  """The life of a generator process: obey its "in" stream until ("exit",).

  make_loop(stage, params, version) -> a GeneratorLoop for that stage (not started);
  make_eval(tag, params, problems) -> an evaluation's result dict; score: None (the leader
  scores) or score(sample) -> Future[RewardResult] (verifier.placement="generators": samples go
  back scored, as (sample, result)). An exception anywhere is sent to the leader with its
  traceback, then re-raised (the process exits with an error)."""
  g = layout.generator_index
  channel = completions_channel(mailbox, g, incarnation, layout.process_id,
                                layout.trainer_processes[0])
  stream, out = in_stream(g, incarnation), _Outbox(mailbox, out_stream(g, incarnation), channel)
  loop = None
  # From here on this process answers: the leader offers no weights before it reads this.
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
        _, version, uuid = msg
        params = transfer.receive(uuid)
        if loop is not None:
          loop.update_params(params, version)
        mailbox.send(out.stream, ("ack", version))
      elif kind == "stage":
        _, stage, version, uuid = msg
        if loop is not None:   # a stage start replaces the running one
          loop.stop()
        loop = make_loop(stage, transfer.receive(uuid), version)
        loop.callback = out.add if score is None else scored_by(score, out.add)
        loop.start()
        log.info("generator %d: stage %d, policy version %d", g, stage, version)
        mailbox.send(out.stream, ("stage", stage))
      elif kind == "end":
        if loop is not None:
          loop.stop()
          out.flush(loop, force=True)
          loop = None
      elif kind == "eval":
        _, tag, problems, uuid = msg
        result = make_eval(tag, transfer.receive(uuid), problems)
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
