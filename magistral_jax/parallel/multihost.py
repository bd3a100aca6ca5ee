"""Many hosts: one JAX process per host (multi-controller JAX), each with a role.

A run on H hosts is H processes started with the same command and `--distributed`. The config
gives them roles (`devices.trainer_processes = T`):

    processes 0 .. T-1   the trainer: their devices together form the trainer mesh (e.g. FSDP
                         across hosts); every one of them runs the same train step (SPMD), and
                         process 0, the leader, also runs the pipeline (prompts, verifiers, batches)
    processes T .. H-1   one generator each, on that process's own devices (all of them, or
                         the first `devices.generator_process_devices`)

Only the processes that own a mesh's devices run that mesh's programs: the trainer processes the
train step, a generator process its engine's.

Three channels connect them, all JAX's own (no protocol of ours over raw sockets):
- weights and bulk data go device to device through `jax.experimental.transfer`: each process
  runs one TransferServer (parallel/bulk.py); the trainer leader offers each push's weights
  (parallel/weight_transfer.py) and each minibatch's rows (`bulk.BulkChannel`) under ids of ours, and the
  receiver pulls them onto its devices;
- messages (prompts, completions, stop/version/error signals, the ids of those transfers) go
  through the key-value store of JAX's coordination service (`Mailbox`), the service
  `jax.distributed.initialize` starts on process 0.

The service runs in recoverable mode: a generator process may die, and a relaunched one rejoin,
while the run goes on. Liveness (who is alive, and the stop of the run when a trainer process
dies) is parallel/liveness.py's: each process's heartbeat in the key-value store.
"""
from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import pickle
import socket
import threading
import time
from typing import Any, Callable

import jax
import numpy as np

from magistral_jax.parallel import liveness

log = logging.getLogger(__name__)

# What launch/local_cluster.py (or a cluster's job script) sets for each process.
ENV_COORDINATOR = "MAGISTRAL_COORDINATOR"              # host:port of process 0's service
ENV_NUM_PROCESSES = "MAGISTRAL_NUM_PROCESSES"
ENV_PROCESS_ID = "MAGISTRAL_PROCESS_ID"
ENV_TRANSFER_ADDRESS = "MAGISTRAL_TRANSFER_ADDRESS"    # this process's host:port for transfers
ENV_TRANSFER_PORT = "MAGISTRAL_TRANSFER_PORT"          # or a port on this host's address
ENV_HEARTBEAT_TIMEOUT_S = "MAGISTRAL_HEARTBEAT_TIMEOUT_S"


def initialize() -> None:
  """jax.distributed.initialize for this process, from the MAGISTRAL_* environment variables
  where set (launch/local_cluster.py sets them), else JAX's cluster auto-detection (SLURM, Open
  MPI, TPU VMs, GKE; see README.md "Many hosts"). Enables the cross-host transfer server first
  when a transfer address or port is given (needed on CPU and GPU; TPUs transfer natively)."""
  env = os.environ
  address = env.get(ENV_TRANSFER_ADDRESS)
  if not address and env.get(ENV_TRANSFER_PORT):
    address = f"{socket.gethostbyname(socket.gethostname())}:{env[ENV_TRANSFER_PORT]}"
  if address:
    jax.config.update("jax_cross_host_transfer_socket_address", address)
  # A transfer's two ends meet through the coordination service; the default minute is short for
  # a generator host busy decoding on a loaded machine.
  jax.config.update("jax_cross_host_transfer_timeout_seconds", 600)
  kwargs: dict[str, Any] = {}
  if env.get(ENV_COORDINATOR):
    kwargs = dict(coordinator_address=env[ENV_COORDINATOR],
                  num_processes=int(env[ENV_NUM_PROCESSES]),
                  process_id=int(env[ENV_PROCESS_ID]))
  heartbeat = int(heartbeat_timeout_s())
  # A generator process may die and be relaunched without stopping the run (liveness.py).
  jax.config.update("jax_enable_recoverability", True)
  jax.distributed.initialize(**kwargs, heartbeat_timeout_seconds=heartbeat)
  global _heartbeat, _watch
  client = coordination_client("liveness")
  _heartbeat = liveness.Heartbeat(client, jax.process_index())
  _watch = liveness.Watch(client)
  # Registered after JAX's own shutdown, so it runs before it: a liveness thread still reading
  # the store while JAX's client shuts down aborts the process.
  atexit.register(_stop_liveness)
  log.info("jax.distributed: process %d of %d, %d local / %d global devices%s",
           jax.process_index(), jax.process_count(), jax.local_device_count(),
           jax.device_count(), f", transfers on {address}" if address else "")


