"""Loads a HF safetensors checkpoint straight onto a mesh, never holding the model on the host.

load_hf_safetensors (model/hf_checkpoint.py) reads every tensor into host memory and stacks the
layers before anything is placed, so the host holds the whole model (and, through the memory
map, the whole file) at once. `load_hf_sharded` returns the same params as that loader followed
by `jax.device_put(params, shardings)`, bit for bit, where `shardings` is
`transformer.params_on(cfg, mesh, rules)`: the layout train/step.py's init_state and
generate/weights.py take (so init_state's device_put of
them is a no-op). Each leaf is created already laid out and filled piece by piece:

- The stacked leaves (everything under 'layers', stacked over the layers on axis 0; see
  model/hf_layout.py) start as zeros made on their devices. Then, layer by layer, each of that
  layer's HF tensors is memory-mapped, viewed in our per-layer layout (hf_layout.hf_to_ours_layer:
  transposes and reshapes, no copy), cut into the views this process's devices hold and put on
  them; one jitted dynamic_update_slice per layer, donating the stacks, writes the layer in
  place (not into copies of the stacks).
- A leaf with no layer axis (embedding, final norm, lm_head) is assembled from its devices'
  slices, each read from the file on its own: the embedding is the largest tensor.

Why it is fast: a device's slice of a transposed tensor is handed to jax.device_put as a strided
view of the mapped file. The runtime's transfer gathers it (a tiled transpose) in the one copy it
makes anyway; a numpy copy of the view first would be a second pass, and a slow one (numpy's
transpose walks the source with a stride of a whole row). Reading the mapped bytes directly,
rather than through safetensors' get_tensor, saves a third.

The per-layer tensors come from hf_layout.layer_tensors(cfg), so every architecture that table
knows loads here too. Validation is load_hf_safetensors': every header is read and the names and
shapes checked (hf_layout.validate_tensor_shapes), and a tied lm_head the file carries anyway
is checked equal to the embedding, before any tensor is placed. `dtype` means what it means
there: cast every tensor to it (on the host, by numpy, slice by slice, as that loader casts), or
None to keep the stored dtypes.

Host memory. A non-layered leaf's slices are put on their devices one at a time
(jax.make_array_from_callback would first call back for every device and hold all the slices;
the embedding is as large as a few layers), copied out of maps of at most _CHUNK_BYTES of whole
rows each; a layer tensor's views go in one transfer, from one map of that tensor. Every map is
unmapped when its last view is dropped (see _Reader). Besides the placed params themselves, the
loader holds at most one layer's arrays on the devices, one mapped layer tensor and the slices
the transfer gathers from it (or one device's slice of a leaf with no layer axis, and one run of
mapped rows) on the host.

Many processes. Every process makes the same calls in the same order (the zeros and the updates
are programs over the whole mesh); `jax.make_array_from_single_device_arrays` takes only this
process's devices' pieces, so each process reads, casts and transfers only what its own devices
hold. For a leaf with no layer axis that is the rows of its devices' slices. A layer tensor is
read whole (its transposed layout scatters a device's slice over the HF tensor, and with
row-major storage a band of columns touches every page anyway), one layer at a time, and only
this process's slices of it are kept. tests/model/test_hf_sharded.py loads onto a mesh over 2 JAX
processes and checks both.
"""
from __future__ import annotations

import functools
import json
import math
import mmap
import struct
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from magistral_jax.model import transformer
from magistral_jax.model.config import ModelConfig
from magistral_jax.model.hf_checkpoint import (open_safetensors, read_config, read_headers,
                                               safetensors_files)
from magistral_jax.model.hf_layout import (CheckpointError, hf_to_ours_layer, layer_tensors,
                                           validate_tensor_shapes)
from magistral_jax.parallel.config import DEFAULT_RULES

# Rows of a tensor read through one memory map: bounds the mapped pages resident at once.
_CHUNK_BYTES = 64 << 20


