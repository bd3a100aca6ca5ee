"""The run config: defaults come from the typed dataclasses, every sequence field is a tuple that
absl flags can override, sharding rules are config, and each check lives in one dataclass."""
import dataclasses
import importlib
import json
import os

import ml_collections as mlc
import pytest
from absl import flags
from ml_collections import config_flags

from magistral_jax import config as config_lib
from magistral_jax.generate.config import SamplingConfig
from magistral_jax.model.config import ModelConfig
from magistral_jax.parallel import config as parallel_config
from magistral_jax.pipeline.config import PipelineConfig
from magistral_jax.rewards.config import RewardConfig
from magistral_jax.rl.config import GRPOConfig
from magistral_jax.train.config import OptimizerConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = ("tiny", "smollm2", "smollm2_learn", "small", "medium", "sft_small", "qwen")
SECTIONS = {"model": ModelConfig, "rl": GRPOConfig, "optimizer": OptimizerConfig,
            "reward": RewardConfig, "engine": config_lib.EngineConfig,
            "sharding": parallel_config.ShardingConfig, "pipeline": PipelineConfig,
            "init": config_lib.InitConfig, "verifier": config_lib.VerifierConfig,
            "devices": config_lib.DevicesConfig, "data": config_lib.DataConfig,
            "sft": config_lib.SFTConfig, "eval": config_lib.EvalConfig,
            "checkpoint": config_lib.CheckpointConfig}


def _load(name, arg=None):
  return importlib.import_module(f"configs.{name}").get_config(arg)


def test_each_section_default_is_its_dataclass_default():
  # A default written in default_config() as well as in the dataclass fails here once they differ.
  # (pipeline.batch_timeout_s read 600 s in PipelineConfig while runs took default_config()'s
  # 1800 s: a stalled run was expected to stop after 10 minutes and went on for 30.)
  c = config_lib.default_config()
  for name, cls in SECTIONS.items():
    assert c[name].to_dict() == dataclasses.asdict(cls()), name
  assert c.sampling.to_dict() == {f: getattr(SamplingConfig(), f)
                                  for f in config_lib.SAMPLING_FIELDS}
  run = config_lib.validate(c)
  for name, cls in SECTIONS.items():
    assert getattr(run, name) == cls(), name


def _sequences(tree, path=""):
  """Paths of every list in a nested dict/tuple."""
  if isinstance(tree, list):
    yield path
  if isinstance(tree, dict):
    for k, v in tree.items():
      yield from _sequences(v, f"{path}.{k}")
  if isinstance(tree, (list, tuple)):
    for i, v in enumerate(tree):
      yield from _sequences(v, f"{path}[{i}]")


@pytest.mark.parametrize("name", RECIPES)
def test_every_sequence_field_is_a_tuple(name):
  assert not list(_sequences(_load(name).to_dict()))
  assert not list(_sequences(config_lib.default_config().to_dict()))


def _flags(argv):
  fv = flags.FlagValues()
  holder = config_flags.DEFINE_config_file("config", flag_values=fv, sys_argv=argv)
  fv(argv)
  return holder.value


def test_tuple_and_optional_fields_are_overridable_from_the_command_line():
  argv = ["train", f"--config={ROOT}/configs/tiny.py",
          "--config.devices.generators=(1,)",
          "--config.rl.dual_clip_c=3.0",
          "--config.reward.languages=('en', 'fr')",
          "--config.sharding.generator_rules=(('embed', None), ('heads', 'tensor'))",
          "--config.sharding.trainer_rules=(('embed', 'fsdp'), ('act_batch', ('data', 'fsdp')))",
          "--config.stages=({'name': 'a', 'num_batches': 2, 'overrides': {'rl.n_batch': 32}},)"]
  c = _flags(argv)
  assert c.devices.generators == (1,)
  run = config_lib.validate(c, num_devices=5)
  assert run.rl.dual_clip_c == 3.0
  assert run.reward.languages == ("en", "fr")
  assert run.sharding.generator_rules == (("embed", None), ("heads", "tensor"))
  assert run.sharding.trainer_rules == (("embed", "fsdp"), ("act_batch", ("data", "fsdp")))
  assert config_lib.apply_overrides(c, c.stages[0]["overrides"]).rl.n_batch == 32
  with pytest.raises(ValueError, match="has 5"):
    config_lib.validate(_flags(argv[:2] + ["--config.devices.generators=(2, 2)"]), 5)


