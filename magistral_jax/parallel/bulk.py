"""Bulk data between processes as arrays, device to device; the coordination service carries only
a short description of each message.

parallel/multihost.py's Mailbox moves pickles through the coordination service's key-value
store: right for control messages, wrong for data. Every byte goes through the one service on
process 0 (which also carries the job's heartbeats), at tens of MB/s (BENCHMARKS.md, "Many
hosts: bulk data"), and a large value read with a short wait, as a poll does, can take many
times its size in memory.

A BulkChannel sends named numpy arrays from one process to another through JAX's DCN transfer
library (`jax.experimental.transfer`): each process runs one TransferServer, whose address it
publishes in the key-value store once. The sender packs a message's arrays into one byte buffer,
puts it on one of its devices and offers it under a fresh id (`await_pull`); a Mailbox message
gives the receiver the id, the sender's server address and the arrays' names, dtypes, shapes
and offsets, and the receiver pulls the buffer onto one of its own devices over its connection
to that server. The ids are ours, so transfers between different pairs of processes, on
different threads, need no common order, and a relaunched process takes part at once
(`jax.device_put` across processes matches the two ends by each process's count of transfers).
On CPU and GPU the bytes go over the servers' sockets in chunks of TRANSFER_CHUNK_BYTES.

LocalRows is what a trainer process gets of a training batch: only the rows its own devices hold
(train.step.shard_batch builds the global array from them).
"""
from __future__ import annotations

import dataclasses
import os
import socket
import threading
import time
import zlib
from typing import Any, Callable, Mapping

import jax
import numpy as np
from jax.sharding import SingleDeviceSharding

# Bytes per chunk on the transfer servers' sockets: small chunks move bulk data between local
# processes several times faster than jax's default chunk (docs/design_notes.md, "Many processes").
TRANSFER_CHUNK_BYTES = 4 << 20
CONNECTIONS = 4   # parallel sockets per server
BETWEEN_S = 0.5   # how often a pull that can lose its sender checks on it (BulkChannel.open)

_server_lock = threading.Lock()
_server = None


def transfer_server():
  """This process's TransferServer (started once), its address in the key-value store."""
  global _server
  with _server_lock:
    if _server is None:
      from jax.experimental import transfer
      from magistral_jax.parallel import multihost
      host = os.environ.get(multihost.ENV_TRANSFER_ADDRESS, "").rpartition(":")[0]
      host = host or socket.gethostbyname(socket.gethostname())
      _server = transfer.start_transfer_server(
          jax.local_devices()[0].client, f"{host}:0", [f"{host}:0"] * CONNECTIONS,
          transfer_size=TRANSFER_CHUNK_BYTES)
      # Overwritten by a relaunched process (its server has a new address).
      multihost.coordination_client("bulk transfers").key_value_set(
          f"bulk/server/{jax.process_index()}", _server.address(), allow_overwrite=True)
    return _server


_connections: dict[str, Any] = {}


def connection_at(address: str):
  """This process's connection to the transfer server at `address` (made once). Keyed by the
  address: a relaunched process's server has a new one."""
  with _server_lock:
    conn = _connections.get(address)
  if conn is None:
    conn = transfer_server().connect(address)
    with _server_lock:
      conn = _connections.setdefault(address, conn)
  return conn


def connection(process: int, timeout_s: float = 600.0):
  """This process's connection to `process`'s transfer server (its address published at start)."""
  from magistral_jax.parallel import multihost
  address = multihost.coordination_client("bulk transfers").blocking_key_value_get(
      f"bulk/server/{process}", int(1000 * timeout_s))
  return connection_at(address)


@dataclasses.dataclass(frozen=True)
class Spec:
  """Where each array lies in a packed buffer: name -> (dtype, shape, byte offset)."""
  fields: tuple[tuple[str, np.dtype, tuple[int, ...], int], ...]
  nbytes: int


def pack(arrays: Mapping[str, np.ndarray]) -> tuple[np.ndarray, Spec]:
  """One uint8 buffer holding every array's bytes (C order), and the Spec to read them back."""
  fields, offset = [], 0
  for name, a in arrays.items():
    a = np.asarray(a)
    fields.append((name, a.dtype, tuple(a.shape), offset))
    offset += a.nbytes
  buf = np.empty(offset, np.uint8)
  for (name, _, _, start), a in zip(fields, arrays.values()):
    a = np.ascontiguousarray(a)
    buf[start:start + a.nbytes] = a.reshape(-1).view(np.uint8)
  return buf, Spec(tuple(fields), offset)


def unpack(buf: np.ndarray, spec: Spec) -> dict[str, np.ndarray]:
  """The arrays of `pack`, as views of `buf`."""
  if buf.nbytes != spec.nbytes:
    raise ValueError(f"a bulk buffer of {buf.nbytes} bytes, expected {spec.nbytes}")
  out = {}
  for name, dtype, shape, start in spec.fields:
    n = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
    out[name] = buf[start:start + n].view(dtype).reshape(shape)
  return out


