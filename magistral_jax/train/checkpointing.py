"""Run checkpoints with orbax: train state (params, optimizer state, counters) + JSON metadata
(stage, batch, policy version, data-iterator state, RNG seed).

A corrupted or partial latest checkpoint is skipped with a warning and the previous one is used.
The broken step directory is moved aside (to `<directory>.broken/`), not deleted: nothing is
lost, and the resumed run can write that step number again (orbax refuses to overwrite a step).
"""
from __future__ import annotations

import logging
import os
import shutil
import time

import jax
import orbax.checkpoint as ocp

from magistral_jax.model.orbax_params import syncing

log = logging.getLogger(__name__)


class RunCheckpointer:
  def __init__(self, directory: str, *, keep: int = 3, keep_every: int = 0,
               async_save: bool = True, processes: tuple[int, ...] | None = None):
    """`processes`: in a run of many processes, the ones that hold the state (the trainer's);
    they save and restore together, the first writing the metadata. None: every process."""
    if keep < 1:
      raise ValueError(f"checkpoint keep={keep}: keep at least the latest checkpoint")
    self.directory = os.path.abspath(directory)
    if processes:   # orbax leaves the directory of a subset of processes to them
      os.makedirs(self.directory, exist_ok=True)
    multi = syncing(processes, "trainer")
    opts = ocp.CheckpointManagerOptions(
        max_to_keep=keep, keep_period=keep_every or None,
        enable_async_checkpointing=async_save, create=not processes,
        multiprocessing_options=multi)
    self.manager = ocp.CheckpointManager(self.directory, options=opts,
                                         item_names=("state", "meta"))

  def save(self, step: int, state, meta: dict, force: bool = False) -> bool:
    return self.manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=force)

  def wait(self):
    self.manager.wait_until_finished()

  def steps(self) -> list[int]:
    return sorted(self.manager.all_steps())

  def restore(self, step: int, abstract_state):
    """(state, meta) of one step; raises if it cannot be restored."""
    out = self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()))
    return out["state"], dict(out["meta"])

  def restore_latest(self, abstract_state):
    """(step, state, meta) of the newest checkpoint that restores cleanly, or None."""
    broken = []
    found = None
    for step in reversed(self.steps()):
      try:
        state, meta = self.restore(step, abstract_state)
        found = step, state, meta
        break
      except Exception as e:  # corrupted / partial: fall back to the previous one
        log.warning("checkpoint %d in %s cannot be restored (%s: %s); trying the previous one",
                    step, self.directory, type(e).__name__, str(e)[:300])
        broken.append(step)
    if found is not None:
      for step in broken:   # only newer than the one we resume from: they would block saving
        self._move_aside(step)
    return found

  def _move_aside(self, step: int):
    src = os.path.join(self.directory, str(step))
    if not os.path.isdir(src):
      return
    dst_root = self.directory + ".broken"
    os.makedirs(dst_root, exist_ok=True)
    dst = os.path.join(dst_root, f"{step}-{time.strftime('%Y%m%d-%H%M%S')}")
    shutil.move(src, dst)
    log.warning("moved the unrestorable checkpoint %d to %s", step, dst)
    self.manager.reload()

  def close(self):
    self.manager.wait_until_finished()
    self.manager.close()


def abstract_like(state):
  """ShapeDtypeStructs with shardings, the restore target for `state`'s layout."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
