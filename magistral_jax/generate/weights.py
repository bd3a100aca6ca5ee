"""An engine's weights: validating what it is given and putting it on its mesh in the decode layout;
a trainer's push onto an engine (transfer_params).

`load` returns the params in the model's serving dtype (ModelConfig.serving_param_dtype: the
compute dtype, e.g. bf16 under fp32 master weights; every use casts a weight to it anyway) and
decode layout (transformer.to_decode_layout: one array per layer, so a decode step reads each
weight once instead of copying it out of the layer stack first); it accepts stacked params (e.g.
the trainer's FSDP layout, resharded onto the engine's mesh) or params already in the decode
layout.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from magistral_jax.model import transformer as T
from magistral_jax.model.config import ModelConfig
from magistral_jax.parallel.sharding import param_shardings


class ParamsMismatchError(ValueError):
  """New params whose tree structure or shapes differ from the engine's."""


class NonFiniteError(FloatingPointError):
  """NaN/Inf in params or in the logits of an active slot."""


def _all_finite(tree):
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


class Weights:
  """The stacked and decode layouts of one model's params on one mesh. param_shardings: the
  stacked layout (what a trainer pushes, resharded onto this mesh); decode_param_shardings: the
  layout the engine's programs take."""

  def __init__(self, cfg: ModelConfig, mesh: Mesh, rules):
    self.dtype = cfg.jnp_serving_param_dtype
    shapes = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, self.dtype), T.param_shapes(cfg))
    axes = T.param_logical_axes(cfg)
    self._shapes, self._treedef = shapes, jax.tree.structure(shapes)
    self.param_shardings = param_shardings(axes, mesh, rules, shapes)
    self._decode_shapes = T.decode_layout_tree(shapes, cfg.num_layers)
    self._decode_treedef = jax.tree.structure(self._decode_shapes)
    self.decode_param_shardings = param_shardings(
        T.decode_layout_tree(axes, cfg.num_layers), mesh, rules, self._decode_shapes)
    self._check_finite = jax.jit(_all_finite)
    self._cast = jax.jit(lambda p: jax.tree.map(lambda x: x.astype(self.dtype), p))
    # Stacked -> decode layout and the finiteness check in one program (one read of the weights).
    self._to_decode = jax.jit(lambda p: (T.to_decode_layout(p), _all_finite(p)),
                              out_shardings=(self.decode_param_shardings,
                                             NamedSharding(mesh, P())))

  def check(self, params) -> None:
    """Raises ParamsMismatchError unless `params` has the model's tree structure and shapes
    (stacked, or in the decode layout)."""
    treedef = jax.tree.structure(params)
    if treedef == self._decode_treedef:
      ref_shapes = self._decode_shapes
    elif treedef == self._treedef:
      ref_shapes = self._shapes
    else:
      raise ParamsMismatchError(
          f"params tree structure differs from the engine's: got {treedef}, expected "
          f"{self._treedef} (stacked) or its decode layout")
    bad = []
    for (path, x), ref in zip(jax.tree_util.tree_leaves_with_path(params),
                              jax.tree.leaves(ref_shapes)):
      if tuple(np.shape(x)) != tuple(ref.shape):
        bad.append(f"{jax.tree_util.keystr(path)}: {tuple(np.shape(x))} != {tuple(ref.shape)}")
    if bad:
      raise ParamsMismatchError("params shapes differ from the engine's: " + "; ".join(bad))

  def cast(self, params) -> Any:
    """`params` in this engine's dtype, cast by one jitted program on the devices they are on
    (the trainer's, for a weight push: the transfer to this mesh then moves bf16 rather than the
    fp32 master weights; jit cannot span the two device sets, so the cast and the reshard are
    two steps, neither through the host). Returns `params` itself when no leaf needs a cast."""
    if all(x.dtype == self.dtype for x in jax.tree.leaves(params)):
      return params
    if not all(isinstance(x, jax.Array) for x in jax.tree.leaves(params)):   # host arrays
      return jax.tree.map(lambda x: np.asarray(x).astype(self.dtype), params)
    return self._cast(params)

  def load(self, params) -> Any:
    """Validates params (structure, shapes, finiteness) and puts them on the mesh in the
    serving dtype (cfg.serving_param_dtype; cast first, where they are, so only those bytes
    move), resharding from whatever sharding they come in, in the decode layout. Stacked params
    are resharded as they are, then split per layer on this mesh, in the same program as the
    finiteness check."""
    self.check(params)
    decode = T.is_decode_layout(params)
    params = self.cast(params)
    if decode:
      params = jax.device_put(params, self.decode_param_shardings)
      finite = self._check_finite(params)
    else:
      params, finite = self._to_decode(jax.device_put(params, self.param_shardings))
    if not bool(finite):
      raise NonFiniteError("params contain NaN or Inf; refusing to generate with them")
    return params


def transfer_params(params, engine, cast: dict | None = None):
  """The trainer's params as `engine` receives them in a push: cast to its weight dtype on the
  trainer's devices (memoised per dtype in `cast`, so several generators share one cast), then
  moved device to device onto its param shardings. may_alias=False: the trainer donates its
  state next step, so the generator must never share its buffers (an uncast push, or leaves the
  cast forwards unchanged, would be the trainer's own)."""
  cast = {} if cast is None else cast
  dt = engine.param_dtype
  if dt not in cast:
    cast[dt] = engine.cast_params(params)
  return jax.device_put(cast[dt], engine.param_shardings, may_alias=False)
