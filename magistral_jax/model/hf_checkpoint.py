"""HF checkpoints: safetensors weights (one file, or shards with an index) and config.json.

Loaders return host numpy arrays (bf16 through ml_dtypes) in our tree (model/hf_layout.py); put
them on devices with `jax.device_put(params, shardings)`, or load them straight onto a mesh, with
no host copy of the whole model, with model/hf_sharded.py (which shares the helpers here).
Loading reads every file's header and validates the whole checkpoint (names, shapes, index
against shards) before any tensor is read, so nothing is half-loaded.
"""
from __future__ import annotations

import json
import os
import re
from typing import Any, Mapping

import numpy as np

from magistral_jax.model.config import ModelConfig
from magistral_jax.model.hf_layout import (CONFIG_JSON, CheckpointError, hf_to_params,
                                           params_to_hf, validate_tensor_shapes)

SAFETENSORS_SINGLE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"


def safetensors_files(path: str) -> tuple[str, dict[str, str] | None]:
  """(directory, tensor name -> file); a single file maps the name "" to itself."""
  if os.path.isfile(path):
    if path.endswith(".index.json"):
      directory = os.path.dirname(path)
      index_path = path
    else:
      return os.path.dirname(path), {"": path}  # a single .safetensors file
  else:
    directory = path
    index_path = os.path.join(path, SAFETENSORS_INDEX)
    if not os.path.exists(index_path):
      single = os.path.join(path, SAFETENSORS_SINGLE)
      if not os.path.exists(single):
        raise CheckpointError(f"no {SAFETENSORS_SINGLE} or {SAFETENSORS_INDEX} in {path}")
      return directory, {"": single}
  try:
    with open(index_path) as f:
      weight_map = json.load(f)["weight_map"]
  except (OSError, ValueError, KeyError) as e:
    raise CheckpointError(f"cannot read safetensors index {index_path}: {e}") from e
  return directory, {n: os.path.join(directory, fn) for n, fn in weight_map.items()}


def open_safetensors(file: str):
  """safe_open(file) over numpy; a file that cannot be opened raises CheckpointError naming it."""
  from safetensors import safe_open
  try:
    return safe_open(file, framework="numpy")
  except Exception as e:  # SafetensorError, OSError: the file name is what the user needs.
    raise CheckpointError(f"cannot read safetensors file {file}: {e}") from e


def read_headers(weight_map: dict[str, str]) -> tuple[dict[str, tuple], dict[str, str]]:
  """Reads every file's header: name -> shape, name -> file. Checks the index agrees."""
  shapes, where = {}, {}
  files = sorted(set(weight_map.values()))
  for file in files:
    if not os.path.exists(file):
      listed = [n for n, f in weight_map.items() if f == file][:3]
      raise CheckpointError(f"safetensors shard {file} (listed in the index for {listed}...) "
                            "does not exist")
    with open_safetensors(file) as f:
      for name in f.keys():
        if name in where:
          raise CheckpointError(f"tensor {name} appears in both {where[name]} and {file}")
        shapes[name] = tuple(f.get_slice(name).get_shape())
        where[name] = file
  if "" not in weight_map:
    for name, file in weight_map.items():
      if where.get(name) != file:
        raise CheckpointError(f"index says tensor {name} is in {file}, but "
                              f"{'it is in ' + where[name] if name in where else 'no shard has it'}")
    unindexed = [n for n in where if n not in weight_map]
    if unindexed:
      raise CheckpointError(f"tensor(s) {unindexed[:5]} are in shards but not in the index")
  return shapes, where


def read_config(directory: str, path: str) -> ModelConfig:
  """The ModelConfig of the config.json in a checkpoint's directory (`path` names it in errors)."""
  cfg_path = os.path.join(directory, CONFIG_JSON)
  if not os.path.exists(cfg_path):
    raise CheckpointError(f"no {CONFIG_JSON} next to {path}; pass cfg=")
  return ModelConfig.from_hf_config(cfg_path)