def test_rules_from_config_round_trips_and_names_what_is_wrong():
  for rules in (parallel_config.TRAINER_RULES, parallel_config.GENERATOR_RULES):
    assert parallel_config.rules_from_config(rules) == rules
    # As a config written to JSON reads back: lists, made tuples again (hashable for ShardingCtx).
    back = parallel_config.rules_from_config(json.loads(json.dumps(rules)))
    assert back == rules and hash(back)
  c = config_lib.default_config()
  saved = mlc.ConfigDict(json.loads(c.to_json()))
  assert config_lib.validate(saved) == config_lib.validate(c)
  where = "sharding.trainer_rules"
  for rules, message in [
      ((("embd", "fsdp"),), r"sharding.trainer_rules\[0\]: unknown logical axis 'embd'"),
      ((("embed", "fsdpp"),), r"\[0\]: 'embed' -> unknown mesh axis 'fsdpp'"),
      ((("embed", ("fsdp", "data", "fsdp")),), r"repeats a mesh axis"),
      ((("embed", None), ("embed", "fsdp")), r"\[1\]: logical axis 'embed' has a rule already"),
      ((("embed",),), r"\[0\] = \('embed',\): expected a \(logical axis, mesh axes\) pair"),
      ((("embed", 3),), r"expected a mesh axis")]:
    with pytest.raises(ValueError, match=message):
      parallel_config.rules_from_config(rules, where)
    c = config_lib.default_config()
    c.sharding.trainer_rules = rules
    with pytest.raises(ValueError, match=message):
      config_lib.validate(c)


def test_logical_axes_cover_every_name_the_model_uses():
  import jax
  from magistral_jax.parallel import sharding
  from magistral_jax.model import transformer
  names = set()
  for tree in (transformer.param_logical_axes(ModelConfig()), transformer.cache_logical_axes(),
               transformer.cache_logical_axes(per_layer=2)):
    for axes in jax.tree.leaves(tree, is_leaf=sharding.is_logical_axes):
      names.update(a for a in axes if a is not None)
  assert names <= set(parallel_config.LOGICAL_AXES)


def test_each_check_lives_in_its_dataclass():
  with pytest.raises(ValueError, match="group_size=1: GRPO needs at least 2"):
    GRPOConfig(n_batch=4, n_mini=4, group_size=1)
  with pytest.raises(ValueError, match="n_mini=12 is not a multiple of group_size=8"):
    GRPOConfig(n_batch=24, n_mini=12, group_size=8)
  with pytest.raises(ValueError, match="RewardConfig: need 0 <= l_cache <= l_max"):
    RewardConfig(l_max=64, l_cache=65)
  assert RewardConfig(l_max=64, l_cache=0).l_cache == 0   # a hard cut-off at l_max
  assert RewardConfig(languages=["en"]).languages == ("en",)
  with pytest.raises(ValueError, match="engine.attention_windows=0"):
    config_lib.EngineConfig(attention_windows=0)
  with pytest.raises(ValueError, match="engine.loop_prefill_below=-0.1"):
    config_lib.EngineConfig(loop_prefill_below=-0.1)
  # validate() reports them, and the samplers', before any work.
  for overrides, message in [
      ({"rl.n_batch": 72, "rl.n_mini": 36}, "n_mini=36 is not a multiple of group_size=8"),
      ({"reward.l_cache": 99999}, "l_cache"),
      ({"engine.attention_windows": 0}, "engine.attention_windows=0"),
      ({"sampling.temperature": 0.0}, "temperature must be > 0"),
      ({"eval.top_p": 1.5}, "top_p must be in"),
      ({"pipeline.mode": "fast"}, "pipeline.mode must be async|sync, got 'fast'"),
      ({"pipeline.n_async": 32}, r"n_async \+ max_queue = 32 < n_batch=64: a batch could never "
                                 "fill"),
      ({"pipeline.max_consecutive_dropped": -1}, "max_consecutive_dropped")]:
    with pytest.raises(ValueError, match=message):
      config_lib.validate(config_lib.apply_overrides(config_lib.default_config(), overrides))
  c = config_lib.default_config()
  c.sampling.greedy = True   # evaluation-only: the training sampler has no such field
  with pytest.raises(ValueError, match=r"unknown sampling config field\(s\): \['greedy'\]"):
    config_lib.validate(c)


