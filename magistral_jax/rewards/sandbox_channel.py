"""The conversation with a sandboxed program that answers requests (the Python candidate of the
assert harness, rewards/code_asserts.py): one request line in, one answer line out, every write
and read bounded by the run's deadline and output cap.
"""
from __future__ import annotations

import os
import selectors
import subprocess
import time

from magistral_jax.rewards import run_judge, run_tree
from magistral_jax.rewards.run_tree import CpuWatch
from magistral_jax.rewards.sandbox_limits import Limits


class Channel:
  """A line-based conversation with a program started by `Sandbox.start`: we write one request
  line, it answers one line on stdout. Every write and read stops at the deadline (the run's
  backstop) and at the output cap; stdout and stderr are drained while we write, so a program
  that writes instead of reading cannot block us; stderr is drained all along (the first
  `err_cap` bytes kept). Any failure (deadline, cap, exit, closed pipe) kills the program and
  raises Channel.Closed, whose `fault` says when the deadline was the host's doing."""

  class Closed(Exception):
    def __init__(self, why: str, fault: str | None = None):
      super().__init__(why)
      self.fault = fault

  def __init__(self, proc: subprocess.Popen, start: float, limits: Limits, err_cap: int = 4096,
               line_cap: int | None = None):
    self.proc, self.start, self.limits, self.err_cap = proc, start, limits, err_cap
    self.line_cap = line_cap        # the longest answer line read (None: the output cap)
    self.deadline = start + limits.backstop_s
    self.group = getattr(proc, "run_group", None)     # its cgroup (Sandbox.start), or None
    self.watch = CpuWatch(proc.pid, limits.cpu_s, self.group,
                          getattr(proc, "run_memory_mb", None))
    self.cap = limits.max_output_bytes
    self.err = bytearray()
    self._buf = bytearray()
    self._read_total = self._err_total = 0
    self._in = proc.stdin.fileno()
    self._sel = selectors.DefaultSelector()
    self._sel.register(proc.stdout.fileno(), selectors.EVENT_READ, "out")
    self._sel.register(proc.stderr.fileno(), selectors.EVENT_READ, "err")

  def request(self, line: bytes) -> bytes:
    """Sends one line and reads the answer line."""
    data = memoryview(line + b"\n")
    try:
      self._sel.register(self._in, selectors.EVENT_WRITE, "in")
    except (ValueError, OSError):
      self._fail("the program closed its input or exited")
    try:
      while data:
        for key, _ in self._select():
          if key.data != "in":
            self._drain(key)
            continue
          try:
            data = data[os.write(self._in, data[:1 << 16]):]
          except BlockingIOError:
            pass
          except OSError:
            self._fail("the program closed its input or exited")
    finally:
      try:
        self._sel.unregister(self._in)
      except (KeyError, ValueError, OSError):
        pass
    return self.read_line()

  def read_line(self) -> bytes:
    while b"\n" not in self._buf:
      if self.line_cap is not None and len(self._buf) > self.line_cap:
        self._fail(f"an answer line over {self.line_cap} bytes")
      for key, _ in self._select():
        self._drain(key)
    line, _, rest = bytes(self._buf).partition(b"\n")
    self._buf = bytearray(rest)
    return line

  def _select(self):
    left = self.deadline - time.monotonic()
    if self.watch.check():
      self._fail("memory limit (the process tree)" if self.watch.over_memory
                 else "time limit (CPU)")
    if left <= 0:
      _, fault = run_judge.judge_overrun(self.watch, time.monotonic() - self.start,
                                         self.limits.cpu_s)
      self._fail("time limit", fault)
    return self._sel.select(min(left, CpuWatch.EVERY_S))

  def _drain(self, key):
    data = os.read(key.fd, 1 << 16)
    if not data:
      if key.data == "out":
        self._fail("the program exited or closed its output")
      self._sel.unregister(key.fd)
    elif key.data == "out":
      self._buf += data
      self._read_total += len(data)
      if self._read_total > self.cap:
        self._fail("output limit")
    else:
      # stderr is drained whole, but no more than the output cap of it: a flood past it (by
      # vmsplice, say, which costs the program nothing per page) ends the run, not our CPU.
      self._err_total += len(data)
      if self._err_total > self.cap:
        self._fail("output limit (stderr)")
      if len(self.err) < self.err_cap:
        self.err += data[:self.err_cap - len(self.err)]

  def _fail(self, why: str, fault: str | None = None):
    self.close()
    raise Channel.Closed(why, fault)

  def close(self):
    run_tree.kill_run(self.proc)
    for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
      try:
        f.close()
      except (OSError, ValueError):
        pass
    try:
      self._sel.close()
    except (OSError, ValueError):
      pass
    try:
      self.proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
      pass
    if self.group is not None:
      self.group.remove()
      self.group = None
