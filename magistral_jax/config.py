"""The run configuration (ml_collections), shared by every recipe in configs/.

Each section is a typed, frozen dataclass defined in the package that uses it (model/config.py,
rl/config.py, generate/config.py, ...; the evaluation's here, below), where each default and
the comment that cites the paper (paper §.., NOT STATED; docs/paper.md) is written once.
`default_config()` assembles them into a ConfigDict (`config_section`: a dataclass's defaults as
its section; `checked_fields`: a section back to the dataclass's keyword arguments): a recipe
(configs/tiny.py, medium.py, ...) overrides what it needs, and absl flags override anything
(`--config.rl.eps_high=0.3`, `--config.devices.generators=(1,)`: every sequence field is a tuple,
the only sequence absl overrides).

`validate(config)` turns the ConfigDict into a `RunConfig` of those dataclasses and raises a
clear error before any work starts: unknown fields, wrong types, each section's own checks
(n_batch not divisible by n_mini, group size < 2, ...), checks across sections (a microbatch row
too short for the longest sequence the generators can return, device counts that the machine
cannot provide), and every stage's overridden config. It warns (log) when the master weights'
dtype cannot hold an update of the learning rate (README, "Mixed precision"). The run's code
takes the RunConfig's section objects, not the ConfigDict.

This module imports the config modules only, so it sits below everything that uses config.
"""
from __future__ import annotations

import dataclasses
import logging
import typing
from typing import Any, Mapping

import ml_collections as mlc

from magistral_jax.data.config import DataConfig
from magistral_jax.generate.config import EngineConfig, SamplingConfig
from magistral_jax.model.config import InitConfig, ModelConfig
from magistral_jax.parallel.config import DevicesConfig, ShardingConfig
from magistral_jax.pipeline.config import PipelineConfig
from magistral_jax.rewards.config import RewardConfig
from magistral_jax.rl.config import GRPOConfig
from magistral_jax.tool_use.config import ToolConfig
from magistral_jax.train.config import (CheckpointConfig, OptimizerConfig, SFTConfig,
                                        update_rounding_warning)
from magistral_jax.verify.config import VerifierConfig

log = logging.getLogger(__name__)


# The `eval` section: the held-out evaluation (paper §4: temperature 0.7, top-p 1.0 for math,
# 0.95 for code; pass@1 averaged over k samples and maj@k). It lives here, not in eval/ as the
# other sections live in their rooms: evaluation runs a whole run config (eval/checkpoint.py
# validates one, eval/in_run.py evaluates inside a run), so its room sits above this module.
@dataclasses.dataclass(frozen=True)
class EvalConfig:
  """k samples per problem at `temperature`/`top_p` (or greedy), each up to max_new_tokens.
  before: a run evaluates its initial weights (False: a control run from the same weights as
  the run it controls); every: also every that many RL batches (the learning curve; 0 = only
  before and after)."""
  k: int = 1
  temperature: float = 0.7
  top_p: float = 1.0
  greedy: bool = True
  max_new_tokens: int = 256
  before: bool = True
  every: int = 0

  def __post_init__(self):
    if self.k < 1:
      raise ValueError(f"eval.k={self.k}: at least one sample per problem")
    if self.every < 0:
      raise ValueError(f"eval.every={self.every} must be >= 0 (0: before and after only)")

  def sampling(self, eos_id: int | None = None) -> SamplingConfig:
    """The evaluation's sampler."""
    return SamplingConfig(temperature=self.temperature, top_p=self.top_p, greedy=self.greedy,
                          max_new_tokens=self.max_new_tokens, eos_id=eos_id)

# The fields of SamplingConfig the `sampling` section holds (the rest: eos_id comes from the
# tokenizer, greedy and stop_strings are evaluation-only).
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "max_new_tokens")
STAGE_KEYS = ("name", "num_batches", "overrides")
SYSTEM_PROMPTS = ("magistral", "tiny", "none")
_SCALARS = (bool, int, float, str)


def as_tuples(value):
  """`value` with every list, at any depth, made a tuple: a config written to JSON and read back
  has lists where the config had tuples (every sequence field of the run config is a tuple, so
  that absl flags can override it)."""
  if isinstance(value, (list, tuple)):
    return tuple(as_tuples(v) for v in value)
  if isinstance(value, dict):
    return {k: as_tuples(v) for k, v in value.items()}
  return value


def checked_fields(cls, cd: Mapping[str, Any], what: str) -> dict:
  """The mapping as a dict of the dataclass `cls`'s fields (lists made tuples); any other key is
  an error naming it."""
  d = dict(cd.to_dict() if hasattr(cd, "to_dict") else cd)
  valid = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(d) - valid)
  if unknown:
    raise ValueError(f"unknown {what} config field(s): {unknown}; valid: {sorted(valid)}")
  return {k: as_tuples(v) for k, v in d.items()}