def load_hf_sharded(path: str, mesh: Mesh, rules=DEFAULT_RULES, cfg: ModelConfig | None = None,
                    dtype=None) -> tuple[ModelConfig, dict]:
  """Loads a HF checkpoint (directory, model.safetensors, or index.json) onto `mesh`.

  Returns (cfg, params) as load_hf_safetensors does (cfg.param_dtype set to the loaded dtype),
  but every leaf a jax Array laid out by `rules` on `mesh` (see the module docstring). cfg:
  defaults to the config.json in the checkpoint directory. dtype: cast every tensor to it;
  default keeps the stored dtypes (the bit-exact path).
  """
  directory, weight_map = safetensors_files(path)
  if cfg is None:
    cfg = read_config(directory, path)
  shapes, where = read_headers(weight_map)
  validate_tensor_shapes(shapes, cfg, path)
  reader = _Reader(where, shapes)
  want = None if dtype is None else np.dtype(dtype)
  param_shapes = transformer.param_shapes(cfg)
  shardings = transformer.params_on(cfg, mesh, rules)

  # The plan, checked against the tree the model expects before anything is read.
  plan = []   # (leaf path, HF names (one per layer, or one), layer suffix or None, transposed)
  for sub, suffix in layer_tensors(cfg):
    plan.append((("layers",) + sub, [f"model.layers.{i}.{suffix}" for i in range(cfg.num_layers)],
                 suffix, False))
  plan.append((("embed", "embedding"), ["model.embed_tokens.weight"], None, False))
  plan.append((("final_norm", "scale"), ["model.norm.weight"], None, False))
  if not cfg.tie_word_embeddings:
    plan.append((("lm_head", "kernel"), ["lm_head.weight"], None, True))
  expected = {tuple(k.key for k in kp) for kp, _ in jax.tree_util.tree_leaves_with_path(
      param_shapes)}
  planned = {leaf for leaf, *_ in plan}
  if planned != expected:
    raise CheckpointError(f"the {cfg.architecture} layout and the model's params differ: "
                          f"unplanned {sorted(expected - planned)}, "
                          f"not in the model {sorted(planned - expected)}")
  if cfg.tie_word_embeddings and "lm_head.weight" in where:
    _check_tied(reader, path)

  leaves = []   # (leaf path, names, suffix, transposed, shape, sharding, dtype)
  for leaf, names, suffix, transposed in plan:
    dt = want if want is not None else np.result_type(*(reader.dtype(n) for n in names))
    leaves.append((leaf, names, suffix, transposed, tuple(_at(param_shapes, leaf).shape),
                   _at(shardings, leaf), dt))
  stacked = [x for x in leaves if x[2] is not None]
  values = dict(zip([x[0] for x in stacked], _load_stacked(reader, stacked, cfg)))
  for leaf, names, _, transposed, shape, sharding, dt in leaves:
    if leaf not in values:
      values[leaf] = _load_leaf(reader, names[0], transposed, shape, sharding, dt)
  params: dict = {}
  for leaf, value in values.items():
    node = params
    for key in leaf[:-1]:
      node = node.setdefault(key, {})
    node[leaf[-1]] = value
  loaded = want if want is not None else reader.dtype("model.embed_tokens.weight")
  return cfg.replace(param_dtype=loaded.name), params


def _at(tree, path: Sequence[str]):
  for key in path:
    tree = tree[key]
  return tree


