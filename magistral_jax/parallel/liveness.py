"""Which processes of a many-host run are alive, and what happens when one is not.

A run of many processes starts JAX's coordination service in recoverable mode
(`jax_enable_recoverability`, parallel/multihost.initialize): a generator process may die and a
relaunched one take its place without stopping the others. In that mode the service no longer
stops the survivors when a process dies, nor tells them, so this module does:

- every process writes a heartbeat, `liveness/<process>` = "<incarnation>:<count>", into the
  service's key-value store every HEARTBEAT_S (`Heartbeat`), and "<incarnation>:left" when it
  ends normally (multihost.leave). The incarnation counts the starts of
  that process id (`incarnation/<process>`, incremented once per start): a relaunched process
  is told apart from the one it replaces;
- `Watch` reads every heartbeat once a HEARTBEAT_S on one thread, and says for each process its
  incarnation and how long its count has not moved (measured on the watcher's clock: hosts'
  clocks need not agree);
- `stop_on_dead_trainers`: a trainer process whose peer trainer stopped beating stops at once,
  with an error naming the dead process (the train step's collectives cannot go on without it;
  the run resumes from its last checkpoint when relaunched). The exit is short and bounded: the
  registered cleanups (verifier pools) get CLEANUP_S, then the process exits with
  EXIT_PEER_LOST, whatever its main thread is blocked in.
The trainer leader hosts the service: when it dies, the others lose the service and JAX stops
them (its client aborts once its own heartbeats to the service fail).
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import Callable

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0
CLEANUP_S = 5.0
EXIT_PEER_LOST = 75

_cleanups: list[Callable[[], None]] = []


def at_fatal_exit(fn: Callable[[], None]) -> None:
  """`fn` runs (bounded by CLEANUP_S, all together) before a fatal exit of this process."""
  _cleanups.append(fn)


def fatal_exit(message: str) -> None:
  """Logs `message`, runs the registered cleanups for at most CLEANUP_S, and exits the process
  with EXIT_PEER_LOST (os._exit: the main thread may be blocked in a collective forever)."""
  log.error(message)
  print(f"FATAL: {message}", file=sys.stderr, flush=True)
  def clean():
    for fn in list(_cleanups):
      try:
        fn()
      except Exception as e:
        log.warning("cleanup before exit failed: %s", e)
  t = threading.Thread(target=clean, daemon=True)
  t.start()
  t.join(CLEANUP_S)
  logging.shutdown()
  os._exit(EXIT_PEER_LOST)


class Heartbeat:
  """This process's heartbeat (see the module docstring); started once per process."""

  def __init__(self, client, process: int, interval_s: float = HEARTBEAT_S):
    self.client, self.process, self.interval_s = client, process, interval_s
    self.incarnation = int(client.key_value_increment(f"incarnation/{process}", 1))
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
    self._thread.start()

  def _run(self):
    n = 0
    while not self._stop.is_set():
      try:
        self.client.key_value_set(f"liveness/{self.process}", f"{self.incarnation}:{n}",
                                  allow_overwrite=True)
      except Exception as e:   # the service is gone: JAX's own client stops this process
        log.debug("heartbeat: %s", e)
      n += 1
      self._stop.wait(self.interval_s)

  def stop(self):
    """Stops the thread, joined (as Watch.stop), without a last word."""
    self._stop.set()
    self._thread.join(timeout=5)

  def leave(self):
    """A normal end of this process: its heartbeat stops, marked "left" (not dead)."""
    self.stop()
    try:
      self.client.key_value_set(f"liveness/{self.process}", f"{self.incarnation}:left",
                                allow_overwrite=True)
    except Exception as e:
      log.debug("heartbeat: %s", e)


class Watch:
  """Every process's heartbeat as this process sees it (see the module docstring)."""

  def __init__(self, client, interval_s: float = HEARTBEAT_S):
    self.client, self.interval_s = client, interval_s
    self._seen: dict[int, tuple[str, float]] = {}   # process -> (value, when it last changed)
    self._t0 = time.monotonic()
    self._lock = threading.Lock()
    self._listeners: list[Callable[["Watch"], None]] = []
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, name="liveness-watch", daemon=True)
    self._thread.start()

  def listen(self, fn: Callable[["Watch"], None]) -> None:
    """fn(watch) after every read of the heartbeats, on the watch's thread."""
    self._listeners.append(fn)

  def _run(self):
    while not self._stop.is_set():
      try:
        values = self.client.key_value_dir_get("liveness/")
      except Exception as e:   # the service is gone: JAX's own client stops this process
        log.debug("liveness watch: %s", e)
        values = []
      now = time.monotonic()
      with self._lock:
        for key, value in values:
          p = int(key.rstrip("/").rsplit("/", 1)[-1])
          if self._seen.get(p, ("",))[0] != value:
            self._seen[p] = (value, now)
      for fn in list(self._listeners):
        fn(self)
      self._stop.wait(self.interval_s)

  def incarnation(self, process: int) -> int:
    """The incarnation of `process` last seen beating (0: never seen)."""
    with self._lock:
      value = self._seen.get(process, ("0:0",))[0]
    return int(value.split(":")[0])

  def left(self, process: int) -> bool:
    """`process` ended normally (Heartbeat.leave)."""
    with self._lock:
      return self._seen.get(process, ("",))[0].endswith(":left")

  def silent_s(self, process: int) -> float:
    """Seconds since `process`'s heartbeat last moved (since the watch started, if never seen)."""
    with self._lock:
      seen = self._seen.get(process)
    return time.monotonic() - (seen[1] if seen else self._t0)

  def stop(self):
    """Stops the thread (joined: no read of the store may be under way while JAX's client shuts
    down, which aborts the process)."""
    self._stop.set()
    if self._thread is not threading.current_thread():
      self._thread.join(timeout=5)


def stop_on_dead_trainers(watch: Watch, trainers, me: int, timeout_s: float) -> None:
  """This trainer process stops (fatal_exit) once another trainer process has been silent for
  `timeout_s`."""
  others = [p for p in trainers if p != me]

  def check(w: Watch):
    for p in others:
      silent = w.silent_s(p)
      if silent > timeout_s and not w.left(p):
        fatal_exit(f"trainer process {p} stopped sending heartbeats {silent:.0f}s ago (dead or "
                   f"hung): process {me} stops, since the train step cannot go on without it. "
                   "Relaunch the run on its workdir to resume from the last checkpoint.")

  watch.listen(check)
