"""The run configuration (ml_collections), shared by every recipe in configs/.

`default_config()` holds every field with its default; a recipe (configs/tiny.py, medium.py, ...)
overrides what it needs, and absl flags override anything (`--config.rl.eps_high=0.3`,
`--config.devices.generators=(1,)`: every sequence field is a tuple, the only sequence absl
overrides). The sections with a typed dataclass (model, rl, optimizer, reward, sampling, engine,
pipeline, sharding) take their defaults from it, so each default, and the comment that cites the paper
(paper §.., NOT STATED), is written once, next to the dataclass field.

`validate(config)` turns a ConfigDict into typed dataclasses and raises a clear error before any
work starts: unknown fields, wrong types, each dataclass's own checks (n_batch not divisible by
n_mini, group size < 2, ...), a microbatch row too short for the longest sequence the generators
can return (prompt limit + max_new_tokens), device counts that the machine cannot provide, and
every stage's overridden config. It warns (log) when the master weights' dtype cannot hold an
update of the learning rate (e.g. bf16 params at lr 1e-6: README, "Mixed precision").
"""
from __future__ import annotations

import dataclasses
import logging

import ml_collections as mlc

from magistral_jax.configurable import as_tuples, checked_fields, config_section
from magistral_jax.generate.engine import default_windows
from magistral_jax.generate.loop import check_loop_prefill_below
from magistral_jax.generate.sampling import SamplingConfig
from magistral_jax.model.config import ModelConfig
from magistral_jax.parallel.sharding import ShardingConfig
from magistral_jax.pipeline.build import check_device_layout, is_colocated
from magistral_jax.pipeline.rollouts import PipelineConfig
from magistral_jax.rewards.reward import RewardConfig
from magistral_jax.rl.config import GRPOConfig
from magistral_jax.train.optimizer import OptimizerConfig, update_rounding_warning

log = logging.getLogger(__name__)

