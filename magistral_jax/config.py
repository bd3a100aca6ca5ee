"""The run configuration (ml_collections), shared by every recipe in configs/.

`default_config()` holds every field with its default; a recipe (configs/tiny.py, medium.py, ...)
overrides what it needs, and absl flags override anything (`--config.rl.eps_high=0.3`). Fields
the paper does not state are marked NOT STATED here and in the recipes.

`validate(config)` turns a ConfigDict into typed dataclasses and raises a clear error before any
work starts: unknown fields, wrong types, n_batch not divisible by n_mini, group size < 2, device
counts that the machine cannot provide.
"""
from __future__ import annotations

import dataclasses

import ml_collections as mlc

from magistral_jax.configurable import checked_fields
from magistral_jax.model.config import ModelConfig
from magistral_jax.rewards.reward import RewardConfig
from magistral_jax.rl.config import GRPOConfig
from magistral_jax.train.optimizer import OptimizerConfig


def default_config() -> mlc.ConfigDict:
  c = mlc.ConfigDict()
  c.seed = 0
  c.num_batches = 10            # RL batches per stage unless the stage says otherwise
  # ---- policy ----
  c.model = mlc.ConfigDict(dict(
      vocab_size=104, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
      num_kv_heads=2, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-5,
      sliding_window=mlc.FieldReference(None, field_type=int), tie_word_embeddings=False,
      max_position_embeddings=4096, architecture="LlamaForCausalLM",
      bos_token_id=mlc.FieldReference(1, field_type=int),
      eos_token_id=mlc.FieldReference(2, field_type=int),
      param_dtype="float32", dtype="float32", remat="none", logits_chunk=256,
      logits_vocab_pieces=0))     # 0 = auto (4 on CPU, 1 on accelerators); see ModelConfig
  # Where the initial weights come from: random | gguf | hf | orbax (+ path). With gguf/hf the
  # checkpoint's own config.json/metadata replaces c.model's architecture fields.
  c.init = mlc.ConfigDict(dict(source="random", path=""))
  c.tokenizer = "char"          # char | gguf | a tokenizer.json path | a mistral-common name
  c.system_prompt = "magistral"  # magistral (SPEC §2, the paper's Fig. 2) | tiny | none
  # ---- RL objective and batching (SPEC §1, §4, §5) ----
  c.rl = mlc.ConfigDict(dict(
      eps_low=0.2,              # NOT STATED in the paper (0.2 = PPO/DAPO default)
      eps_high=0.28,            # Medium 0.26-0.28; Small 0.3
      dual_clip_c=mlc.FieldReference(None, field_type=float),
      stale_weight_cap=mlc.FieldReference(None, field_type=float),
      adv_norm="minibatch", adv_eps=1e-6, loss_agg="token", kl_coef=0.0, kl_estimator="k3",
      entropy_coef=0.0, length_only_groups="keep", reward_atol=1e-6,
      n_batch=64, n_mini=64,    # n_batch = n_mini (one optimizer step per batch) is the paper's best
      group_size=8,             # NOT STATED
      microbatch_tokens=8192, microbatch_rows=4))
  c.optimizer = mlc.ConfigDict(dict(
      learning_rate=1e-6,       # NOT STATED
      warmup_steps=0, schedule="constant", decay_steps=1000, final_lr_frac=0.1, b1=0.9, b2=0.95,
      eps=1e-8, weight_decay=0.0, grad_clip_norm=1.0))
  # ---- generation ----
  c.sampling = mlc.ConfigDict(dict(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=256))
  # tune: on CPU, each generator times its decode step with both dot libraries (YNNPACK, Eigen)
  # at start-up and keeps the faster (Engine.tune): worth it for a real model on CPU (1.1-2.3x
  # per step on the 2-core hosts measured), not for the tiny model, whose run it would mostly
  # spend compiling (two compilations per step program). A no-op on accelerators.
  # attention_windows: n > 1 gives each decode step the smallest of n windows over the KV cache
  # that holds its active slots, so it reads that much of the cache instead of all of it (one
  # compiled step per window, halving from the whole cache: S, S/2, ...; Engine.window_for).
  # 1 = dense attention over the whole cache.
  # background_prefill: a worker thread prefills queued prompts while the loop decodes
  # (GeneratorLoop); on CPU the two overlap (1.2-1.5x more work per second, BENCHMARKS.md), on an
  # accelerator they share the device queue. False prefills in the loop thread between steps.
  # loop_prefill_below: with background_prefill, when fewer than this fraction of the slots
  # would decode, the loop fills every free slot with its own prefill before stepping
  # (GeneratorLoop; keeps prefill-bound workloads from decoding near-empty batches).
  # shared_prefix_cache: the token prefix every prompt of the run starts with (the rendered system
  # prompt and chat-template head; pipeline.build.shared_prompt_prefix) is prefilled once per
  # weights version and each prompt is prefilled as its own rest only (GeneratorLoop
  # shared_prefix; the same samples up to float rounding). Used when that prefix has at least
  # generate.loop.SHARED_PREFIX_MIN_TOKENS tokens.
  c.engine = mlc.ConfigDict(dict(max_concurrent_decodes=16, max_prefill_length=256,
                                 recompute_kv_on_update=False, tune=False, attention_windows=1,
                                 background_prefill=True, loop_prefill_below=0.5,
                                 shared_prefix_cache=True))
  # ---- reward (SPEC §2) ----
  c.reward = mlc.ConfigDict(dict(
      l_max=40960, l_cache=8192,  # Small: l_max - l_cache = 32k; l_cache NOT STATED
      language_bonus=0.1, format_reward=0.1, correct_reward=0.9, length_penalty_max=0.1,
      num_tests=20, test_timeout_s=4.0, memory_mb=300, compile_timeout_s=10.0))
  c.verifier = mlc.ConfigDict(dict(num_workers=2, task_timeout_s=60.0, max_tasks_per_worker=500))
  # ---- pipeline and devices (SPEC §5) ----
  # n_async: completions generated in parallel (0 = 2 * n_batch); max_queue: generated, not yet
  # trained on, before the feeder stops submitting (0 = n_async). See pipeline/rl_pipeline.py.
  c.pipeline = mlc.ConfigDict(dict(mode="async", n_async=0, max_queue=0, sample_every=5,
                                   batch_timeout_s=1800.0))
  # Device layout: the first `trainer` devices train; then one slice per generator.
  c.devices = mlc.ConfigDict(dict(trainer=4, generators=[2, 2], trainer_mesh={"fsdp": -1},
                                  generator_mesh={"tensor": -1}))
  # ---- data ----
  c.data = mlc.ConfigDict(dict(source="synthetic", data_dir="", min_steps=1, max_steps=3,
                               max_operand=20, allow_negative=True, heldout=64,
                               sft_slip_rate=0.0))
  # ---- cold-start SFT (Magistral Small; also the tiny warm start) ----
  # lr schedule: linear warmup, then constant or cosine down to final_lr_frac at the last step.
  c.sft = mlc.ConfigDict(dict(num_steps=0, batch_size=16, learning_rate=3e-3, row_len=512,
                              rows_per_micro=4, epochs=4, warmup_steps=0, schedule="constant",
                              final_lr_frac=0.1))
  # ---- evaluation (SPEC §4: temperature 0.7, top-p 1.0 math / 0.95 code) ----
  c.eval = mlc.ConfigDict(dict(k=1, temperature=0.7, top_p=1.0, greedy=True,
                               max_new_tokens=256))
  # ---- checkpoints and logging ----
  c.checkpoint = mlc.ConfigDict(dict(every=5, keep=3, keep_every=0, async_save=True))
  # Stages run in sequence (Medium: 16k/24k/32k, batch 8k/4k/2k). Each stage is a dict with
  # `name`, `num_batches` and `overrides` ({"rl.n_batch": 4096, "reward.l_max": ...}).
  c.stages = []
  return c


