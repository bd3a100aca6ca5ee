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
- weights go device to device through JAX's cross-host transfers (`WeightTransfer`: a
  `jax.device_put` between two meshes on different processes, which the DCN transfer server moves
  over `jax_cross_host_transfer_socket_address` on CPU and GPU, natively on TPU);
- bulk data (the training rows each trainer process gets) goes device to device through
  `jax.experimental.transfer` (parallel/bulk.py's BulkChannel), described by a message;
- messages (prompts, completions, stop/version/error signals, those descriptions) go through the
  key-value store of JAX's coordination service (`Mailbox`), the service
  `jax.distributed.initialize` starts on process 0. Its heartbeats are also the failure
  detector: when a process dies, every other process is stopped within
  `heartbeat_timeout_seconds`, with an error naming the dead task.
"""
from __future__ import annotations

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
from jax.sharding import Mesh, NamedSharding

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
  heartbeat = int(env.get(ENV_HEARTBEAT_TIMEOUT_S, "60"))
  jax.distributed.initialize(**kwargs, heartbeat_timeout_seconds=heartbeat)
  log.info("jax.distributed: process %d of %d, %d local / %d global devices%s",
           jax.process_index(), jax.process_count(), jax.local_device_count(),
           jax.device_count(), f", transfers on {address}" if address else "")


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


# ---- weights across processes ----------------------------------------------------------------------

class WeightTransfer:
  """The trainer's params onto one generator's mesh on another process, device to device.

  JAX moves an array between processes when both ends have the same tiling over the same number
  of devices (shard i of the source goes to device i of the destination). So the push is:
  1. on the trainer mesh (every trainer process runs it): one program casts the params to the
     generator's dtype and lays them out as the generator will hold them, on each group of k
     trainer devices (k = the generator's device count; the trainer's device count must be a
     multiple of it), e.g. a 2-way tensor-parallel copy on every pair of trainer devices;
  2. the first group's shards, as an array on those k devices, go to the generator's k devices
     (`jax.device_put` across processes: the trainer processes owning them send, the generator
     process receives, each calling `send`/`receive` in the same order).
  No host round trip and no file system: the bytes go from device memory to device memory over
  the transfer server. `dst_shardings` is the generator engine's param_shardings (stacked layout)
  and `abstract` their shapes and dtype.
  """

  def __init__(self, abstract, dst_shardings, trainer_devices):
    leaves = jax.tree.leaves(dst_shardings)
    dst_mesh = leaves[0].mesh
    k, t = dst_mesh.devices.size, len(trainer_devices)
    if k > t or t % k:
      raise ValueError(f"a generator of {k} devices cannot receive pushes from a trainer of {t} "
                       f"devices: the trainer's device count must be a multiple of each "
                       "generator's")
    shape, names = dst_mesh.devices.shape, dst_mesh.axis_names
    stage_mesh = Mesh(np.asarray(trainer_devices, dtype=object).reshape((t // k,) + shape),
                      ("push_copy",) + tuple(names))
    src_mesh = Mesh(np.asarray(trainer_devices[:k], dtype=object).reshape(shape), names)
    self.abstract, self.dst_shardings = abstract, dst_shardings
    self.src_shardings = jax.tree.map(lambda d: NamedSharding(src_mesh, d.spec), dst_shardings)
    stage = jax.tree.map(lambda d: NamedSharding(stage_mesh, d.spec), dst_shardings)
    dtypes = jax.tree.map(lambda a: a.dtype, abstract)
    self._stage = jax.jit(lambda p: jax.tree.map(lambda x, dt: x.astype(dt), p, dtypes),
                          out_shardings=stage)
    self._src_devices = list(src_mesh.devices.flat)
    me = jax.process_index()
    self.sends = any(d.process_index == me for d in self._src_devices)
    self._inflight = None

  def send(self, params) -> None:
    """Trainer processes, all of them (step 1 runs on the whole trainer mesh)."""
    staged = self._stage(params)

    def source(x, sharding, a):
      shards = {s.device: s.data for s in x.addressable_shards}
      mine = [shards[d] for d in self._src_devices if d in shards]
      return jax.make_array_from_single_device_arrays(a.shape, sharding, mine, dtype=a.dtype)

    if not self.sends:
      return
    src = jax.tree.map(source, staged, self.src_shardings, self.abstract)
    # Keeps the staged copy alive until the generator has it (the caller waits for its ack).
    self._inflight = (staged, src, jax.device_put(src, self.dst_shardings))

  def done(self) -> None:
    """The receiver acknowledged: the staged copy can go."""
    self._inflight = None

  def receive(self):
    """The generator process: its params, on its devices, in the stacked layout."""
    src = jax.tree.map(
        lambda a, s: jax.make_array_from_single_device_arrays(a.shape, s, [], dtype=a.dtype),
        self.abstract, self.src_shardings)
    out = jax.device_put(src, self.dst_shardings)
    jax.block_until_ready(out)
    return out
