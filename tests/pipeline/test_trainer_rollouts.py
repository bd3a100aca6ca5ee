"""The trainer leader's weight push (LeaderRollouts.push), with stand-ins for the transfer and the
remote generators: it returns once the copy is offered, and waits for the generators' acks only
before the next push replaces the staged copy, or at the stage's end."""
import threading

from magistral_jax.pipeline.remote import GeneratorLost
from magistral_jax.pipeline.trainer_rollouts import LeaderRollouts


class Transfer:
  def __init__(self, log):
    self.log, self.lock, self.offers = log, threading.RLock(), 0

  def stage(self, params, version):
    self.settle()   # as WeightTransfer.stage does on the leader
    self.log.append(("stage", version))

  def offer(self, timeout_s):
    self.offers += 1
    return None, self.offers


class Generator:
  def __init__(self, name, log, *, lost_at=None):
    self.name, self.log, self.serving, self.incarnation = name, log, True, 1
    self.lost_at = lost_at

  def push_to(self, version, uuid):
    self.log.append((self.name, "push", version))

  def wait_for(self, key, what, timeout_s=0):
    if key[1] == self.lost_at:
      self.serving = False
      raise GeneratorLost(f"{self.name} lost while waiting for {what}")
    self.log.append((self.name, "acked", key[1]))

  def end_stage(self):
    self.log.append((self.name, "end"))


def leader(generators, log):
  r = LeaderRollouts.__new__(LeaderRollouts)   # only what push and close use
  r.transfer, r.generators, r._unacked = Transfer(log), generators, []
  r.transfer.settle = r._await_acks   # as __init__ sets it
  return r


def test_the_push_returns_before_the_acks_which_come_before_the_next_stage(monkeypatch):
  log = []
  gens = [Generator("g0", log), Generator("g1", log, lost_at=2), Generator("g2", log)]
  r = leader(gens, log)
  r.push({}, 1)
  assert log == [("stage", 1), ("g0", "push", 1), ("g1", "push", 1), ("g2", "push", 1)]
  log.clear()
  gens[2].incarnation = 2   # lost and rejoined since: it got the latest weights then
  r.push({}, 2)
  assert log == [("g0", "acked", 1), ("g1", "acked", 1), ("stage", 2), ("g0", "push", 2),
                 ("g1", "push", 2), ("g2", "push", 2)]
  log.clear()
  # g1 is lost before it acks version 2: a warning, and the rest goes on.
  monkeypatch.setattr("magistral_jax.pipeline.rollouts.Rollouts.close", lambda self: None)
  r.close()
  assert log == [("g0", "acked", 2), ("g2", "acked", 2), ("g0", "end"), ("g1", "end"),
                 ("g2", "end")]
  assert r._unacked == [] and not gens[1].serving
  r.transfer.stage({}, 3)   # e.g. an evaluation's after the stage: nothing left to wait for
  assert log[-1] == ("stage", 3)
