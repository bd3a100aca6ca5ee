"""A run's stages (paper §5: Medium trains at 16k, 24k, then 32k tokens, with smaller batches as
the completions grow): each is the run config with its overrides applied, validated."""
from __future__ import annotations

import dataclasses

import ml_collections as mlc

from magistral_jax import config as config_lib
from magistral_jax.config import RunConfig


@dataclasses.dataclass(frozen=True)
class Stage:
  index: int
  name: str
  num_batches: int
  run: RunConfig            # the run config with the stage's overrides


def stages(config: mlc.ConfigDict, run: RunConfig) -> list[Stage]:
  """The run's stages in order; a run without `stages` is one stage of num_batches batches."""
  listed = list(config.stages) or [{"name": "rl", "num_batches": run.num_batches,
                                    "overrides": {}}]
  out = []
  for i, s in enumerate(listed):
    overrides = dict(s.get("overrides", {}))
    srun = config_lib.validate(config_lib.apply_overrides(config, overrides)) if overrides \
        else run
    out.append(Stage(i, s.get("name", str(i)), int(s.get("num_batches", run.num_batches)), srun))
  return out


def training_sampling(run: RunConfig, eos_id: int | None):
  """The generators' sampler of a (stage's) run config, stopping on the tokenizer's EOS."""
  return dataclasses.replace(run.sampling, eos_id=eos_id)
