"""The trainer leader's view of a generator process (pipeline.remote.RemoteGenerator), with
stand-ins for the mailbox, the liveness watch and the completions channel: whatever goes wrong
while its stream is read, the generator is lost (its groups go elsewhere, a relaunch rejoins),
never left serving with nobody reading it. The same with real processes:
tests/parallel/test_multihost.py."""
import queue
import threading
import time

import pytest

from magistral_jax.pipeline.remote import GeneratorLost, RemoteGenerator

TIMEOUT_S = 0.5   # the heartbeat timeout here


class Mailbox:
  def __init__(self):
    self.inbox, self.sent = queue.Queue(), []

  def receive(self, stream, timeout_s, **_):
    try:
      return self.inbox.get(timeout=min(timeout_s, 0.05))
    except queue.Empty:
      raise TimeoutError(stream) from None

  def send(self, stream, message):
    self.sent.append((stream, message))


class Watch:
  """The generator beats until `die()`."""

  def __init__(self):
    self.dead_at = None

  def die(self):
    self.dead_at = time.time()

  def silent_s(self, process):
    return 0.0 if self.dead_at is None else time.time() - self.dead_at

  def incarnation(self, process):
    return 1


class Channel:
  """A completions channel whose pull never completes (its sender died first): it waits as
  BulkChannel.open does, calling `between`, or ignores it (`stuck`, a reader that cannot help)."""

  def __init__(self, stuck=False):
    self.stuck, self.release = stuck, threading.Event()

  def open(self, msg, between=None):
    while not self.release.wait(0.02):
      if between is not None and not self.stuck:
        between()
    return {}, (None, [], {})


def serving(channel, callback=None):
  mailbox, watch = Mailbox(), Watch()
  g = RemoteGenerator(mailbox, 0, 2, transfer=None, watch=watch, timeout_s=TIMEOUT_S)
  g.incarnation, g.serving, g._completions, g.callback = 1, True, channel, callback
  reader = threading.Thread(target=g._read, args=(1,), daemon=True)
  reader.start()
  return g, mailbox, watch, reader


def wait_until(cond, timeout_s=10.0):
  deadline = time.time() + timeout_s
  while not cond():
    assert time.time() < deadline
    time.sleep(0.01)


def test_a_generator_dead_with_its_completions_unpulled_is_lost_by_its_heartbeats():
  g, mailbox, watch, _ = serving(Channel())
  mailbox.inbox.put(("bulk", None, None, 0, "addr"))
  time.sleep(0.2)
  assert g.serving   # alive: the pull just takes its time
  watch.die()
  wait_until(lambda: not g.serving)
  assert "stopped sending heartbeats" in g.lost_reason
  assert mailbox.sent[-1][1] == ("exit",)   # told to exit, in case it is hung, not dead
  g._closed.set()


def test_a_push_ack_awaited_while_the_reader_is_stuck_ends_with_the_heartbeats():
  channel = Channel(stuck=True)
  g, mailbox, watch, _ = serving(channel)
  mailbox.inbox.put(("bulk", None, None, 0, "addr"))
  watch.die()
  t = time.time()
  with pytest.raises(GeneratorLost, match="stopped sending heartbeats"):
    g.wait_for(("ack", 3), "the push of version 3", timeout_s=60)
  assert time.time() - t < 5 and not g.serving
  channel.release.set()
  g._closed.set()


def test_a_fault_in_handling_a_message_loses_the_generator_and_says_so(caplog, monkeypatch):
  import magistral_jax.pipeline.remote as remote
  monkeypatch.setattr(remote, "unpack_samples", lambda arrays, rest: ["a sample"])

  def callback(sample, result=None):
    raise RuntimeError("boom in the pipeline's callback")

  channel = Channel()
  channel.release.set()   # the pull completes
  g, mailbox, _, reader = serving(channel, callback)
  mailbox.inbox.put(("bulk", None, None, 0, "addr"))
  wait_until(lambda: not g.serving)
  assert "could not be handled: RuntimeError: boom" in g.lost_reason
  assert "boom in the pipeline's callback" in caplog.text   # with its traceback
  g._closed.set()
  reader.join(timeout=5)
  assert not reader.is_alive()