def _optional_scalar(hint) -> type | None:
  """T for a `T | None` annotation with T a scalar type; None otherwise."""
  args = typing.get_args(hint)
  if len(args) == 2 and type(None) in args:
    (t,) = [a for a in args if a is not type(None)]
    return t if t in _SCALARS else None
  return None


def config_section(cls) -> mlc.ConfigDict:
  """A ConfigDict of every field of the dataclass `cls` at its default. An optional scalar field
  (`float | None`, ...) becomes a FieldReference typed with its scalar type, so a flag override
  can set a value where the default is None (`--config.rl.dual_clip_c=3.0`) and a recipe can
  still set None."""
  hints = typing.get_type_hints(cls)
  instance = cls()
  out = {}
  for f in dataclasses.fields(cls):
    value = getattr(instance, f.name)
    scalar = _optional_scalar(hints[f.name])
    out[f.name] = mlc.FieldReference(value, field_type=scalar) if scalar else value
  return mlc.ConfigDict(out)


def default_config() -> mlc.ConfigDict:
  c = mlc.ConfigDict()
  c.seed = 0
  c.num_batches = 10            # RL batches per stage unless the stage says otherwise
  # Stop the process cleanly once the run has trained this many batches in all (counting those
  # of a resumed run's earlier processes), after checkpointing them; 0 = no limit. A relaunch on
  # the same workdir with a larger (or no) limit resumes from there (the rehearsal tests).
  c.stop_after_batches = 0
  # JAX's persistent compilation cache, for every launch/*.py: a relaunch that compiles the same
  # programs (a resumed run, an evaluation of its checkpoint) loads them from here instead of
  # compiling them again. An entry's key holds the program, the jax/XLA versions, the XLA flags
  # and the devices, so other shapes or versions never load it. "" = off. The least recently
  # used entries go above compilation_cache_max_gb (0 = no limit). JAX_COMPILATION_CACHE_DIR,
  # when set (the tests set it; "" = off), wins over both. Of many processes, only process 0
  # writes (JAX's rule): the others load its entries where they see its directory (a shared
  # file system) and their devices match the key (always on GPU, whose key leaves them out).
  c.compilation_cache_dir = "~/.cache/magistral_jax/xla"
  c.compilation_cache_max_gb = 20.0
  # ---- policy: model/config.py ----
  c.model = config_section(ModelConfig)
  c.init = config_section(InitConfig)
  c.tokenizer = "char"          # char | gguf | a tokenizer.json path | a mistral-common name
  c.system_prompt = "magistral"  # magistral (paper §2, the paper's Fig. 2) | tiny | none
  # ---- RL objective and batching (paper §1, §4, §5): rl/config.py, train/config.py ----
  c.rl = config_section(GRPOConfig)
  c.optimizer = config_section(OptimizerConfig)
  # ---- generation: generate/config.py ----
  c.sampling = mlc.ConfigDict({f: getattr(SamplingConfig(), f) for f in SAMPLING_FIELDS})
  c.engine = config_section(EngineConfig)
  # ---- reward (paper §2): rewards/config.py; its verifier pool: verify/config.py ----
  c.reward = config_section(RewardConfig)
  c.verifier = config_section(VerifierConfig)
  # ---- tool calls mid-reasoning (issue #67, beyond the paper): tool_use/protocol.py ----
  c.tools = config_section(ToolConfig)
  # ---- pipeline, devices and sharding (paper §5): pipeline/config.py, parallel/config.py ----
  c.pipeline = config_section(PipelineConfig)
  c.devices = config_section(DevicesConfig)
  c.sharding = config_section(ShardingConfig)
  # ---- data (data/config.py), cold-start SFT and checkpoints (train/config.py), evaluation
  # (EvalConfig, above) ----
  c.data = config_section(DataConfig)
  c.sft = config_section(SFTConfig)
  c.eval = config_section(EvalConfig)
  c.checkpoint = config_section(CheckpointConfig)
  # Stages run in sequence (Medium: 16k/24k/32k, batch 8k/4k/2k): a tuple of dicts, each with
  # `name`, `num_batches` and `overrides` ({"rl.n_batch": 4096, "reward.l_max": ...}).
  c.stages = ()
  return c


def _get(config, dotted):
  node = config
  for part in dotted.split("."):
    node = node[part]
  return node


