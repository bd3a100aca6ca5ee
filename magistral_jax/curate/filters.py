"""Running the data filters over JSONL and writing the result as a new dataset plus a report.

    raw JSONL --read (bad rows counted)--> records
        --> math: format filter -> difficulty filter (stages) -> translation of a fraction
            code: code-test filter
        --> <out_dir>/<name>.jsonl  (canonical records, the input of the next stage)
        --> <out_dir>/<name>.report.json  (rows skipped/dropped per reason, per stage)
        --> TFDS dataset <name> under data_dir (array_record), ready for the grain loaders

The format filter is cheap CPU work (SymPy parsing) and runs in a process pool when asked:
math_verify's timeout needs each parse in a process's main thread, which pool workers are.
"""
from __future__ import annotations

import json
import logging
import multiprocessing
import os
from typing import Sequence

from magistral_jax.curate import code_filter as cf
from magistral_jax.curate import difficulty as df
from magistral_jax.curate import translate as tr
from magistral_jax.data import format_filter as ff
from magistral_jax.data import jsonl
from magistral_jax.data import tfds_builders

log = logging.getLogger(__name__)

# Each filter and the record kind it applies to, in the order they run. "difficulty" needs
# samplers (a generator per checkpoint) and a grader; "translate" a translator: both are passed in
# (curate/filter_data.py builds them from model files).
FILTERS = {"format": "math", "code": "code", "difficulty": "math", "translate": "math"}


def format_filter_parallel(recs, config: ff.FormatFilterConfig, report: ff.FilterReport,
                           workers: int = 0, chunksize: int = 32):
  """`format_filter` over a process pool (order kept); workers=0 runs in this process."""
  if workers <= 0:
    yield from ff.format_filter(recs, config, report)
    return
  recs = list(recs)     # the ids are needed for the report; records are small
  ctx = multiprocessing.get_context("spawn")   # no inherited threads or JAX state
  with ctx.Pool(workers, initializer=ff.init_worker, initargs=(config,)) as pool:
    for rec, (reason, out) in zip(recs, pool.imap(ff.worker_check, recs, chunksize=chunksize)):
      report.add(rec["id"], reason, out)
      if out is not None:
        yield out


def filter_to_dataset(inputs: Sequence[str], *, kind: str, name: str, data_dir: str, out_dir: str,
                      source_format: str | None = None, source: str | None = None,
                      filters: Sequence[str] = ("format",), split: str = "train",
                      format_config: ff.FormatFilterConfig = ff.FormatFilterConfig(),
                      code_config: cf.CodeFilterConfig = cf.CodeFilterConfig(),
                      code_run_fn: cf.RunFn | None = None,
                      difficulty_stages: Sequence[tuple[df.DifficultyStage, df.SampleFn]] = (),
                      score_fn: df.ScoreFn | None = None,
                      translate_fn: tr.TranslateFn | None = None,
                      translate_config: tr.TranslationConfig = tr.TranslationConfig(),
                      workers: int = 0) -> dict:
  """Reads `inputs`, applies `filters` in order, writes the JSONL, report and TFDS dataset.

  Returns the report. Raises EmptyDatasetError (after writing the report) if nothing is kept.
  """
  unknown = [f for f in filters if f not in FILTERS]
  if unknown:
    raise ValueError(f"unknown filter(s) {unknown}; available: {sorted(FILTERS)}")
  for f in filters:
    if FILTERS[f] != kind:
      raise ValueError(f"the {f} filter applies to {FILTERS[f]} records, not {kind}")
  if list(filters) != sorted(filters, key=list(FILTERS).index):
    raise ValueError(f"filters run in the order {list(FILTERS)}; got {list(filters)}")
  if "difficulty" in filters and (not difficulty_stages or score_fn is None):
    raise ValueError("the difficulty filter needs difficulty_stages (stage, sample_fn) and score_fn")
  if "translate" in filters and translate_fn is None:
    raise ValueError("the translate filter needs translate_fn")
  os.makedirs(out_dir, exist_ok=True)
  out_jsonl = os.path.join(out_dir, f"{name}.jsonl")
  report_path = os.path.join(out_dir, f"{name}.report.json")

  read_report = jsonl.ReadReport()
  recs = jsonl.read_records(inputs, kind, source_format, source=source, report=read_report)
  stages = {}
  if "format" in filters:
    stages["format"] = ff.FilterReport()
    recs = format_filter_parallel(recs, format_config, stages["format"], workers)
  if "code" in filters:
    stages["code"] = cf.CodeFilterReport()
    recs = cf.code_filter(recs, code_run_fn or cf.sandbox_run_fn(), code_config, stages["code"])
  if "difficulty" in filters:
    # Stages need the whole pool; the journal under out_dir makes a killed run resumable.
    problems = [{**r, "kind": kind} for r in recs]
    kept, stages["difficulty"] = df.difficulty_filter(
        problems, difficulty_stages, score_fn, os.path.join(out_dir, f"{name}.difficulty"))
    recs = ({k: v for k, v in r.items() if k != "kind"} for r in kept)
  if "translate" in filters:
    stages["translate"] = tr.TranslationReport()
    recs = tr.translate_problems(recs, translate_fn, translate_config, stages["translate"])
  n = jsonl.write_jsonl(out_jsonl, recs)
  report = {"name": name, "kind": kind, "inputs": list(inputs), "filters": list(filters),
            "read": read_report.to_json(),
            **{k: v if isinstance(v, dict) else v.to_json() for k, v in stages.items()},
            "kept": n, "output": out_jsonl}
  with open(report_path, "w") as f:
    json.dump(report, f, indent=1)
  if n == 0:
    raise jsonl.EmptyDatasetError(f"filters {list(filters)} kept no {kind} rows of {list(inputs)}; "
                                  f"see {report_path}")
  report["dataset"] = tfds_builders.build_dataset(kind, name, out_jsonl, data_dir, split=split)["dir"]
  with open(report_path, "w") as f:
    json.dump(report, f, indent=1)
  log.info("dataset %s: %d kept; report at %s", name, n, report_path)
  return report