def test_stages_are_validated_with_their_overrides():
  c = config_lib.default_config()
  c.stages = ({"name": "ok", "overrides": {"rl.n_batch": 128}},
              {"name": "bad", "overrides": {"rl.n_mini": 48}})
  with pytest.raises(ValueError, match=r"stages\[1\] \('bad'\): .*n_batch=64 is not a multiple"):
    config_lib.validate(c)
  c.stages = ({"name": "typo", "overides": {}},)
  with pytest.raises(ValueError, match=r"stages\[0\] \('typo'\): unknown key\(s\) \['overides'\]"):
    config_lib.validate(c)
  c.stages = ({"overrides": {"rl.n_btach": 8}},)
  with pytest.raises(ValueError, match="no such config field"):
    config_lib.validate(c)
  # A list in an override becomes a tuple, like the field it replaces.
  assert config_lib.apply_overrides(c, {"devices.generators": [1]}).devices.generators == (1,)


def test_validate_proves_the_longest_sequence_fits_a_microbatch_row():
  # Default rows hold 8192 / 4 = 2048 tokens and prompts up to 256: a completion of 1793 new
  # tokens packs into 256 + 1793 - 1 = 2048, one more token does not fit any row.
  c = config_lib.default_config()
  c.sampling.max_new_tokens = 1793
  config_lib.validate(c)
  c.sampling.max_new_tokens = 1794
  with pytest.raises(ValueError, match=(
      r"engine.max_prefill_length=256 prompt tokens \+ sampling.max_new_tokens=1794 - 1 = 2049 "
      r"packed tokens, does not fit a microbatch row of rl.microbatch_tokens=8192 / "
      r"rl.microbatch_rows=4 = 2048 tokens: raise rl.microbatch_tokens to at least 8196 .*"
      r"lower rl.microbatch_rows, or lower engine.max_prefill_length or "
      r"sampling.max_new_tokens")):
    config_lib.validate(c)
  # A stage that lengthens generation or shortens rows is checked with its overrides.
  for overrides in ({"sampling.max_new_tokens": 4096}, {"engine.max_prefill_length": 4096},
                    {"rl.microbatch_rows": 8}):
    c = config_lib.default_config()
    c.sampling.max_new_tokens = 1793
    c.stages = ({"name": "long", "overrides": overrides},)
    with pytest.raises(ValueError, match=r"stages\[0\] \('long'\): the longest sequence"):
      config_lib.validate(c)


@pytest.mark.parametrize("name", ["medium", "small"])
def test_paper_recipes_train_on_45k_token_sequences(name):
  # The paper's longest sequence: a 4k-token prompt and 40k new tokens (issue: a 16k row
  # stopped the run at collation).
  from magistral_jax.rl.collate import Completion, first_fit
  c = _load(name)
  longest = Completion(prompt_tokens=[1] * c.engine.max_prefill_length,
                       completion_tokens=[2] * c.sampling.max_new_tokens)
  assert longest.num_tokens == 45055
  for stage in c.stages or ({"overrides": {}},):
    run = config_lib.validate(config_lib.apply_overrides(c, dict(stage["overrides"])))
    assert first_fit([longest.num_tokens] * 3, run.rl.row_len) == [[0], [1], [2]]


