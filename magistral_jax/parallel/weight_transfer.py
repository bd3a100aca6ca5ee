"""The trainer's weights onto a generator process's devices (many hosts, parallel/multihost.py):
staged once on the trainer mesh, offered by the leader, pulled by the generator through
jax.experimental.transfer (parallel/bulk.py's transfer servers)."""
from __future__ import annotations

import datetime
import threading
import zlib

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from magistral_jax.parallel import bulk


class WeightTransfer:
  """The trainer's params onto a generator's mesh on another process, device to device.

  1. `stage` (every trainer process, the same number of times: one SPMD program): cast the params
     to the generator's dtype and lay them out as a generator holds them, on each group of k
     trainer devices (k = a generator's device count; the trainer's device count must be a
     multiple of it). The first group's copy, on the trainer leader's first k devices, is kept
     as `latest`, until the next stage (so a generator that rejoins gets the current weights
     without the other trainer processes).
  2. `offer` (the leader): the latest copy goes to its transfer server under an id; a message
     gives the generator that id.
  3. `receive` (the generator process): pulls it onto its own devices, shard i of the copy onto
     device i of its mesh (jax.experimental.transfer).
  No host round trip and no file system. `dst_shardings` is a generator engine's param_shardings
  (stacked layout; any generator's: only the mesh's shape and the specs matter to the trainer)
  and `abstract` their shapes and serving dtype.
  """

  def __init__(self, abstract, dst_shardings, trainer_devices):
    leaves = jax.tree.leaves(dst_shardings)
    dst_mesh = leaves[0].mesh
    k, t = dst_mesh.devices.size, len(trainer_devices)
    if k > t or t % k:
      raise ValueError(f"a generator of {k} devices cannot receive pushes from a trainer of {t} "
                       f"devices: the trainer's device count must be a multiple of each "
                       "generator's")
    src_devices = list(trainer_devices[:k])
    self.sender = src_devices[0].process_index
    if any(d.process_index != self.sender for d in src_devices):
      raise ValueError(f"a generator of {k} devices needs a trainer process with at least {k} "
                       "devices (the leader's first k devices hold the copy it receives)")
    shape, names = dst_mesh.devices.shape, dst_mesh.axis_names
    stage_mesh = Mesh(np.asarray(trainer_devices, dtype=object).reshape((t // k,) + shape),
                      ("push_copy",) + tuple(names))
    src_mesh = Mesh(np.asarray(src_devices, dtype=object).reshape(shape), names)
    self.abstract, self.dst_shardings = abstract, dst_shardings
    self.src_shardings = jax.tree.map(lambda d: NamedSharding(src_mesh, d.spec), dst_shardings)
    stage = jax.tree.map(lambda d: NamedSharding(stage_mesh, d.spec), dst_shardings)
    dtypes = jax.tree.map(lambda a: a.dtype, abstract)
    self._stage = jax.jit(lambda p: jax.tree.map(lambda x, dt: x.astype(dt), p, dtypes),
                          out_shardings=stage)
    self._src_devices = src_devices
    self.sends = self.sender == jax.process_index()
    self.latest = None       # (version, the staged copy on the sender's first k devices)
    self.lock = threading.RLock()   # one push or rejoin at a time (pipeline.remote)
    self._offers = 0
    # Called before a stage replaces the latest copy: waits until the offers of it that are
    # still out have been pulled (the leader's LeaderRollouts sets it; pulls overlap a step).
    self.settle = lambda: None

  def stage(self, params, version: int) -> None:
    """Every trainer process: the params of policy `version`, cast and laid out (step 1)."""
    if self.sends:
      self.settle()
    staged = self._stage(params)
    if not self.sends:
      return

    def source(x, sharding, a):
      shards = {s.device: s.data for s in x.addressable_shards}
      return jax.make_array_from_single_device_arrays(
          a.shape, sharding, [shards[d] for d in self._src_devices], dtype=a.dtype)

    # Only the first group's shards stay referenced: the other groups' copies are freed.
    self.latest = (int(version), jax.tree.map(source, staged, self.src_shardings, self.abstract))

  def offer(self, timeout_s: float) -> tuple[int, int]:
    """The sender: offers the latest staged copy for one pull; returns (version, transfer id).
    An offer nobody pulls is dropped after `timeout_s`."""
    if self.latest is None:
      raise RuntimeError("WeightTransfer.offer before any stage")
    version, src = self.latest
    uuid = _WEIGHTS_UUID_BASE + self._offers
    self._offers += 1
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout_s)
    bulk.transfer_server().await_pull(uuid, jax.tree.leaves(src), timeout=deadline)
    return version, uuid

  def receive(self, uuid: int):
    """A generator process: the offered params, on its devices, in the stacked layout."""
    want = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        self.abstract, self.dst_shardings)
    leaves, tree = jax.tree.flatten(want)
    out = bulk.connection(self.sender).pull(int(uuid), leaves)
    jax.block_until_ready(out)
    return jax.tree.unflatten(tree, out)


# Transfer ids of weight offers, numbered as a BulkChannel's are (crc32 of a name << 31, + n).
_WEIGHTS_UUID_BASE = zlib.crc32(b"weights") << 31