def apply_overrides(config: mlc.ConfigDict, overrides: dict) -> mlc.ConfigDict:
  """A copy of `config` with dotted-path overrides (lists made tuples); unknown paths are errors."""
  c = mlc.ConfigDict(config.to_dict())
  for path, value in overrides.items():
    head, _, leaf = path.rpartition(".")
    parent = _get(c, head) if head else c
    if leaf not in parent:
      raise ValueError(f"stage override {path!r}: no such config field")
    parent[leaf] = as_tuples(value)
  return c


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """A validated run config: one frozen dataclass per section, and the run's scalars."""
  model: ModelConfig
  init: InitConfig
  rl: GRPOConfig
  optimizer: OptimizerConfig
  sampling: SamplingConfig   # the training sampler's (eos_id: the tokenizer's, set by the run)
  engine: EngineConfig
  reward: RewardConfig
  verifier: VerifierConfig
  pipeline: PipelineConfig
  devices: DevicesConfig
  sharding: ShardingConfig   # .trainer_rules, .generator_rules: the tables the code takes
  data: DataConfig
  sft: SFTConfig
  eval: EvalConfig
  checkpoint: CheckpointConfig
  tools: ToolConfig = ToolConfig()
  seed: int = 0
  num_batches: int = 10
  stop_after_batches: int = 0
  tokenizer: str = "char"
  system_prompt: str = "magistral"

  @property
  def colocated(self) -> bool:
    return self.devices.colocated


def validate(config: mlc.ConfigDict, num_devices: int | None = None) -> RunConfig:
  """Typed configs from the ConfigDict, with every check that can fail before any work; each
  stage's overridden config is checked too."""
  run = _typed(config, num_devices)
  warnings = _precision_warnings(run)
  for i, stage in enumerate(config.stages):
    name = stage.get("name", i)
    unknown = sorted(set(stage) - set(STAGE_KEYS))
    if unknown:
      raise ValueError(f"stages[{i}] ({name!r}): unknown key(s) {unknown}; valid: "
                       f"{list(STAGE_KEYS)}")
    try:
      scfg = apply_overrides(config, dict(stage.get("overrides", {})))
      warnings += _precision_warnings(_typed(scfg, num_devices))
    except (TypeError, ValueError) as e:
      raise ValueError(f"stages[{i}] ({name!r}): {e}") from None
  for w in dict.fromkeys(warnings):   # once each, in order
    log.warning(w)
  return run


def _precision_warnings(run: RunConfig) -> list[str]:
  """The RL optimizer's and the cold-start SFT's learning rates against the master weights'
  dtype (train.config.update_rounding_warning)."""
  out = [update_rounding_warning(run.model.param_dtype, run.optimizer.learning_rate, "optimizer"),
         update_rounding_warning(run.model.param_dtype, run.sft.learning_rate, "sft")]
  return [w for w in out if w]


def _typed(config: mlc.ConfigDict, num_devices: int | None) -> RunConfig:
  """validate() of one config, its stages aside."""
  try:
    unknown = sorted(set(config) - {f.name for f in dataclasses.fields(RunConfig)}
                     - {"compilation_cache_dir", "compilation_cache_max_gb", "stages"})
    if unknown:
      raise ValueError(f"unknown config field(s): {unknown}")
    if config.get("system_prompt", "magistral") not in SYSTEM_PROMPTS:
      raise ValueError(f"system_prompt must be one of {list(SYSTEM_PROMPTS)}, got "
                       f"{config.system_prompt!r}")
    unknown = sorted(set(config.sampling) - set(SAMPLING_FIELDS))
    if unknown:
      raise ValueError(f"unknown sampling config field(s): {unknown}; valid: "
                       f"{list(SAMPLING_FIELDS)}")
    run = RunConfig(model=_section(ModelConfig, config, "model"),
                    init=_section(InitConfig, config, "init"),
                    rl=_section(GRPOConfig, config, "rl"),
                    optimizer=_section(OptimizerConfig, config, "optimizer"),
                    # the sampler's own checks (temperature > 0, top-p in (0, 1], ...)
                    sampling=SamplingConfig(**config.sampling),
                    engine=_section(EngineConfig, config, "engine"),
                    reward=_section(RewardConfig, config, "reward"),
                    verifier=_section(VerifierConfig, config, "verifier"),
                    pipeline=_section(PipelineConfig, config, "pipeline"),
                    devices=_section(DevicesConfig, config, "devices"),
                    sharding=_section(ShardingConfig, config, "sharding"),
                    data=_section(DataConfig, config, "data"),
                    sft=_section(SFTConfig, config, "sft"),
                    eval=_section(EvalConfig, config, "eval"),
                    checkpoint=_section(CheckpointConfig, config, "checkpoint"),
                    tools=_section(ToolConfig, config, "tools"),
                    **{k: config[k] for k in ("seed", "num_batches", "stop_after_batches",
                                              "tokenizer", "system_prompt") if k in config})
    run.eval.sampling()   # the evaluation sampler's own checks
  except TypeError as e:
    raise ValueError(f"bad config: {e}") from e
  run.pipeline.bounds(run.rl)
  run.rl.check_row_fits(run.engine.max_prefill_length, run.sampling.max_new_tokens)
  if num_devices is not None:
    run.devices.check_layout(num_devices)
  return run


def _section(cls, config: mlc.ConfigDict, name: str):
  """The dataclass `cls` from the section `name` (its defaults where a config written before the
  section existed has none)."""
  return cls(**checked_fields(cls, config.get(name, {}), name))
