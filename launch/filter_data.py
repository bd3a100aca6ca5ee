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

from absl import app
from absl import flags
from ml_collections import config_flags

from magistral_jax.curate import filters
from magistral_jax.curate import filter_data as curation
from magistral_jax.curate.code_filter import CodeFilterConfig
from magistral_jax.curate.translate import TranslationConfig
from magistral_jax.data import records
from magistral_jax.data.format_filter import FormatFilterConfig

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
_LANGS = flags.DEFINE_list("translate_languages", list(TranslationConfig().languages), "target languages")
_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Optional run config (configs/*.py). Its reward definition grades the "
    "difficulty samples, and its sampling.temperature, sampling.max_new_tokens, "
    "engine.max_concurrent_decodes and verifier.num_workers replace --temperature, "
    "--max_new_tokens, --slots and --verifier_workers unless those flags are given explicitly.")

flags.register_multi_flags_validator(
    ["input", "name", "shipped"], lambda f: bool(f["shipped"] or (f["input"] and f["name"])),
    message="give --input and --name, or --shipped")


def main(argv):
  del argv
  logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
  print(json.dumps(curation.filter_data(
      inputs=list(_INPUT.value), shipped=_SHIPPED.value, kind=_KIND.value,
      source_format=_FORMAT.value, name=_NAME.value, data_dir=_DATA_DIR.value,
      out_dir=_OUT_DIR.value, filter_names=_FILTERS.value, split=_SPLIT.value,
      workers=_WORKERS.value,
      format_config=FormatFilterConfig(drop_proofs=_NO_PROOFS.value,
                                       drop_multi_part=_NO_MULTI.value,
                                       rewrite_multiple_choice=_REWRITE_MC.value),
      code_config=CodeFilterConfig(min_tests=_MIN_TESTS.value, fix_agreement=_FIX_AGREEMENT.value),
      k=_K.value, stage1_model=_STAGE1_MODEL.value, stage2_model=_STAGE2_MODEL.value,
      stage1_pass_rate=_S1.value, stage2_pass_rate=_S2.value,
      consensus_fraction=_CONSENSUS.value, max_new_tokens=_MAX_NEW.value,
      temperature=_TEMPERATURE.value, slots=_SLOTS.value, verifier_workers=_VERIFIERS.value,
      translate_model=_TRANSLATE_MODEL.value, translate_fraction=_TRANSLATE_FRACTION.value,
      translate_languages=_LANGS.value, config=_CONFIG.value,
      explicit={n for n in ("temperature", "max_new_tokens", "slots", "verifier_workers")
                if flags.FLAGS[n].present})))


if __name__ == "__main__":
  app.run(main)