def test_one_device_runs_the_colocated_variants_and_the_error_names_them():
  # The default (disaggregated) layout on one device: the error says which variant fits.
  with pytest.raises(ValueError, match=r"has 1 .*configs/tiny.py.*colocated"):
    config_lib.validate(_load("tiny"), num_devices=1)
  for name, arg in (("tiny", "colocated"), ("tiny", "colocated,mode=async,batches=3"),
                    ("smollm2", "colocated"), ("smollm2", "gpu,colocated"),
                    ("smollm2", "sft,gpu,colocated")):
    c = _load(name, arg)
    assert c.devices.colocated and c.devices.trainer == 1, (name, arg)
    config_lib.validate(c, num_devices=1)
  assert _load("tiny", "colocated").pipeline.mode == "sync"   # taking turns by default
  assert _load("tiny", "mode=async,colocated").pipeline.mode == "async"   # lookahead, if asked
  # The same from the command line, on any recipe.
  c = _flags(["train", f"--config={ROOT}/configs/tiny.py", "--config.devices.colocated=True",
              "--config.devices.trainer=1", "--config.pipeline.mode=sync"])
  config_lib.validate(c, num_devices=1)
  with pytest.raises(ValueError, match="colocated on trainer=2 devices, but this machine has 1"):
    config_lib.validate(_flags(["train", f"--config={ROOT}/configs/tiny.py",
                                "--config.devices.colocated=True"] + [
                                    "--config.devices.trainer=2"]), num_devices=1)


def test_every_section_is_a_frozen_dataclass_and_names_a_bad_field():
  """validate() hands the run each section as its frozen dataclass; an unknown field or a bad
  value in any section is an error naming the section and the field."""
  run = config_lib.validate(config_lib.default_config())
  for name, cls in SECTIONS.items():
    section = getattr(run, name)
    assert isinstance(section, cls) and cls.__dataclass_params__.frozen, name
    c = config_lib.default_config()
    c[name]["no_such_field"] = 1
    with pytest.raises(ValueError, match=rf"no_such_field"):
      config_lib.validate(c)
  for section, field, value in [("verifier", "num_workers", 0), ("eval", "k", 0),
                                ("checkpoint", "every", 0), ("data", "heldout", -1),
                                ("sft", "schedule", "linear"), ("init", "source", "pickle"),
                                ("devices", "trainer_mesh", {"model": 2})]:
    c = config_lib.default_config()
    c[section][field] = value
    with pytest.raises(ValueError, match=rf"{section}\.{field}"):
      config_lib.validate(c)
  c = config_lib.default_config()
  c.no_such_section = 1
  with pytest.raises(ValueError, match="no_such_section"):
    config_lib.validate(c)


def test_config_imports_only_the_config_modules():
  """config.py sits below everything that uses config: importing it loads the sections' config
  modules (and the packages' __init__.py, which import nothing), no implementation."""
  import subprocess
  import sys
  code = ("import sys; import magistral_jax.config; "
          "print(' '.join(m for m in sys.modules if m.startswith('magistral_jax')))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  loaded = out.stdout.split()
  allowed = {"magistral_jax", "magistral_jax.config", "magistral_jax.rewards.length"}
  implementation = [m for m in loaded if m not in allowed and not m.endswith(".config")
                    and m.count(".") > 1]
  assert not implementation, implementation


def test_a_stage_runs_on_the_config_with_its_overrides():
  from magistral_jax.run.stages import stages
  c = config_lib.default_config()
  c.stages = ({"name": "short", "num_batches": 2, "overrides": {"reward.l_max": 512,
                                                                "reward.l_cache": 128}},
              {"name": "long", "num_batches": 3, "overrides": {}})
  run = config_lib.validate(c)
  short, long_ = stages(c, run)
  assert (short.name, short.num_batches, short.run.reward.l_max) == ("short", 2, 512)
  assert long_.run is run and long_.num_batches == 3
  assert [s.num_batches for s in stages(config_lib.default_config(), run)] == [run.num_batches]

