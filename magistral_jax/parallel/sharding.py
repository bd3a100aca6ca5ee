"""Meshes, logical axis rules and shardings (maxtext style).

Every parameter and every activation that matters carries *logical* axis names ('embed', 'heads',
'act_batch', ...). A rules table maps each logical name to zero or more *mesh* axes. The same model
code and the same params can therefore be laid out FSDP-style on the trainer and tensor-parallel on
a generator, just by pairing them with another (mesh, rules).

The tables are run config (`config.sharding.trainer_rules`, `.generator_rules`; TRAINER_RULES and
GENERATOR_RULES in parallel/config.py are their defaults); `rules_from_config` checks a configured table and
returns it in the form the functions here take.

Mesh axes: 'data' (pure data parallel), 'fsdp' (data parallel + parameter sharding), 'tensor'
(Megatron-style tensor parallel over heads / MLP / vocab).
"""
from __future__ import annotations

import dataclasses
import logging
import math
import types
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from magistral_jax.parallel.config import DEFAULT_RULES, MESH_AXES

log = logging.getLogger(__name__)


def make_mesh(shape: Mapping[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A mesh over ('data', 'fsdp', 'tensor'); missing axes get size 1, -1 takes what is left."""
  devices = list(jax.devices() if devices is None else devices)
  unknown = set(shape) - set(MESH_AXES)
  if unknown:
    raise ValueError(f"unknown mesh axes {sorted(unknown)}; valid axes: {MESH_AXES}")
  sizes = [int(shape.get(a, 1)) for a in MESH_AXES]
  if sizes.count(-1) > 1:
    raise ValueError(f"at most one mesh axis may be -1, got {dict(shape)}")
  if -1 in sizes:
    known = math.prod(s for s in sizes if s != -1)
    if len(devices) % known:
      raise ValueError(f"{len(devices)} devices cannot fill mesh {dict(shape)}")
    sizes[sizes.index(-1)] = len(devices) // known
  if math.prod(sizes) != len(devices):
    raise ValueError(f"mesh {dict(zip(MESH_AXES, sizes))} needs {math.prod(sizes)} devices, "
                     f"but {len(devices)} were given")
  return Mesh(np.asarray(devices, dtype=object).reshape(sizes), MESH_AXES)


def logical_to_spec(logical_axes: Sequence[str | None], rules=DEFAULT_RULES,
                    shape: Sequence[int] | None = None, mesh: Mesh | None = None) -> P:
  """PartitionSpec for one array. A mesh axis is used once per array, and dropped (replicated)
  where `shape` is given and the dimension is not divisible by the mesh axis size."""
  table = dict(rules)
  used: set[str] = set()
  spec = []
  for i, name in enumerate(logical_axes):
    axes = table.get(name) if name is not None else None
    if axes is None:
      spec.append(None)
      continue
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    keep = []
    for a in axes:
      if a in used:
        continue
      if mesh is not None and shape is not None:
        size = mesh.shape[a] * math.prod(mesh.shape[k] for k in keep)
        if shape[i] % size:
          continue
      keep.append(a)
    used.update(keep)
    spec.append(None if not keep else keep[0] if len(keep) == 1 else tuple(keep))
  return P(*spec)


def splits(shape: Sequence[int], logical_axes: Sequence[str | None], rules,
           sizes: Mapping[str, int]) -> tuple[int, ...]:
  """How many ways each dimension of an array of `shape` is split on a mesh of `sizes` (axis name
  -> size), placed as logical_to_spec places it: for planning without the devices."""
  spec = logical_to_spec(logical_axes, rules, shape, types.SimpleNamespace(shape=dict(sizes)))
  parts = tuple(spec) + (None,) * (len(shape) - len(spec))
  return tuple(math.prod(sizes[a] for a in (() if p is None else (p,) if isinstance(p, str) else p))
               for p in parts)


def logical_sharding(logical_axes: Sequence[str | None], mesh: Mesh, rules=DEFAULT_RULES,
                     shape: Sequence[int] | None = None) -> NamedSharding:
  return NamedSharding(mesh, logical_to_spec(logical_axes, rules, shape, mesh))


def is_logical_axes(x) -> bool:
  """A leaf of a logical-axes tree: a tuple of axis names (or None)."""
  return isinstance(x, tuple) and all(isinstance(a, (str, type(None))) for a in x)


def param_shardings(logical_axes_tree, mesh: Mesh, rules=DEFAULT_RULES, shapes_tree=None):
  """NamedShardings for a param tree on any mesh: the same params can be laid out one way on the
  trainer and another way on a generator. `shapes_tree` (arrays or ShapeDtypeStructs) lets
  non-divisible dimensions fall back to replication instead of failing."""
  if shapes_tree is None:
    return jax.tree.map(lambda ax: logical_sharding(ax, mesh, rules), logical_axes_tree,
                        is_leaf=is_logical_axes)
  return jax.tree.map(lambda ax, x: logical_sharding(ax, mesh, rules, x.shape),
                      logical_axes_tree, shapes_tree, is_leaf=is_logical_axes)


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


@dataclasses.dataclass(frozen=True)
class ShardingCtx:
  """(mesh, rules) bound into a model, so activations get sharding constraints.

  Hashable, so it can be a Flax module attribute; `None` in place of a ctx means "no constraints"
  (single device, or let XLA propagate)."""
  mesh: Mesh
  rules: tuple = DEFAULT_RULES

  def __call__(self, x, logical_axes: Sequence[str | None]):
    spec = logical_to_spec(logical_axes, self.rules, x.shape, self.mesh)
    return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))

  def sharding(self, logical_axes, shape=None) -> NamedSharding:
    return logical_sharding(logical_axes, self.mesh, self.rules, shape)


def constrain(shard: ShardingCtx | None, x, logical_axes):
  return x if shard is None else shard(x, logical_axes)