# The fields of generate.sampling.SamplingConfig the `sampling` section holds (the rest: eos_id
# comes from the tokenizer, greedy and stop_strings are evaluation-only).
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "max_new_tokens")
STAGE_KEYS = ("name", "num_batches", "overrides")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """The generators' knobs (section `engine`) for generate.engine.Engine and
  generate.loop.GeneratorLoop."""
  max_concurrent_decodes: int = 16   # decode slots per generator
  max_prefill_length: int = 256      # the longest prompt a generator prefills, in tokens
  # On a weights update the KV cache of in-flight sequences is kept, as in the paper (paper §5);
  # True recomputes it under the new weights.
  recompute_kv_on_update: bool = False
  # On CPU, each generator times its decode step with both dot libraries (YNNPACK, Eigen) at
  # start-up and keeps the faster (Engine.tune): worth it for a real model on CPU (1.1-2.3x per
  # step on the 2-core hosts measured), not for the tiny model, whose run it would mostly spend
  # compiling (two compilations per step program). A no-op on accelerators.
  tune: bool = False
  # n > 1 gives each decode step the smallest of n windows over the KV cache that holds its
  # active slots, so it reads that much of the cache instead of all of it (one compiled step per
  # window, halving from the whole cache: S, S/2, ...; Engine.window_for). 1 = dense attention
  # over the whole cache.
  attention_windows: int = 1
  # A worker thread prefills queued prompts while the loop decodes (GeneratorLoop); on CPU the
  # two overlap (1.2-1.5x more work per second, docs/perf_log.md), on an accelerator they share the
  # device queue. False prefills in the loop thread between steps.
  background_prefill: bool = True
  # With background_prefill, when fewer than this fraction of the slots would decode, the loop
  # fills every free slot with its own prefill before stepping (GeneratorLoop; keeps
  # prefill-bound workloads from decoding near-empty batches).
  loop_prefill_below: float = 0.5
  # The token prefix every prompt of the run starts with (the rendered system prompt and
  # chat-template head; pipeline.build.shared_prompt_prefix) is prefilled once per weights
  # version and each prompt is prefilled as its own rest only (GeneratorLoop shared_prefix; the
  # same samples up to float rounding). Used when that prefix has at least
  # generate.loop.SHARED_PREFIX_MIN_TOKENS tokens.
  shared_prefix_cache: bool = True
  # The generator loop dispatches decode step n+1 before it fetches and records step n, so the
  # device decodes while the host transfers tokens, does the bookkeeping and refills slots
  # (GeneratorLoop overlap_host; one step in flight). Same samples; a finished sample's slot is
  # refilled one step later. Measured on an H100, batch 256, the synchronous loop step took
  # 1.7-1.9x the device step. False: dispatch, fetch, record in turn.
  overlap_host: bool = True

  def __post_init__(self):
    try:   # the Engine's own check of the window count, before any engine is built
      default_windows(self.max_prefill_length + 1, self.attention_windows)
    except ValueError as e:
      raise ValueError(f"engine.attention_windows={self.attention_windows}: {e}") from None
    try:
      check_loop_prefill_below(self.loop_prefill_below)
    except ValueError as e:
      raise ValueError(f"engine.{e}") from None


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
  # ---- policy ----
  c.model = config_section(ModelConfig)
  # Where the initial weights come from: random | gguf | hf | orbax (+ path). With gguf/hf the
  # checkpoint's own config.json/metadata replaces c.model's architecture fields.
  c.init = mlc.ConfigDict(dict(source="random", path=""))
  c.tokenizer = "char"          # char | gguf | a tokenizer.json path | a mistral-common name
  c.system_prompt = "magistral"  # magistral (paper §2, the paper's Fig. 2) | tiny | none
  # ---- RL objective and batching (paper §1, §4, §5): rl/config.py GRPOConfig ----
  c.rl = config_section(GRPOConfig)
  c.optimizer = config_section(OptimizerConfig)
  # ---- generation ----
  c.sampling = mlc.ConfigDict({f: getattr(SamplingConfig(), f) for f in SAMPLING_FIELDS})
  c.engine = config_section(EngineConfig)
  # ---- reward (paper §2): rewards/reward.py RewardConfig ----
  c.reward = config_section(RewardConfig)
  c.verifier = mlc.ConfigDict(dict(num_workers=2, task_timeout_s=60.0, max_tasks_per_worker=500))
  # ---- pipeline, devices and sharding (paper §5): pipeline/rollouts.py PipelineConfig ----
  c.pipeline = config_section(PipelineConfig)
  # Device layout: the first `trainer` devices train; then one slice per generator (the paper's
  # disaggregated layout). colocated=True: one generator on the trainer's own devices
  # (`generators` unused), generation and training taking turns (pipeline.mode sync) or
  # generating one batch ahead while a batch trains (async); pipeline/rollouts.py.
  # trainer_processes > 0: a run of many JAX processes (one per host, parallel/multihost.py):
  # processes 0..trainer_processes-1 train on all their devices, every other process serves one
  # generator on its own devices (`trainer` and `generators` unused): on all of them, or on its
  # first `generator_process_devices` (> 0).
  c.devices = mlc.ConfigDict(dict(trainer=4, generators=(2, 2), trainer_mesh={"fsdp": -1},
                                  generator_mesh={"tensor": -1}, colocated=False,
                                  trainer_processes=0, generator_process_devices=0))
  # Logical axis -> mesh axes tables of the trainer and the generators (parallel/sharding.py).
  c.sharding = config_section(ShardingConfig)
  # ---- data ----
  # source: the RL stream (data/prompts.py). The held-out evaluation set is the first `heldout`
  # problems of a seeded epoch of heldout_source (e.g. "gsm8k_test" for a run that trains on
  # "gsm8k_train"), or of source itself when heldout_source is "" (the stream then skips them).
  # A held-out set that shares a problem with the stream (id or question text) stops the run.
  c.data = mlc.ConfigDict(dict(source="synthetic", heldout_source="", data_dir="", min_steps=1,
                               max_steps=3, max_operand=20, allow_negative=True, heldout=64,
                               sft_slip_rate=0.0, sft_ramble_rate=0.0))
  # ---- cold-start SFT (Magistral Small; also the tiny warm start) ----
  # lr schedule: linear warmup, then constant or cosine down to final_lr_frac at the last step.
  c.sft = mlc.ConfigDict(dict(num_steps=0, batch_size=16, learning_rate=3e-3, row_len=512,
                              rows_per_micro=4, epochs=4, warmup_steps=0, schedule="constant",
                              final_lr_frac=0.1))
  # ---- evaluation (paper §4: temperature 0.7, top-p 1.0 math / 0.95 code) ----
  # before: launch/train.py evaluates the initial weights (False: a control run from the same
  # weights as the run it controls); every: also every that many batches (the learning curve).
  c.eval = mlc.ConfigDict(dict(k=1, temperature=0.7, top_p=1.0, greedy=True,
                               max_new_tokens=256, before=True, every=0))
  # ---- checkpoints and logging ----
  c.checkpoint = mlc.ConfigDict(dict(every=5, keep=3, keep_every=0, async_save=True))
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
  model: ModelConfig
  rl: GRPOConfig
  optimizer: OptimizerConfig
  reward: RewardConfig
  engine: EngineConfig
  pipeline: PipelineConfig
  sharding: ShardingConfig   # .trainer_rules, .generator_rules: the tables the code takes