class BulkChannel:
  """Messages of named arrays (plus a small picklable `meta`) from process `src` to process
  `dst`: the description over Mailbox stream `stream`, the bytes pulled from src's transfer
  server onto dst's device. Both ends make the same channel; `send` runs on src, `receive` on
  dst, each on one thread at a time."""

  def __init__(self, mailbox, stream: str, src: int, dst: int, src_device: int = 0,
               dst_device: int = 0, timeout_s: float = 600.0):
    self.mailbox, self.stream, self.src, self.dst = mailbox, stream, src, dst
    local = lambda p, i: sorted((d for d in jax.devices() if d.process_index == p),
                                key=lambda d: d.id)[i]
    self._src_dev, self._dst_dev = local(src, src_device), local(dst, dst_device)
    self.timeout_s = timeout_s
    self._server = transfer_server()
    self._base = zlib.crc32(f"{mailbox.namespace}/{stream}".encode()) << 31
    self._sent = self._received = 0
    self.sent_bytes = self.received_bytes = 0

  def send(self, arrays: Mapping[str, np.ndarray], meta: Any = None) -> None:
    buf, spec = pack(arrays)
    uuid = self._base + self._sent
    if spec.nbytes:
      # The server keeps the device buffer until the receiver has pulled it.
      self._server.await_pull(uuid, [jax.device_put(buf, self._src_dev)])
    self.mailbox.send(self.stream, ("bulk", spec, meta, uuid, self._server.address()))
    self._sent += 1
    self.sent_bytes += spec.nbytes

  def receive(self, timeout_s: float, what: str = "") -> tuple[dict[str, np.ndarray], Any]:
    msg = self.mailbox.receive(self.stream, timeout_s, what=what or f"bulk {self.stream}")
    if not (isinstance(msg, tuple) and len(msg) == 5 and msg[0] == "bulk"):
      raise ValueError(f"{self.stream}: expected a bulk message, got {str(msg)[:200]}")
    return self.open(msg)

  def open(self, msg, between: Callable[[], None] | None = None
           ) -> tuple[dict[str, np.ndarray], Any]:
    """The arrays and meta of a ("bulk", ...) message already read from the stream (a stream
    that also carries other messages, read by the caller).

    A pull from a sender that died before its buffer was read never completes (the transfer
    library does not notice the dead server), so a receiver that can lose its sender passes
    `between`: called every BETWEEN_S while the pull is out, it raises once the sender is gone
    (a liveness check), and the pull is abandoned."""
    _, spec, meta, uuid, address = msg
    self._received += 1
    if not spec.nbytes:
      return unpack(np.empty(0, np.uint8), spec), meta
    want = jax.ShapeDtypeStruct((spec.nbytes,), np.uint8,
                                sharding=SingleDeviceSharding(self._dst_dev))
    (out,) = connection_at(address).pull(uuid, [want])
    if between is not None:
      _await_ready(out, between)
    self.received_bytes += spec.nbytes
    return unpack(np.asarray(out), spec), meta

  def ack(self) -> None:
    """The receiver: everything so far has arrived (the sender's wait_for_ack returns)."""
    self.mailbox.send(self.stream + "/ack", self._received)

  def wait_for_ack(self, timeout_s: float, what: str = "") -> None:
    """The sender: blocks until the receiver has acknowledged every message sent so far.

    A sender that goes on to a program spanning both processes (a train step's collectives) must
    wait here first: its transfer server reads the offered buffer through the device, whose
    queue that program would hold until the receiver joins it, which it cannot before the pull
    has finished."""
    got = self.mailbox.receive(self.stream + "/ack", timeout_s,
                               what=what or f"the acknowledgement of {self.stream}")
    if got != self._sent:
      raise ValueError(f"{self.stream}: acknowledged {got} messages, sent {self._sent}")


def _await_ready(out: jax.Array, between: Callable[[], None]) -> None:
  """Waits for a pulled array (the pull returns at once, its bytes arrive later), calling
  `between` every BETWEEN_S; its exception abandons the pull (the array is dropped: that does
  not wait for it)."""
  t_check, sleep = time.monotonic(), 0.0005
  while not out.is_ready():
    if time.monotonic() - t_check >= BETWEEN_S:
      between()
      t_check = time.monotonic()
    time.sleep(sleep)
    sleep = min(2 * sleep, 0.02)


@dataclasses.dataclass
class LocalRows:
  """A [n_micro, rows, row_len] batch field of which this process holds only some row ranges:
  blocks[(r0, r1)] = field[:, r0:r1]. Indexable by the global index of any block it holds
  (what jax.make_array_from_callback asks for this process's devices)."""
  shape: tuple[int, ...]
  dtype: np.dtype
  blocks: dict[tuple[int, int], np.ndarray]

  @property
  def ndim(self) -> int:
    return len(self.shape)

  def __getitem__(self, index):
    rows = index[1] if len(index) > 1 else slice(None)
    r0, r1, _ = rows.indices(self.shape[1])
    block = self.blocks.get((r0, r1))
    if block is None:
      raise KeyError(f"rows {r0}:{r1} are not held here (held: {sorted(self.blocks)})")
    return block[(index[0], slice(None)) + tuple(index[2:])]


def row_ranges(sharding, shape: tuple[int, ...], process: int) -> list[tuple[int, int]]:
  """The distinct [r0, r1) row ranges (axis 1) that `process`'s devices hold of an array of
  `shape` laid out by `sharding`."""
  out = set()
  for device, index in sharding.devices_indices_map(tuple(shape)).items():
    if device.process_index == process:
      out.add(index[1].indices(shape[1])[:2] if len(index) > 1 else (0, shape[1]))
  return sorted(out)