def _get(config, dotted):
  node = config
  for part in dotted.split("."):
    node = node[part]
  return node


def apply_overrides(config: mlc.ConfigDict, overrides: dict) -> mlc.ConfigDict:
  """A copy of `config` with dotted-path overrides; unknown paths are errors."""
  c = mlc.ConfigDict(config.to_dict())
  for path, value in overrides.items():
    head, _, leaf = path.rpartition(".")
    parent = _get(c, head) if head else c
    if leaf not in parent:
      raise ValueError(f"stage override {path!r}: no such config field")
    parent[leaf] = value
  return c


@dataclasses.dataclass(frozen=True)
class RunConfig:
  model: ModelConfig
  rl: GRPOConfig
  optimizer: OptimizerConfig
  reward: RewardConfig


def validate(config: mlc.ConfigDict, num_devices: int | None = None) -> RunConfig:
  """Typed configs from the ConfigDict, with every check that can fail before any work."""
  try:
    model = ModelConfig.from_config_dict(config.model)
    rl = GRPOConfig.from_config_dict(config.rl)
    opt = OptimizerConfig.from_config_dict(config.optimizer)
    reward = RewardConfig(**checked_fields(RewardConfig, config.reward, "reward"))
  except TypeError as e:
    raise ValueError(f"bad config: {e}") from e
  if rl.group_size < 2:
    raise ValueError(f"rl.group_size={rl.group_size}: GRPO needs at least 2 completions per prompt")
  if rl.n_mini % rl.group_size:
    raise ValueError(f"rl.n_mini={rl.n_mini} must be a multiple of rl.group_size={rl.group_size} "
                     "(a group never straddles minibatches)")
  if config.pipeline.mode not in ("async", "sync"):
    raise ValueError(f"pipeline.mode={config.pipeline.mode!r}; expected async|sync")
  if reward.l_cache <= 0 or reward.l_cache > reward.l_max:
    raise ValueError(f"reward: need 0 < l_cache <= l_max, got l_cache={reward.l_cache}, "
                     f"l_max={reward.l_max}")
  if config.engine.attention_windows < 1:
    raise ValueError(f"engine.attention_windows={config.engine.attention_windows}: the number "
                     "of attention windows must be >= 1 (1 = dense attention)")
  if not 0.0 <= config.engine.loop_prefill_below <= 1.0:
    raise ValueError(f"engine.loop_prefill_below={config.engine.loop_prefill_below}: a fraction "
                     "of the slots, in [0, 1]")
  if num_devices is not None:
    need = config.devices.trainer + sum(config.devices.generators)
    if need > num_devices:
      raise ValueError(f"devices: trainer={config.devices.trainer} + generators="
                       f"{list(config.devices.generators)} = {need} devices, but this machine "
                       f"has {num_devices}")
  for stage in config.stages:
    apply_overrides(config, dict(stage.get("overrides", {})))
  return RunConfig(model, rl, opt, reward)
