"""Device memory: what a run holds on its devices, for the per-phase metrics.

`bytes_in_use(devices)` is the backend's own count where it keeps one (GPU and TPU report
`bytes_in_use` in `Device.memory_stats()`), else the bytes of the live jax arrays' shards on those
devices (the CPU backend keeps no count). Temporaries inside a running XLA program are not arrays,
so a phase's high-water mark is estimated as what is in use when its program starts plus the
program's own temporaries (`compiled_temp_bytes`: XLA's memory_analysis of the compiled step). On
GPU and TPU `backend_peak_bytes` adds the backend's process-lifetime high-water mark.
"""
from __future__ import annotations

from typing import Iterable

import jax
import numpy as np


def _stats(devices) -> list[dict] | None:
  try:
    stats = [d.memory_stats() for d in devices]
  except Exception:   # some backends raise instead of returning None
    return None
  return stats if all(s and "bytes_in_use" in s for s in stats) else None


def _shard_bytes_on(a: jax.Array, devs: set) -> int:
  """Bytes of the shards of `a` that live on `devs`."""
  on = sum(1 for d in a.sharding.device_set if d in devs)
  return on * int(np.prod(a.sharding.shard_shape(a.shape))) * a.dtype.itemsize


def live_array_bytes(devices: Iterable[jax.Device]) -> int:
  """Bytes of the live (not deleted) jax arrays' shards on `devices`."""
  devs = set(devices)
  total = 0
  for a in jax.live_arrays():
    try:
      total += _shard_bytes_on(a, devs)
    except Exception:   # an array deleted while we walk (another thread donated it)
      continue
  return total


def tree_bytes_on(tree, devices: Iterable[jax.Device]) -> int:
  """Bytes of the shards of `tree`'s arrays that live on `devices`."""
  devs = set(devices)
  return sum(_shard_bytes_on(a, devs) for a in jax.tree.leaves(tree) if isinstance(a, jax.Array))


def bytes_in_use(devices: Iterable[jax.Device], arrays=None) -> int:
  """Device memory held on `devices`: the backend's count (GPU/TPU), else the bytes of `arrays`
  (a tree) where given, else of every live array. A caller whose devices other threads use
  passes `arrays`: walking jax.live_arrays() while other threads create and free arrays is
  not safe."""
  devices = list(devices)
  stats = _stats(devices)
  if stats is not None:
    return int(sum(s["bytes_in_use"] for s in stats))
  if arrays is not None:
    return tree_bytes_on(arrays, devices)
  return live_array_bytes(devices)


def backend_peak_bytes(devices: Iterable[jax.Device]) -> int | None:
  """The backend's high-water mark of `devices` since the process started (GPU/TPU), or None
  where it keeps none (CPU)."""
  stats = _stats(list(devices))
  if stats is None or not all("peak_bytes_in_use" in s for s in stats):
    return None
  return int(sum(s["peak_bytes_in_use"] for s in stats))


def compiled_temp_bytes(jitted, *args) -> int | None:
  """XLA's account of the temporaries of `jitted(*args)` (activations, gradients in flight),
  from the compiled program; after a call with the same shapes it is a cache hit, not a
  compilation. None where the backend gives no analysis."""
  try:
    analysis = jitted.lower(*args).compile().memory_analysis()
  except Exception:
    return None
  return None if analysis is None else int(analysis.temp_size_in_bytes)
