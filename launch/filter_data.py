r"""Filters problem JSONL into a training dataset (TFDS array_record) with a report.

  python launch/filter_data.py --input=raw.jsonl --kind=math --name=math_train \
      --data_dir=runs/data/tfds --out_dir=runs/data/filtered [--filters=format] [--workers=2]

The shipped public sets are named by --shipped instead of --input (MATH-500, GSM8K train
and test, HumanEval, MBPP sample), e.g. `--shipped=math500 --filters=format`.
Filters, in this order: format (math), code (code: reference solutions vote on the tests),
difficulty (math: k samples per problem from --stage1_model, then --stage2_model if given,
graded by the verifier pool; resumable), translate (math: --translate_fraction of the problems
through --translate_model). Models are GGUF files (default: the shipped SmolLM2-135M-Instruct).
Writes <out_dir>/<name>.jsonl, <out_dir>/<name>.report.json and the TFDS dataset <name>.
"""
import json
import logging
import os
import sys

from absl import app
from absl import flags
from ml_collections import config_flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from magistral_jax.data import code_filter as cf  # noqa: E402
from magistral_jax.data import difficulty as df  # noqa: E402
from magistral_jax.data import filters  # noqa: E402
from magistral_jax.data import format_filter as ff  # noqa: E402
from magistral_jax.data import records  # noqa: E402
from magistral_jax.data import translate as tr  # noqa: E402

_INPUT = flags.DEFINE_list("input", [], "JSONL files to read.")
_SHIPPED = flags.DEFINE_string("shipped", None, f"a shipped set instead of --input: {sorted(records.SHIPPED)}")
_KIND = flags.DEFINE_enum("kind", "math", list(records.KINDS), "record kind")
_FORMAT = flags.DEFINE_string("source_format", None, f"row layout: {sorted(records.ADAPTERS)} (default: --kind)")
_NAME = flags.DEFINE_string("name", None, "output dataset name (default: the shipped name)")
_DATA_DIR = flags.DEFINE_string("data_dir", "runs/data/tfds", "TFDS data dir to build into")
_OUT_DIR = flags.DEFINE_string("out_dir", "runs/data/filtered", "where the JSONL and report go")
_FILTERS = flags.DEFINE_list("filters", None, f"filters to run, in this order: {list(filters.FILTERS)} "
                             "(default: format for math, code for code, none for sft)")
_SPLIT = flags.DEFINE_string("split", "train", "TFDS split name")
_WORKERS = flags.DEFINE_integer("workers", 0, "processes for the format filter (0: in-process)")
# format
_NO_PROOFS = flags.DEFINE_bool("drop_proofs", True, "drop proof problems")
_NO_MULTI = flags.DEFINE_bool("drop_multi_part", True, "drop multi-part problems")
_REWRITE_MC = flags.DEFINE_bool("rewrite_multiple_choice", True, "rewrite MC as open answer (else drop)")
# code
_MIN_TESTS = flags.DEFINE_integer("min_tests", 5, "code: drop problems with fewer tests")
_FIX_AGREEMENT = flags.DEFINE_float("fix_agreement", 1.0, "code: fraction of solutions that must "
                                    "agree to rewrite a test none of them passes")
# difficulty (thresholds are NOT STATED in the paper)
_STAGE1_MODEL = flags.DEFINE_string("stage1_model", None, "GGUF of the stage-1 sampler (default: shipped SmolLM2)")
_STAGE2_MODEL = flags.DEFINE_string("stage2_model", None, "GGUF of the stage-2 sampler (an RL checkpoint); "
                                    "unset: stage 1 only")
_K = flags.DEFINE_integer("k", 16, "samples per problem")
_S1 = flags.DEFINE_list("stage1_pass_rate", ["0.0625", "0.75"], "stage 1 [min, max] pass rate kept")
_S2 = flags.DEFINE_list("stage2_pass_rate", ["0.0625", "0.625"], "stage 2 [min, max] pass rate kept")
_CONSENSUS = flags.DEFINE_float("consensus_fraction", 0.5, "stage 2: drop if more than this "
                                "fraction of samples agree on a wrong answer")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 1024, "completion length for sampling")