def _stop_liveness() -> None:
  for thread in (_heartbeat, _watch):
    if thread is not None:
      thread.stop()


_heartbeat: liveness.Heartbeat | None = None
_watch: liveness.Watch | None = None


def heartbeat_timeout_s() -> float:
  """Seconds of silence after which a process counts as dead (MAGISTRAL_HEARTBEAT_TIMEOUT_S)."""
  return float(os.environ.get(ENV_HEARTBEAT_TIMEOUT_S, "60"))


def incarnation() -> int:
  """How many times this process id has started in this run (1: the first time)."""
  if _heartbeat is None:
    raise RuntimeError("incarnation() needs multihost.initialize()")
  return _heartbeat.incarnation


def watch() -> liveness.Watch:
  """This process's view of every process's heartbeat."""
  if _watch is None:
    raise RuntimeError("watch() needs multihost.initialize()")
  return _watch


def leave() -> None:
  """This process ends normally: the others' liveness watches do not take it for dead."""
  if _heartbeat is not None:
    _heartbeat.leave()
  if _watch is not None:
    _watch.stop()


def finish(timeout_s: float = 60.0) -> None:
  """A normal end of this process: it leaves; process 0, which hosts the service, waits for the
  others to leave first."""
  leave()
  if jax.process_index() == 0:
    wait_for_others_to_leave(timeout_s)


def wait_for_others_to_leave(timeout_s: float) -> None:
  """Process 0 (the service's host), at the end: returns once every other process has left the
  service (shut down its client, or died), or after `timeout_s`. In recoverable mode JAX's
  shutdown does not wait for them, and a process still connected when the service goes away
  aborts."""
  if jax.process_count() == 1:
    return
  client = coordination_client("the end of the run")
  # get_live_nodes is a barrier among the live processes named: the others never enter it, so
  # it returns once each of them has disconnected or been found dead.
  t = threading.Thread(target=client.get_live_nodes, args=(list(range(jax.process_count())),),
                       daemon=True)
  t.start()
  t.join(timeout_s)


# ---- roles ---------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ProcessLayout:
  """Which process does what (see the module docstring)."""
  process_id: int
  num_processes: int
  trainer_processes: tuple[int, ...]
  generator_processes: tuple[int, ...]
  generator_process_devices: int = 0   # > 0: a generator uses only that many of its devices

  @property
  def is_trainer(self) -> bool:
    return self.process_id in self.trainer_processes

  @property
  def is_leader(self) -> bool:
    return self.process_id == self.trainer_processes[0]

  @property
  def generator_index(self) -> int:
    return self.generator_processes.index(self.process_id)

  @property
  def role(self) -> str:
    return ("trainer leader" if self.is_leader else "trainer" if self.is_trainer else
            f"generator {self.generator_index}")

  def trainer_devices(self) -> list[jax.Device]:
    return [d for d in jax.devices() if d.process_index in self.trainer_processes]

  def generator_devices(self) -> list[list[jax.Device]]:
    k = self.generator_process_devices or None
    return [[d for d in jax.devices() if d.process_index == p][:k]
            for p in self.generator_processes]


def check_process_layout(trainer_processes: int, num_processes: int,
                         generator_process_devices: int = 0, local_devices: int = 1) -> None:
  if not 1 <= trainer_processes < num_processes:
    raise ValueError(f"devices.trainer_processes={trainer_processes}: a run of {num_processes} "
                     "processes needs 1 <= trainer_processes < num_processes (the rest generate)")
  if not 0 <= generator_process_devices <= local_devices:
    raise ValueError(f"devices.generator_process_devices={generator_process_devices}: a "
                     f"generator process has {local_devices} device(s) (0 means all of them)")


