"""N processes of one multi-controller JAX run on this machine (CI, and a try before a cluster):
what launch/local_cluster.py runs (its docstring: the command line).

`run_cluster(argv, N)` runs `python argv... --distributed` N times from the current directory.
Process i gets the environment of the caller plus

  MAGISTRAL_COORDINATOR=127.0.0.1:<port>        the same for every process (process 0 serves it)
  MAGISTRAL_NUM_PROCESSES=<N>
  MAGISTRAL_PROCESS_ID=<i>
  MAGISTRAL_TRANSFER_ADDRESS=127.0.0.1:<port_i> its own port for cross-host transfers
  XLA_FLAGS=<XLA_FLAGS without a device count> --xla_force_host_platform_device_count=<D>
  PYTHONUNBUFFERED=1

and `--distributed` at the end of its command line (unless already there); the launchers read the
MAGISTRAL_* variables when --distributed is given (parallel/multihost.py). Ports are free TCP ports
on 127.0.0.1 picked just before the start.

Every line a process prints (stdout and stderr together) comes out as `[p<i>] <line>`; with
log_dir, DIR/process_<i>.log also gets that process's raw lines.

Relaunches: a process listed in `restart` (generator processes: a run goes on without them and
takes them back, pipeline/remote.py) that exits non-zero or is killed is started again with the
same environment, up to max_restarts times each, as a cluster's scheduler would; its end does not
count as a failure until then.

Supervision: when a process exits non-zero or is killed by a signal, the others get grace_s
seconds to exit on their own (in a JAX run they do: the distributed runtime notices a dead peer),
then SIGTERM, then SIGKILL 10 s later. Ctrl-C or SIGTERM to the caller sends SIGTERM to every
process at once (a second one: SIGKILL). Each process runs in its own process group, and every
group is SIGKILLed at the end, so no grandchild (verifier workers, sandboxes) outlives the run.
The exit code is 0 when every process exited 0, else the first failure's exit code (1 when that
was a signal), after a `local_cluster: failed: ...` summary line.

Standard library only (no jax): the caller is a launcher, and the processes pick their devices.
"""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

KILL_AFTER_S = 10.0  # after SIGTERM, SIGKILL what is still running
_DEVICE_COUNT = re.compile(r"--xla_force_host_platform_device_count=\S*")
# N processes on one machine share its cores, and each XLA:CPU client would otherwise start a
# thread pool as wide as all of them: the pools oversubscribe the cores and every step slows down
# (docs/design_notes.md, "Many processes"). CPU-only flags: a GPU or TPU backend ignores them.
ONE_CPU_THREAD = ("--xla_cpu_multi_thread_eigen=false", "intra_op_parallelism_threads=1")


def free_ports(n: int) -> list[int]:
  """n distinct TCP ports on 127.0.0.1 that nothing listens on right now: all sockets stay bound
  until every port is read."""
  socks = []
  try:
    for _ in range(n):
      s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
      s.bind(("127.0.0.1", 0))
      socks.append(s)
    return [s.getsockname()[1] for s in socks]
  finally:
    for s in socks:
      s.close()


def xla_flags_with_device_count(xla_flags: str, devices: int) -> str:
  """xla_flags with any host device count replaced by `devices`."""
  kept = _DEVICE_COUNT.sub("", xla_flags or "").split()
  return " ".join(kept + [f"--xla_force_host_platform_device_count={devices}"])


def child_env(base_env, i: int, n: int, devices_per_process: int, coordinator: str,
              transfer_address: str, one_cpu_thread: bool = False) -> dict[str, str]:
  """The environment of process i of n (one_cpu_thread: ONE_CPU_THREAD added to XLA_FLAGS)."""
  env = dict(base_env)
  xla = xla_flags_with_device_count(base_env.get("XLA_FLAGS", ""), devices_per_process)
  if one_cpu_thread:
    xla = " ".join([xla] + [f for f in ONE_CPU_THREAD if f not in xla.split()])
  env.update({
      "MAGISTRAL_COORDINATOR": coordinator,
      "MAGISTRAL_NUM_PROCESSES": str(n),
      "MAGISTRAL_PROCESS_ID": str(i),
      "MAGISTRAL_TRANSFER_ADDRESS": transfer_address,
      "XLA_FLAGS": xla,
      "PYTHONUNBUFFERED": "1",
  })
  return env


def child_argv(command: list[str]) -> list[str]:
  """[python, script, args..., --distributed] (--distributed once)."""
  has = any(a in ("--distributed", "--distributed=true", "--distributed=True", "--distributed=1")
            for a in command)
  return [sys.executable, *command] + ([] if has else ["--distributed"])


def describe(returncode: int) -> str:
  """'exit code 1' or 'killed by SIGKILL'."""
  if returncode < 0:
    try:
      name = signal.Signals(-returncode).name
    except ValueError:
      name = f"signal {-returncode}"
    return f"killed by {name}"
  return f"exit code {returncode}"


def _signal_groups(procs, sig, only_running=True):
  for p in procs:
    if only_running and p.poll() is not None:
      continue
    try:
      os.killpg(p.pid, sig)  # start_new_session: the group id is the child's pid
    except (ProcessLookupError, PermissionError):
      pass


class _Printer:
  """Whole lines to `out`, one writer at a time."""

  def __init__(self, out):
    self.out, self.lock = out, threading.Lock()

  def line(self, text: str):
    with self.lock:
      self.out.write(text + "\n")
      self.out.flush()