_TEMPERATURE = flags.DEFINE_float("temperature", 1.0, "sampling temperature")
_SLOTS = flags.DEFINE_integer("slots", 32, "generator decode slots")
_VERIFIERS = flags.DEFINE_integer("verifier_workers", 2, "verifier pool processes")
# translation
_TRANSLATE_MODEL = flags.DEFINE_string("translate_model", None, "GGUF of the translator (default: shipped SmolLM2)")
_TRANSLATE_FRACTION = flags.DEFINE_float("translate_fraction", 0.1, "fraction of problems translated")
_LANGS = flags.DEFINE_list("translate_languages", list(tr.TranslationConfig().languages), "target languages")
_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Optional run config (configs/*.py). Its reward definition grades the "
    "difficulty samples, and its sampling.temperature, sampling.max_new_tokens, "
    "engine.max_concurrent_decodes and verifier.num_workers replace --temperature, "
    "--max_new_tokens, --slots and --verifier_workers unless those flags are given explicitly.")


def _from_config(holder, name: str, value):
  """An explicit flag wins; otherwise the config's value (when a config is given)."""
  return holder.value if value is None or flags.FLAGS[name].present else value


def _generator(path, temperature, max_new_tokens, slots, greedy=False, prompt_len=1024,
               system_prompt=None):
  """A GeneratorLoop on all local devices (tensor parallel) for a GGUF model, and its tokenizer.
  With `system_prompt` (what every prompt it gets is rendered with) the prompts' common prefix
  is prefilled once (GeneratorLoop shared_prefix)."""
  import jax
  from magistral_jax.generate import Engine, GeneratorLoop, SamplingConfig
  from magistral_jax.model.gguf_checkpoint import load_gguf
  from magistral_jax.parallel.sharding import make_mesh
  cfg, params, tok = load_gguf(path)
  tp = max(d for d in (1, 2, 4, 8) if len(jax.devices()) % d == 0 and cfg.num_kv_heads % d == 0)
  engine = Engine(cfg, make_mesh({"tensor": tp}, jax.devices()[:tp]), max_concurrent_decodes=slots,
                  max_prefill_length=prompt_len, max_decode_length=max_new_tokens,
                  sampling=SamplingConfig(temperature=temperature, greedy=greedy,
                                          max_new_tokens=max_new_tokens, eos_id=tok.eos_id),
                  truncate_prompts=True)
  shared = None
  if system_prompt is not None:
    from magistral_jax.generate.prefix_cache import useful_shared_prefix
    from magistral_jax.pipeline.generators import shared_prompt_prefix
    shared = useful_shared_prefix(shared_prompt_prefix(tok, system_prompt), prompt_len)
  return GeneratorLoop(engine, params, shared_prefix=shared), tok


def main(argv):
  del argv
  logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
  kind, fmt, inputs, name = _KIND.value, _FORMAT.value, list(_INPUT.value), _NAME.value
  if _SHIPPED.value:
    _, kind, fmt = records.SHIPPED[_SHIPPED.value]
    inputs = [records.shipped_path(_SHIPPED.value)]
    name = name or _SHIPPED.value
  if not inputs or not name:
    raise app.UsageError("give --input and --name, or --shipped")
  default = {"math": ["format"], "code": ["code"], "sft": []}[kind]
  fl = default if _FILTERS.value is None else [f for f in _FILTERS.value if f]

  config, reward_cfg = _CONFIG.value, None
  if config is not None:   # the same config system as launch/train.py; errors before any work
    from magistral_jax import config as config_lib
    reward_cfg = config_lib.validate(config).reward
  temperature = _from_config(_TEMPERATURE, "temperature", config and config.sampling.temperature)
  max_new = _from_config(_MAX_NEW, "max_new_tokens", config and config.sampling.max_new_tokens)
  slots = _from_config(_SLOTS, "slots", config and config.engine.max_concurrent_decodes)
  workers = _from_config(_VERIFIERS, "verifier_workers", config and config.verifier.num_workers)

  kw = {}
  pool = None
  if "difficulty" in fl:
    from magistral_jax.verify.pool import VerifierPool
    pool = VerifierPool(num_workers=workers, reward_cfg=reward_cfg)
    kw["score_fn"] = df.pool_score_fn(pool)
    stages = [(df.DifficultyStage("stage1", k=_K.value, min_pass_rate=float(_S1.value[0]),
                                  max_pass_rate=float(_S1.value[1])), _STAGE1_MODEL.value)]
    if _STAGE2_MODEL.value:
      stages.append((df.DifficultyStage("stage2", k=_K.value, min_pass_rate=float(_S2.value[0]),
                                        max_pass_rate=float(_S2.value[1]), drop_wrong_consensus=True,
                                        consensus_fraction=_CONSENSUS.value), _STAGE2_MODEL.value))
    kw["difficulty_stages"] = []
    for stage, path in stages:
      # generator_sample_fn renders every problem with the paper's system prompt.
      from magistral_jax.model.tokenizer import MAGISTRAL_SYSTEM_PROMPT
      loop, tok = _generator(path, temperature, max_new, slots,
                             system_prompt=MAGISTRAL_SYSTEM_PROMPT)
      kw["difficulty_stages"].append((stage, df.generator_sample_fn(loop, tok, max_new_tokens=max_new)))
  if "translate" in fl:
    loop, tok = _generator(_TRANSLATE_MODEL.value, 1.0, max_new, slots, greedy=True)
    kw["translate_fn"] = tr.generator_translate_fn(loop, tok, max_new_tokens=max_new)
    kw["translate_config"] = tr.TranslationConfig(fraction=_TRANSLATE_FRACTION.value,
                                                  languages=tuple(_LANGS.value))
  config = ff.FormatFilterConfig(drop_proofs=_NO_PROOFS.value, drop_multi_part=_NO_MULTI.value,
                                 rewrite_multiple_choice=_REWRITE_MC.value)
  try:
    report = filters.filter_to_dataset(
        inputs, kind=kind, name=name, data_dir=_DATA_DIR.value, out_dir=_OUT_DIR.value,
        source_format=fmt, source=_SHIPPED.value, filters=fl, split=_SPLIT.value,
        format_config=config, workers=_WORKERS.value,
        code_config=cf.CodeFilterConfig(min_tests=_MIN_TESTS.value, fix_agreement=_FIX_AGREEMENT.value),
        **kw)
  finally:
    if pool is not None:
      pool.close()
  print(json.dumps({k: report[k] for k in ("name", "kept", "read", *filters.FILTERS, "dataset")
                    if k in report}))


if __name__ == "__main__":
  app.run(main)