def load_hf_safetensors(path: str, cfg: ModelConfig | None = None,
                        dtype=None) -> tuple[ModelConfig, dict]:
  """Loads a HF checkpoint (directory, model.safetensors, or index.json) into our tree.

  cfg: defaults to the config.json in the checkpoint directory. dtype: cast every tensor to it
  (e.g. "float32"); default keeps the stored dtypes (the bit-exact path).
  """
  directory, weight_map = safetensors_files(path)
  if cfg is None:
    cfg = read_config(directory, path)
  shapes, where = read_headers(weight_map)
  validate_tensor_shapes(shapes, cfg, path)
  handles = {file: open_safetensors(file) for file in set(where.values())}
  try:
    def get(name):
      try:
        return handles[where[name]].get_tensor(name)
      except Exception as e:
        raise CheckpointError(f"cannot read tensor {name} from {where[name]}: {e}") from e
    params = hf_to_params(get, cfg, dtype)
    if cfg.tie_word_embeddings and "lm_head.weight" in where:
      if not np.array_equal(get("lm_head.weight"), get("model.embed_tokens.weight")):
        raise CheckpointError(f"{path}: config ties word embeddings but lm_head.weight differs "
                              "from model.embed_tokens.weight")
  finally:
    for h in handles.values():
      h.__exit__(None, None, None)
  if dtype is None:
    cfg = cfg.replace(param_dtype=params["embed"]["embedding"].dtype.name)
  else:
    cfg = cfg.replace(param_dtype=np.dtype(dtype).name)
  return cfg, params


def save_hf_safetensors(params: Mapping[str, Any], cfg: ModelConfig, path: str,
                        max_shard_bytes: int | None = None) -> list[str]:
  """Writes `path/config.json` and the weights as HF names (sharded past max_shard_bytes).

  Returns the written weight files. The dtypes are the params' own (cfg.param_dtype is updated
  to match in config.json's torch_dtype).
  """
  from safetensors.numpy import save_file
  tensors = params_to_hf(params, cfg)
  os.makedirs(path, exist_ok=True)
  dt = tensors["model.embed_tokens.weight"].dtype.name
  with open(os.path.join(path, CONFIG_JSON), "w") as f:
    json.dump(cfg.replace(param_dtype=dt).to_hf_config(), f, indent=2)
  meta = {"format": "pt"}  # transformers refuses files without it
  total = sum(t.nbytes for t in tensors.values())
  if max_shard_bytes is None or total <= max_shard_bytes:
    file = os.path.join(path, SAFETENSORS_SINGLE)
    save_file(tensors, file, metadata=meta)
    _remove_stale(path, keep={file})
    return [file]
  shards: list[dict[str, np.ndarray]] = [{}]
  size = 0
  for name, t in tensors.items():  # greedy, in layer order; a tensor bigger than a shard is alone
    if shards[-1] and size + t.nbytes > max_shard_bytes:
      shards.append({})
      size = 0
    shards[-1][name] = t
    size += t.nbytes
  files, weight_map = [], {}
  for i, shard in enumerate(shards):
    fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
    save_file(shard, os.path.join(path, fname), metadata=meta)
    files.append(os.path.join(path, fname))
    weight_map.update({n: fname for n in shard})
  with open(os.path.join(path, SAFETENSORS_INDEX), "w") as f:
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
  _remove_stale(path, keep=set(files) | {os.path.join(path, SAFETENSORS_INDEX)})
  return files


def _remove_stale(path: str, keep: set[str]) -> None:
  """Removes weight files of an earlier save into the same directory (they would shadow ours)."""
  for fn in os.listdir(path):
    full = os.path.join(path, fn)
    if full not in keep and (fn == SAFETENSORS_INDEX or re.fullmatch(
        r"model(-\d{5}-of-\d{5})?\.safetensors", fn)):
      os.remove(full)