def _pump(i: int, stream, printer: _Printer, log_path: str | None):
  """Reader thread of process i: prefixed lines to the launcher's output, raw ones to the log."""
  log = open(log_path, "wb") if log_path else None
  try:
    for raw in iter(stream.readline, b""):
      if log:
        log.write(raw)
        log.flush()
      text = raw.decode("utf-8", errors="replace").rstrip("\r\n")
      printer.line(f"[p{i}] {text}")
  except (OSError, ValueError):
    pass
  finally:
    if log:
      log.close()
    stream.close()


def run_cluster(argv: list[str], num_processes: int, devices_per_process: int = 1,
                grace_s: float = 60.0, log_dir: str | None = None, out=None,
                kill_after_s: float = KILL_AFTER_S, handle_signals: bool = True,
                one_cpu_thread: bool = True, restart=(), max_restarts: int = 3) -> int:
  """Runs `python argv... --distributed` num_processes times as one JAX run; returns the exit
  code (0: every process exited 0)."""
  if num_processes < 1:
    raise ValueError(f"num_processes must be >= 1, got {num_processes}")
  if devices_per_process < 1:
    raise ValueError(f"devices_per_process must be >= 1, got {devices_per_process}")
  if not argv:
    raise ValueError("no command: give a Python script and its arguments after `--`")
  printer = _Printer(out if out is not None else sys.stdout)
  ports = free_ports(num_processes + 1)
  coordinator = f"127.0.0.1:{ports[0]}"
  cmd = child_argv(list(argv))
  if log_dir:
    os.makedirs(log_dir, exist_ok=True)

  got_signal: list[int] = []
  old_handlers = {}
  if handle_signals and threading.current_thread() is threading.main_thread():
    def on_signal(signum, frame):
      del frame
      got_signal.append(signum)
    for sig in (signal.SIGINT, signal.SIGTERM):
      old_handlers[sig] = signal.signal(sig, on_signal)

  procs, readers = [], []
  try:
    printer.line(f"local_cluster: {num_processes} process(es), {devices_per_process} device(s) "
                 f"each, coordinator {coordinator}: {' '.join(cmd)}")
    def launch(i: int) -> subprocess.Popen:
      env = child_env(os.environ, i, num_processes, devices_per_process, coordinator,
                      f"127.0.0.1:{ports[i + 1]}", one_cpu_thread)
      p = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, start_new_session=True)
      log_path = os.path.join(log_dir, f"process_{i}.log") if log_dir else None
      t = threading.Thread(target=_pump, args=(i, p.stdout, printer, log_path),
                           name=f"local_cluster_p{i}", daemon=True)
      t.start()
      readers.append(t)
      return p

    for i in range(num_processes):
      procs.append(launch(i))
    restarts = [0] * num_processes
    failures: list[tuple[int, int]] = []  # (process, returncode), in the order seen
    done = [False] * num_processes
    term_at = kill_at = None  # when to send SIGTERM / SIGKILL to what still runs
    killed = False
    signals_seen = 0
    while not all(done):
      now = time.monotonic()
      for i, p in enumerate(procs):
        if done[i] or p.poll() is None:
          continue
        done[i] = True
        rc = p.returncode
        if rc == 0:
          printer.line(f"local_cluster: process {i} finished (exit code 0)")
          continue
        if (i in restart and restarts[i] < max_restarts and term_at is None and kill_at is None
            and not got_signal):
          restarts[i] += 1
          printer.line(f"local_cluster: process {i} exited with code {rc} ({describe(rc)}); "
                       f"relaunching it ({restarts[i]} of {max_restarts})")
          _signal_groups([p], signal.SIGKILL, only_running=False)   # its grandchildren
          procs[i] = launch(i)
          done[i] = False
          continue
        how = f" ({describe(rc)})" if rc < 0 else ""
        printer.line(f"local_cluster: process {i} exited with code {rc}{how}")
        failures.append((i, rc))
        if term_at is None and kill_at is None and not all(done):
          term_at = now + grace_s
          printer.line(f"local_cluster: the other processes get {grace_s:g}s to exit on their own")
      if len(got_signal) > signals_seen:
        signals_seen = len(got_signal)
        name = signal.Signals(got_signal[-1]).name
        if kill_at is None:
          printer.line(f"local_cluster: got {name}: SIGTERM to every process")
          _signal_groups(procs, signal.SIGTERM)
          term_at, kill_at = None, now + kill_after_s
        elif not killed:
          printer.line(f"local_cluster: got {name} again: SIGKILL to every process")
          kill_at = now
      if term_at is not None and now >= term_at and not all(done):
        printer.line("local_cluster: SIGTERM to the processes still running: "
                     + ", ".join(str(i) for i in range(num_processes) if not done[i]))
        _signal_groups(procs, signal.SIGTERM)
        term_at, kill_at = None, now + kill_after_s
      if kill_at is not None and now >= kill_at and not killed and not all(done):
        printer.line("local_cluster: SIGKILL to the processes still running: "
                     + ", ".join(str(i) for i in range(num_processes) if not done[i]))
        _signal_groups(procs, signal.SIGKILL)
        killed = True
      time.sleep(0.05)
  finally:
    # Whatever happened (an exception here included): no process and no grandchild survives.
    _signal_groups(procs, signal.SIGKILL, only_running=False)
    for p in procs:
      try:
        p.wait(timeout=10)
      except subprocess.TimeoutExpired:
        pass
    for t in readers:
      t.join(timeout=5)  # EOF comes once the last holder of the pipe (grandchildren too) is gone
    for sig, old in old_handlers.items():
      signal.signal(sig, old)

  if not failures:
    printer.line(f"local_cluster: all {num_processes} process(es) exited 0")
    return 0
  printer.line("local_cluster: failed: "
               + ", ".join(f"process {i} ({describe(rc)})" for i, rc in failures))
  first = failures[0][1]
  return first if first > 0 else 1
