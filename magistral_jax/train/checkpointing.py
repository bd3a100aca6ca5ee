"""Run checkpoints with orbax: train state (params, optimizer state, counters) + JSON metadata
(stage, batch, policy version, data-iterator state, RNG seed).

A corrupted or partial latest checkpoint is skipped with a warning and the previous one is used.
"""
from __future__ import annotations

import logging
import os

import jax
import orbax.checkpoint as ocp

log = logging.getLogger(__name__)


class RunCheckpointer:
  def __init__(self, directory: str, *, keep: int = 3, keep_every: int = 0,
               async_save: bool = True):
    self.directory = os.path.abspath(directory)
    opts = ocp.CheckpointManagerOptions(
        max_to_keep=keep, keep_period=keep_every or None,
        enable_async_checkpointing=async_save, create=True)
    self.manager = ocp.CheckpointManager(self.directory, options=opts,
                                         item_names=("state", "meta"))

  def save(self, step: int, state, meta: dict, force: bool = False) -> bool:
    return self.manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=force)

  def wait(self):
    self.manager.wait_until_finished()

  def steps(self) -> list[int]:
    return sorted(self.manager.all_steps())

  def restore_latest(self, abstract_state):
    """(step, state, meta) of the newest checkpoint that restores cleanly, or None."""
    for step in reversed(self.steps()):
      try:
        out = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()))
        return step, out["state"], dict(out["meta"])
      except Exception as e:  # corrupted / partial: fall back to the previous one
        log.warning("checkpoint %d in %s cannot be restored (%s: %s); trying the previous one",
                    step, self.directory, type(e).__name__, str(e)[:300])
    return None

  def close(self):
    self.manager.wait_until_finished()
    self.manager.close()


def abstract_like(state):
  """ShapeDtypeStructs with shardings, the restore target for `state`'s layout."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