def validate(config: mlc.ConfigDict, num_devices: int | None = None) -> RunConfig:
  """Typed configs from the ConfigDict, with every check that can fail before any work; each
  stage's overridden config is checked too."""
  run = _typed(config, num_devices)
  warnings = _precision_warnings(config, run)
  for i, stage in enumerate(config.stages):
    name = stage.get("name", i)
    unknown = sorted(set(stage) - set(STAGE_KEYS))
    if unknown:
      raise ValueError(f"stages[{i}] ({name!r}): unknown key(s) {unknown}; valid: "
                       f"{list(STAGE_KEYS)}")
    try:
      scfg = apply_overrides(config, dict(stage.get("overrides", {})))
      warnings += _precision_warnings(scfg, _typed(scfg, num_devices))
    except (TypeError, ValueError) as e:
      raise ValueError(f"stages[{i}] ({name!r}): {e}") from None
  for w in dict.fromkeys(warnings):   # once each, in order
    log.warning(w)
  return run


def _precision_warnings(config: mlc.ConfigDict, run: RunConfig) -> list[str]:
  """The RL optimizer's and the cold-start SFT's learning rates against the master weights'
  dtype (train.optimizer.update_rounding_warning)."""
  out = [update_rounding_warning(run.model.param_dtype, run.optimizer.learning_rate, "optimizer")]
  sft = config.get("sft")
  if sft is not None and "learning_rate" in sft:
    out.append(update_rounding_warning(run.model.param_dtype, float(sft.learning_rate), "sft"))
  return [w for w in out if w]


def _typed(config: mlc.ConfigDict, num_devices: int | None) -> RunConfig:
  """validate() of one config, its stages aside."""
  try:
    run = RunConfig(model=ModelConfig.from_config_dict(config.model),
                    rl=GRPOConfig.from_config_dict(config.rl),
                    optimizer=OptimizerConfig.from_config_dict(config.optimizer),
                    reward=_section(RewardConfig, config, "reward"),
                    engine=_section(EngineConfig, config, "engine"),
                    pipeline=_section(PipelineConfig, config, "pipeline"),
                    sharding=_section(ShardingConfig, config, "sharding"))
    # The samplers' own checks (temperature > 0, top-p in (0, 1], ...), before the model loads:
    # the training sampler's and the evaluation's.
    unknown = sorted(set(config.sampling) - set(SAMPLING_FIELDS))
    if unknown:
      raise ValueError(f"unknown sampling config field(s): {unknown}; valid: "
                       f"{list(SAMPLING_FIELDS)}")
    SamplingConfig(**config.sampling)
    SamplingConfig(temperature=config.eval.temperature, top_p=config.eval.top_p,
                   greedy=config.eval.greedy, max_new_tokens=config.eval.max_new_tokens)
  except TypeError as e:
    raise ValueError(f"bad config: {e}") from e
  run.pipeline.bounds(run.rl)
  run.rl.check_row_fits(run.engine.max_prefill_length, config.sampling.max_new_tokens)
  if num_devices is not None:
    check_device_layout(config.devices.trainer, config.devices.generators, num_devices,
                        is_colocated(config))
  return run


def _section(cls, config: mlc.ConfigDict, name: str):
  """The dataclass `cls` from the section `name` (its defaults where a config written before the
  section existed has none)."""
  return cls(**checked_fields(cls, config.get(name, {}), name))
