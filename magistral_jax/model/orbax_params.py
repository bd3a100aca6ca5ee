"""Orbax checkpoints of the param tree alone, with the model's config.json beside them.

Each host writes only its own shards, and a restore can lay the arrays onto any mesh. (Run
checkpoints, with optimizer state and resume metadata, are magistral_jax/train/checkpointing.py.)
"""
from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from magistral_jax.model.config import ModelConfig
from magistral_jax.model.hf_layout import CONFIG_JSON, CheckpointError


def save_params_orbax(path: str, params: Any, cfg: ModelConfig | None = None) -> None:
  """Saves a (possibly sharded) param tree; each host writes only its shards.

  With cfg, also writes `<dirname(path)>/config.json` (beside the checkpoint directory, not in
  it, so orbax owns its directory alone), from which read_orbax_config rebuilds the config.
  """
  import orbax.checkpoint as ocp
  path = os.path.abspath(path)
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(path, params, force=True)
    ckptr.wait_until_finished()
  if cfg is not None:
    with open(os.path.join(os.path.dirname(path), CONFIG_JSON), "w") as f:
      json.dump(cfg.to_hf_config(), f, indent=2)


def syncing(processes, prefix: str):
  """orbax's multiprocessing options: synced over `processes` only (the ones that save or
  restore; in a run of many processes the trainer's, never a generator process), under their
  own barrier keys `prefix`; every process when None."""
  import orbax.checkpoint as ocp
  if not processes:
    return ocp.options.MultiprocessingOptions()
  return ocp.options.MultiprocessingOptions(primary_host=min(processes),
                                            active_processes=set(processes),
                                            barrier_sync_key_prefix=prefix)


def restore_params_orbax(path: str, target_shardings: Any = None, abstract: Any = None,
                         processes: tuple[int, ...] | None = None) -> Any:
  """Restores a param tree, onto any layout.

  target_shardings: a tree (same structure) of jax.sharding.Sharding, or one sharding for all.
  abstract: a tree of jax.ShapeDtypeStruct (with .sharding set) to restore into; overrides
  target_shardings. With neither, arrays come back on the default device.
  Shapes and dtypes come from the checkpoint's own metadata, so restoring onto a different mesh
  (or device count) needs only the new shardings.
  processes: in a run of many processes, the ones that restore (those of the shardings' devices:
  the trainer's). Orbax syncs the processes that restore; by default it waits for every process,
  and a generator process, which holds no trainer weights, never comes.
  """
  import jax
  import orbax.checkpoint as ocp
  path = os.path.abspath(path)
  if not os.path.isdir(path):
    raise CheckpointError(f"no orbax checkpoint at {path}")
  multi = syncing(processes if jax.process_count() > 1 else None, "params")
  with ocp.StandardCheckpointer(multiprocessing_options=multi) as ckptr:
    if abstract is None:
      meta = ckptr.metadata(path)
      meta = getattr(meta, "item_metadata", meta)
      meta = getattr(meta, "tree", meta)
      if target_shardings is None:
        target_shardings = jax.sharding.SingleDeviceSharding(jax.devices()[0])
      if isinstance(target_shardings, jax.sharding.Sharding):
        shardings = jax.tree.map(lambda _: target_shardings, meta)
      else:
        shardings = target_shardings
      abstract = jax.tree.map(
          lambda m, s: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype, sharding=s), meta, shardings)
    return ckptr.restore(path, abstract)


def read_orbax_config(path: str) -> ModelConfig:
  """The config.json save_params_orbax wrote beside `path` (or inside it)."""
  for cand in (os.path.join(os.path.dirname(os.path.abspath(path)), CONFIG_JSON),
               os.path.join(path, CONFIG_JSON)):
    if os.path.exists(cand):
      with open(cand) as f:
        hf = json.load(f)
      return ModelConfig.from_hf_config(
          hf, param_dtype=hf.get("torch_dtype") or hf.get("dtype") or "float32")
  raise CheckpointError(f"no {CONFIG_JSON} beside or inside the orbax checkpoint {path}")


def to_numpy_tree(params: Any) -> Any:
  """Device arrays -> host numpy (gathers sharded arrays)."""
  import jax
  return jax.tree.map(np.asarray, params)
