"""The sandbox as a tool (issue #67): one tool call of the policy (tool_use/protocol.py) run as a
Python program in the code verifier's sandbox, with its namespaces, limits and verdict rules.

The call's source is written to the run's directory and run as __main__ (code_stdio.RUN_SOLUTION,
as a stdin/stdout solution is), with no input and nothing of the task: a call can read no answer,
because none is anywhere it could look (the private root holds the interpreter and the source,
nothing else). What it prints is the result. Whatever the program does, the result is text:
  - a normal exit: its stdout (and stderr, when it wrote any: warnings are worth reading);
  - an exception: the last lines of its traceback, as the policy would see them in a terminal;
  - past its CPU limit, its memory or its output cap: an error line saying which;
  - a fault of ours (a backstop hit by a loaded host: code_result.VerifierFault): an error line
    saying the call could not run; the sample goes on.
`run_call` never raises for what the program does; only a broken sandbox (no isolation) raises.
"""
from __future__ import annotations

import dataclasses
import os
import threading

from magistral_jax.rewards.code_check import default_python
from magistral_jax.rewards.code_result import write_source
from magistral_jax.rewards.code_stdio import RUN_SOLUTION
from magistral_jax.rewards.sandbox import Sandbox, process_uid_base
from magistral_jax.rewards.sandbox_limits import Limits
from magistral_jax.rewards.sandbox_root import interpreter_binds
from magistral_jax.tool_use.config import ToolConfig
from magistral_jax.tool_use.protocol import EMPTY_CALL

TRACEBACK_LINES = 4   # the end of a traceback: the exception and where it was raised


@dataclasses.dataclass(frozen=True)
class CallResult:
  """One call's outcome: `output`, the text the policy reads, and `error`, None for a call that
  ran to a normal exit, else its kind ("exception", "time", "memory", "output", "fault",
  "empty"), which the run's metrics count."""
  output: str
  error: str | None = None
  wall_s: float = 0.0


def call_limits(cfg: ToolConfig) -> Limits:
  """The sandbox limits of one call: the code verifier's, at the tool's CPU and memory, with the
  output capped a little above what the result block keeps (past it the run is killed)."""
  return Limits(cpu_s=cfg.cpu_s, memory_mb=cfg.memory_mb,
                max_output_bytes=max(4096, 4 * cfg.max_output_chars))


def _tail(data: bytes, lines: int) -> str:
  text = data.decode("utf-8", errors="replace").rstrip("\n")
  return "\n".join(text.splitlines()[-lines:])


def run_call(source: str, cfg: ToolConfig, *, sandbox: Sandbox, python: str) -> CallResult:
  """Runs one call's `source` under `cfg`'s limits in `sandbox` (`python`: the interpreter the
  sandbox execs, code_check.default_python); see the module docstring."""
  if not source.strip():
    return CallResult(EMPTY_CALL, "empty")
  limits = call_limits(cfg)
  workdir = sandbox.make_dir()
  try:
    write_source(os.path.join(workdir, "solution.py"), source)
    exe, binds = interpreter_binds(python)
    r = sandbox.run([exe], workdir, limits, ro_binds=binds, python_src=RUN_SOLUTION,
                    inputs=["solution.py"], stdin=b"")
  finally:
    sandbox.remove_dir(workdir)
  out = r.stdout.decode("utf-8", errors="replace")
  if r.fault:
    return CallResult(f"error: the tool could not run ({r.fault})", "fault", r.wall_s)
  if r.output_truncated:
    return CallResult(out + "\nerror: the output limit was reached", "output", r.wall_s)
  if r.timed_out or (r.cpu_s is not None and r.cpu_s >= limits.cpu_s):
    return CallResult(out + f"\nerror: the call ran past its {cfg.cpu_s:g} s time limit", "time",
                      r.wall_s)
  if r.returncode != 0:
    err = _tail(r.stderr, TRACEBACK_LINES)
    kind = "memory" if "MemoryError" in err else "exception"
    if r.returncode is not None and r.returncode < 0 and not err:
      err = f"error: the call was stopped by signal {-r.returncode}"
    return CallResult((out + "\n" if out else "") + err, kind, r.wall_s)
  err = r.stderr.decode("utf-8", errors="replace").strip()
  return CallResult(out + ("\n" + err if err else ""), None, r.wall_s)


class ToolRunner:
  """run_call for the tool calls of one process's generators (generate/tool_turns.py runs them
  on its own threads): each thread gets a sandbox of its own, with a uid of its own among the
  process's sandbox uids (FIRST_UID_OFFSET on), so that concurrent calls never share the uid
  their limits and cleanup go by. Returns (output, error kind), as ToolTurns takes them."""

  FIRST_UID_OFFSET, MAX_THREADS = 246, 8

  def __init__(self, cfg: ToolConfig, python: str | None = None):
    self.cfg, self.python = cfg, python or default_python()
    self._local = threading.local()
    self._lock = threading.Lock()
    self._threads = 0

  def _sandbox(self) -> Sandbox:
    sbx = getattr(self._local, "sandbox", None)
    if sbx is None:
      with self._lock:
        if self._threads >= self.MAX_THREADS:
          raise RuntimeError(f"ToolRunner: more than {self.MAX_THREADS} threads run tool calls")
        offset, self._threads = self.FIRST_UID_OFFSET + self._threads, self._threads + 1
      sbx = self._local.sandbox = Sandbox(uid=process_uid_base() + offset)
    return sbx

  def __call__(self, source: str) -> tuple[str, str | None]:
    r = run_call(source, self.cfg, sandbox=self._sandbox(), python=self.python)
    return r.output, r.error
