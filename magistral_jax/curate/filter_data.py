"""One filtering run as launch/filter_data.py asks for it: the input (JSONL, or a shipped set),
the models that sample and translate (GGUF files, on all local devices), the verifier pool that
grades, and the run config that may set the sampling and the reward; then curate/filters.py over
it all into a new dataset plus a report.
"""
from __future__ import annotations

from typing import Collection, Sequence

from magistral_jax.curate import code_filter as cf
from magistral_jax.curate import difficulty as df
from magistral_jax.curate import filters
from magistral_jax.curate import translate as tr
from magistral_jax.data import format_filter as ff
from magistral_jax.data import records

# What a run filters a kind of record with when no filters are named.
DEFAULT_FILTERS = {"math": ["format"], "code": ["code"], "sft": []}


def _from_config(flag_value, explicit: bool, config_value):
  """An explicit flag wins; otherwise the config's value (when a config is given)."""
  return flag_value if config_value is None or explicit else config_value


def _generator(path, temperature, max_new_tokens, slots, greedy=False, prompt_len=1024,
               system_prompt=None):
  """A GeneratorLoop on all local devices (tensor parallel) for a GGUF model, and its tokenizer.
  With `system_prompt` (what every prompt it gets is rendered with) the prompts' common prefix
  is prefilled once (GeneratorLoop shared_prefix)."""
  import jax
  from magistral_jax.generate.config import SamplingConfig
  from magistral_jax.generate.engine import Engine
  from magistral_jax.generate.loop import GeneratorLoop
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
  return GeneratorLoop(engine, params, shared_prefix=shared, sampling=engine.sampling), tok


def filter_data(*, inputs: Sequence[str], shipped: str | None, kind: str,
                source_format: str | None, name: str | None, data_dir: str, out_dir: str,
                filter_names: Sequence[str] | None, split: str, workers: int,
                format_config: ff.FormatFilterConfig, code_config: cf.CodeFilterConfig,
                k: int, stage1_model: str | None, stage2_model: str | None,
                stage1_pass_rate: Sequence[float], stage2_pass_rate: Sequence[float],
                consensus_fraction: float, max_new_tokens: int, temperature: float, slots: int,
                verifier_workers: int, translate_model: str | None, translate_fraction: float,
                translate_languages: Sequence[str], config=None,
                explicit: Collection[str] = ()) -> dict:
  """Filters `inputs` (or the shipped set `shipped`) with `filter_names` (default: by kind) into
  the dataset `name`; returns the report's headline: name, kept, read, each filter's report and
  the dataset dir (the whole report is <out_dir>/<name>.report.json).

  `config` (a run config, configs/*.py) is validated before any work; its reward grades the
  difficulty samples, and its sampling temperature and max_new_tokens, engine decode slots and
  verifier workers replace `temperature`, `max_new_tokens`, `slots` and `verifier_workers` unless
  their names are in `explicit` (given on the command line).
  """
  if shipped:
    _, kind, source_format = records.SHIPPED[shipped]
    inputs = [records.shipped_path(shipped)]
    name = name or shipped
  if not inputs or not name:
    raise ValueError("give inputs and a name, or a shipped set")
  fl = DEFAULT_FILTERS[kind] if filter_names is None else [f for f in filter_names if f]

  reward_cfg = None
  if config is not None:   # the same config system as launch/train.py; errors before any work
    from magistral_jax import config as config_lib
    reward_cfg = config_lib.validate(config).reward
  temperature = _from_config(temperature, "temperature" in explicit,
                             config and config.sampling.temperature)
  max_new = _from_config(max_new_tokens, "max_new_tokens" in explicit,
                         config and config.sampling.max_new_tokens)
  slots = _from_config(slots, "slots" in explicit, config and config.engine.max_concurrent_decodes)
  workers_v = _from_config(verifier_workers, "verifier_workers" in explicit,
                           config and config.verifier.num_workers)

  kw = {}
  pool = None
  if "difficulty" in fl:
    from magistral_jax.verify.pool import VerifierPool
    pool = VerifierPool(num_workers=workers_v, reward_cfg=reward_cfg)
    kw["score_fn"] = df.pool_score_fn(pool)
    stages = [(df.DifficultyStage("stage1", k=k, min_pass_rate=float(stage1_pass_rate[0]),
                                  max_pass_rate=float(stage1_pass_rate[1])), stage1_model)]
    if stage2_model:
      stages.append((df.DifficultyStage("stage2", k=k, min_pass_rate=float(stage2_pass_rate[0]),
                                        max_pass_rate=float(stage2_pass_rate[1]),
                                        drop_wrong_consensus=True,
                                        consensus_fraction=consensus_fraction), stage2_model))
    kw["difficulty_stages"] = []
    for stage, path in stages:
      # generator_sample_fn renders every problem with the paper's system prompt.
      from magistral_jax.model.tokenizer import MAGISTRAL_SYSTEM_PROMPT
      loop, tok = _generator(path, temperature, max_new, slots,
                             system_prompt=MAGISTRAL_SYSTEM_PROMPT)
      kw["difficulty_stages"].append((stage, df.generator_sample_fn(loop, tok,
                                                                    max_new_tokens=max_new)))
  if "translate" in fl:
    loop, tok = _generator(translate_model, 1.0, max_new, slots, greedy=True)
    kw["translate_fn"] = tr.generator_translate_fn(loop, tok, max_new_tokens=max_new)
    kw["translate_config"] = tr.TranslationConfig(fraction=translate_fraction,
                                                  languages=tuple(translate_languages))
  try:
    report = filters.filter_to_dataset(
        inputs, kind=kind, name=name, data_dir=data_dir, out_dir=out_dir,
        source_format=source_format, source=shipped, filters=fl, split=split,
        format_config=format_config, workers=workers, code_config=code_config, **kw)
  finally:
    if pool is not None:
      pool.close()
  return {key: report[key] for key in ("name", "kept", "read", *filters.FILTERS, "dataset")
          if key in report}