class _Reader:
  """Reads tensors, or blocks of their rows, through memory maps of just those bytes.

  The byte ranges come from each file's header (safetensors: a little-endian u64 header length,
  the JSON header with each tensor's dtype, shape and data_offsets, then the data). A map is
  made for one read and unmapped when the last array viewing it is dropped: a mapped page counts
  in the process's resident memory for as long as its map lives, so one map held through the
  load would end up holding the whole file."""

  def __init__(self, where: dict[str, str], shapes: dict[str, tuple]):
    self.where, self.shapes = where, shapes
    self._dtypes: dict[str, np.dtype] = {}
    self._offsets: dict[str, int] = {}   # name -> the byte its data starts at, in its file
    for file in sorted(set(where.values())):   # one pass over each file's header
      with open_safetensors(file) as f:
        for name in f.keys():
          sl = f.get_slice(name)
          # An empty block reads no data but carries the stored dtype.
          self._dtypes[name] = (sl[0:0] if shapes[name] else f.get_tensor(name)).dtype
          del sl   # a slice object keeps the map alive
      self._offsets.update(_data_offsets(file, {n: (shapes[n], self._dtypes[n])
                                                for n, w in where.items() if w == file}))

  def dtype(self, name: str) -> np.dtype:
    return self._dtypes[name]

  def view(self, name: str, r0: int = 0, r1: int | None = None) -> np.ndarray:
    """Rows r0:r1 of tensor `name` (all of it by default), a read-only view on their own map."""
    shape, dt = self.shapes[name], self.dtype(name)
    r1 = (shape[0] if shape else 1) if r1 is None else r1
    row = dt.itemsize * math.prod(shape[1:])
    start = self._offsets[name] + r0 * row
    aligned = start - start % mmap.ALLOCATIONGRANULARITY
    length = (r1 - r0) * row
    if length == 0:
      return np.empty((0,) + tuple(shape[1:]), dt)
    try:
      with open(self.where[name], "rb") as f:
        # MAP_POPULATE: the pages are mapped in one call rather than faulted in one by one.
        m = mmap.mmap(f.fileno(), start - aligned + length, offset=aligned,
                      flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                      prot=mmap.PROT_READ)
    except (OSError, ValueError) as e:
      raise CheckpointError(f"cannot read tensor {name} from {self.where[name]}: {e}") from e
    out = np.frombuffer(m, dt, (r1 - r0) * math.prod(shape[1:]), start - aligned)
    return out.reshape(((r1 - r0),) + tuple(shape[1:]) if shape else ())

  def read(self, name: str, box: Sequence[slice] = ()) -> np.ndarray:
    """The block `box` (a slice per leading axis; the rest whole) of tensor `name`, a new array,
    copied out of maps of at most _CHUNK_BYTES of its rows at a time."""
    shape = self.shapes[name]
    if not shape:
      return np.array(self.view(name))
    box = [slice(*s.indices(n)) for s, n in zip(box, shape)]
    box += [slice(0, n, 1) for n in shape[len(box):]]
    if any(s.step != 1 for s in box):
      raise ValueError(f"strided block {box} of {name}")
    r0, r1 = box[0].start, box[0].stop
    row_bytes = self.dtype(name).itemsize * math.prod(shape[1:])
    per = max(1, _CHUNK_BYTES // max(1, row_bytes))
    out = np.empty((r1 - r0,) + tuple(s.stop - s.start for s in box[1:]), self.dtype(name))
    for a in range(r0, r1, per):
      b = min(r1, a + per)
      out[a - r0:b - r0] = self.view(name, a, b)[(slice(None),) + tuple(box[1:])]
    return out


def _data_offsets(file: str, tensors: dict[str, tuple[tuple, np.dtype]]) -> dict[str, int]:
  """name -> absolute byte offset of its data in `file`, from the safetensors header, each
  checked to span exactly its shape's bytes."""
  try:
    with open(file, "rb") as f:
      (n,) = struct.unpack("<Q", f.read(8))
      header = json.loads(f.read(n))
    out = {}
    for name, (shape, dt) in tensors.items():
      begin, end = header[name]["data_offsets"]
      if end - begin != dt.itemsize * math.prod(shape):
        raise ValueError(f"tensor {name} spans {end - begin} bytes, not the "
                         f"{dt.itemsize * math.prod(shape)} of {dt.name}{list(shape)}")
      out[name] = 8 + n + begin
    return out
  except (OSError, ValueError, KeyError, struct.error) as e:
    raise CheckpointError(f"cannot read the safetensors header of {file}: {e}") from e


def _check_tied(reader: _Reader, path: str) -> None:
  """A tied lm_head the file carries must equal the embedding (compared in runs of rows)."""
  head, emb = "lm_head.weight", "model.embed_tokens.weight"
  rows, row_bytes = reader.shapes[emb][0], reader.dtype(emb).itemsize * reader.shapes[emb][1]
  per = max(1, _CHUNK_BYTES // max(1, row_bytes))
  for a in range(0, rows, per):
    box = (slice(a, min(rows, a + per)),)
    if not np.array_equal(reader.read(head, box), reader.read(emb, box)):
      raise CheckpointError(f"{path}: config ties word embeddings but lm_head.weight differs "
                            "from model.embed_tokens.weight")


def _pieces(sharding: NamedSharding, shape: tuple) -> list[tuple[tuple, list]]:
  """(index, this process's devices holding it) for every distinct slice of `shape`."""
  groups: dict[tuple, tuple[tuple, list]] = {}
  for device, index in sharding.addressable_devices_indices_map(shape).items():
    key = tuple((s.start, s.stop, s.step) for s in index)
    groups.setdefault(key, (index, []))[1].append(device)
  return list(groups.values())


def _assemble(shape: tuple, sharding: NamedSharding, get: Callable[[tuple], np.ndarray],
              batched: bool):
  """A global array from `get(index)` per distinct slice this process's devices hold. batched:
  all slices in one transfer (the host holds them all at once); else each slice is put on its
  devices before the next is read, so one is on the host at a time."""
  hosts, devices, arrays = [], [], []
  for index, devs in _pieces(sharding, shape):
    host = get(index)
    if batched:
      hosts += [host] * len(devs)
      devices += devs
    else:
      arrays += jax.device_put([host] * len(devs), devs)
    del host
  if batched:
    arrays = jax.device_put(hosts, devices)
  return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


def _load_leaf(reader: _Reader, name: str, transposed: bool, shape: tuple,
               sharding: NamedSharding, dt: np.dtype):
  """A leaf with no layer axis: HF tensor `name`, or its transpose, read slice by slice."""
  def get(index):
    if transposed:
      return reader.read(name, index[::-1]).T.astype(dt, copy=False)
    return reader.read(name, index).astype(dt, copy=False)
  return _assemble(shape, sharding, get, batched=False)


@functools.lru_cache(maxsize=None)
def _zeros_fn(shapes: tuple, dtypes: tuple, shardings: tuple):
  return jax.jit(lambda: tuple(jnp.zeros(s, d) for s, d in zip(shapes, dtypes)),
                 out_shardings=shardings)


@functools.lru_cache(maxsize=None)
def _put_layer_fn(shardings: tuple):
  # The stacks are donated: each layer is written into their buffers, not into copies of them.
  # One program for every stacked leaf: a call per layer, not per layer and leaf.
  def put(stacks, layer, i):
    return tuple(_update_bits(s, x, i) for s, x in zip(stacks, layer))
  return jax.jit(put, donate_argnums=0, out_shardings=shardings)


def _update_bits(stack, layer, i):
  """stack[i] = layer, on the bits: XLA:CPU computes a bfloat16 dynamic-update-slice in float32,
  converting the whole stack there and back (a pass over the leaf per layer); an unsigned
  integer of the same width is updated in place. Bit-exact either way."""
  if stack.dtype.itemsize not in (1, 2, 4):
    return jax.lax.dynamic_update_index_in_dim(stack, layer, i, 0)
  bits = jnp.dtype(f"uint{8 * stack.dtype.itemsize}")
  new = jax.lax.dynamic_update_index_in_dim(jax.lax.bitcast_convert_type(stack, bits),
                                            jax.lax.bitcast_convert_type(layer, bits), i, 0)
  return jax.lax.bitcast_convert_type(new, stack.dtype)


def _layer_sharding(sharding: NamedSharding, ndim: int) -> NamedSharding:
  """The sharding of one layer of a stacked leaf: the stack's, without the layer axis."""
  spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
  return NamedSharding(sharding.mesh, P(*spec[1:]))


def _load_stacked(reader: _Reader, leaves: list, cfg: ModelConfig) -> tuple:
  """Every leaf stacked over layers, layer i of each from its HF tensor names[i], written into
  zeros in place. leaves: (leaf path, names, suffix, transposed, shape, sharding, dtype)."""
  if not leaves:
    return ()
  shapes = tuple(x[4] for x in leaves)
  shardings = tuple(x[5] for x in leaves)
  stacks = _zeros_fn(shapes, tuple(x[6] for x in leaves), shardings)()
  put = _put_layer_fn(shardings)
  for i in range(cfg.num_layers):
    layer = []
    for _, names, suffix, _, shape, sharding, dt in leaves:
      ours = hf_to_ours_layer(suffix, reader.view(names[i]), cfg)
      if ours.shape != shape[1:]:
        raise CheckpointError(f"{names[i]} in our layout has shape {ours.shape}, expected "
                              f"{shape[1:]}")
      # One layer tensor's slices together on the host: a transfer per tensor, not per device.
      layer.append(_assemble(shape[1:], _layer_sharding(sharding, len(shape)),
                             lambda index: ours[index].astype(dt, copy=False),
                             batched=True))
      del ours
    stacks = put(stacks, tuple(layer), np.int32(i))
    del layer
    # Wait for the update, so this layer's arrays are freed before the next layer is read.
    jax.block_until_ready(stacks)
  return stacks