def process_layout(devices) -> ProcessLayout | None:
  """The roles of this run's processes (its `devices` section, parallel/config.py DevicesConfig),
  or None for a run in one process (every layout of parallel.layout.split_devices)."""
  t = int(devices.trainer_processes)
  n = jax.process_count()
  if n == 1:
    if t:
      raise ValueError(f"devices.trainer_processes={t} is a layout of many processes, but this "
                       "is one: start it with launch/local_cluster.py --num_processes=N -- "
                       "launch/train.py ... (one machine) or one process per host with "
                       "--distributed (README.md \"Many hosts\")")
    return None
  if t == 0:
    raise ValueError(f"this run has {n} JAX processes: set devices.trainer_processes (e.g. "
                     "--config=configs/tiny.py:multihost) to say which of them train")
  if devices.colocated:
    raise ValueError("devices.colocated is a one-process layout; a run of many processes gives "
                     "the generators processes of their own (devices.trainer_processes)")
  k = int(devices.generator_process_devices)
  check_process_layout(t, n, k, jax.local_device_count())
  return ProcessLayout(jax.process_index(), n, tuple(range(t)), tuple(range(t, n)), k)


# ---- values on the host --------------------------------------------------------------------------

def to_host(tree):
  """device_get that also takes arrays spanning other processes when they are replicated (a
  train step's metrics): each process reads its own copy."""
  def get(x):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      if not x.is_fully_replicated:
        raise ValueError(f"to_host: an array of shape {x.shape} is sharded across processes; "
                         "only replicated values can be read on one host")
      return np.asarray(x.addressable_data(0))
    return np.asarray(jax.device_get(x))
  return jax.tree.map(get, tree)


def local_devices(devices) -> list[jax.Device]:
  """The ones this process owns (memory statistics are only readable there)."""
  me = jax.process_index()
  return [d for d in devices if d.process_index == me]


# ---- messages --------------------------------------------------------------------------------------

def coordination_client(who: str):
  """This process's client of the coordination service (its key-value store)."""
  from jax._src import distributed
  client = distributed.global_state.client
  if client is None:
    raise RuntimeError(f"{who} needs jax.distributed.initialize() (launch with --distributed)")
  return client


class Mailbox:
  """Ordered message streams between processes over the coordination service's key-value store.

  A stream is a key prefix; message n of stream s is the key `<namespace>/<s>/<n>`. One process
  writes a stream (`send`), one reads it (`receive`/`poll`, which delete what they read, so the
  store holds only what is in flight). Values are pickles of plain Python data (requests,
  samples, batches of numpy arrays), between processes of one job."""

  def __init__(self, namespace: str):
    self._client = coordination_client("Mailbox")
    self.namespace = namespace
    self._lock = threading.Lock()   # senders on several threads share a stream's numbering
    self._sent: dict[str, int] = {}
    self._read: dict[str, int] = {}

  def _key(self, stream: str, n: int) -> str:
    return f"{self.namespace}/{stream}/{n}"

  def send(self, stream: str, message) -> None:
    raw = pickle.dumps(message)
    with self._lock:
      n = self._sent.get(stream, 0)
      self._client.key_value_set_bytes(self._key(stream, n), raw)
      self._sent[stream] = n + 1

  def poll(self, stream: str):
    """The next message of `stream`, or None when it has not been sent yet."""
    n = self._read.get(stream, 0)
    key = self._key(stream, n)
    try:
      raw = self._client.key_value_try_get_bytes(key)
    except Exception as e:   # NOT_FOUND: not sent yet
      if "NOT_FOUND" in str(e) or "not found" in str(e).lower():
        return None
      raise
    self._client.key_value_delete(key)
    self._read[stream] = n + 1
    return pickle.loads(raw)

  def receive(self, stream: str, timeout_s: float, *, what: str = "",
              between: Callable[[], None] | None = None, poll_s: float = 0.5):
    """The next message of `stream`, waiting up to `timeout_s` (TimeoutError after, naming
    `what`); `between()` runs every `poll_s` while waiting, e.g. to raise a peer's error."""
    n = self._read.get(stream, 0)
    key = self._key(stream, n)
    deadline = time.time() + timeout_s
    while True:
      wait_ms = int(1000 * max(0.001, min(poll_s, deadline - time.time())))
      try:
        raw = self._client.blocking_key_value_get_bytes(key, wait_ms)
        break
      except Exception as e:
        if "DEADLINE_EXCEEDED" not in str(e):
          raise
      if between is not None:
        between()
      if time.time() >= deadline:
        raise TimeoutError(f"no message on {key} ({what or stream}) in {timeout_s:.0f}s")
    self._client.key_value_delete(key)
    self._read[stream] = n + 1
    return pickle.loads(raw)
