"""TFDS builders for math problems, code problems and SFT traces, built from local JSONL.

The datasets are written as array_record files, which TFDS reads without TensorFlow
(`tfds.data_source` / `builder.as_data_source()`) and grain reads by random access. Nothing is
downloaded: `_split_generators` reads only the JSONL paths given to the builder.

Layout: `<data_dir>/<builder>/<dataset name>/<version>/` with the builder one of
`math_problems`, `code_problems`, `sft_traces`, and the dataset name a TFDS builder config, e.g.
`<data_dir>/math_problems/math500/1.0.0/`. A `build_report.json` beside the array_record files
records the inputs' SHA-256 and the rows skipped per reason; a build whose inputs changed is
rebuilt, an unchanged one is reused.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from typing import Sequence

import numpy as np
import tensorflow_datasets as tfds

from magistral_jax.data import jsonl
from magistral_jax.data import records

log = logging.getLogger(__name__)

VERSION = "1.0.0"
REPORT_FILE = "build_report.json"
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_.\-]*$")


def _features(kind: str) -> tfds.features.FeaturesDict:
  text = tfds.features.Text
  if kind == "math":
    return tfds.features.FeaturesDict({
        "id": text(), "problem": text(), "answer": text(), "source": text(), "language": text()})
  if kind == "code":
    return tfds.features.FeaturesDict({
        "id": text(), "statement": text(), "language": text(), "source": text(),
        "test_type": text(), "test_setup": text(), "entry_point": text(),
        "tests": tfds.features.Sequence({"input": text(), "output": text()}),
        "solutions": tfds.features.Sequence({"language": text(), "code": text()}),
    })
  if kind == "sft":
    return tfds.features.FeaturesDict({
        "id": text(), "prompt": text(), "completion": text(), "source": text(), "language": text()})
  raise ValueError(f"unknown record kind {kind!r}; expected one of {records.KINDS}")


class _JsonlBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """One split of canonical records read from JSONL files with a `records` adapter."""
  VERSION = tfds.core.Version(VERSION)
  KIND = ""

  def __init__(self, *, name: str, paths: Sequence[str], source_format: str | None = None,
               source: str | None = None, split: str = "train", data_dir: str, **kw):
    self._paths = [os.fspath(p) for p in paths]
    self._source_format = source_format
    self._source = source
    self._split = split
    self.read_report = jsonl.ReadReport()
    config = tfds.core.BuilderConfig(name=name, description=f"{self.KIND} records from {self._paths}")
    super().__init__(config=config, data_dir=data_dir, file_format="array_record", **kw)

  def _info(self):
    return tfds.core.DatasetInfo(builder=self, features=_features(self.KIND))

  def _split_generators(self, dl_manager):
    del dl_manager  # local files only
    return {self._split: self._generate_examples()}

  def _generate_examples(self):
    # Keys are the running count so duplicate ids in the data can never abort the write.
    recs = jsonl.read_records(self._paths, self.KIND, self._source_format, source=self._source,
                              report=self.read_report)
    for i, rec in enumerate(recs):
      yield i, rec


class MathProblems(_JsonlBuilder):
  """Math problems: problem, answer, source, language."""
  KIND = "math"


class CodeProblems(_JsonlBuilder):
  """Code problems: statement, language, tests (stdin/stdout pairs or asserts), solutions."""
  KIND = "code"


class SftTraces(_JsonlBuilder):
  """SFT traces: prompt, completion."""
  KIND = "sft"


BUILDERS = {"math": MathProblems, "code": CodeProblems, "sft": SftTraces}
BUILDER_DIRS = {"math": "math_problems", "code": "code_problems", "sft": "sft_traces"}


def _sha256(path: str) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      h.update(chunk)
  return h.hexdigest()


def dataset_dir(data_dir: str, kind: str, name: str) -> str:
  return os.path.join(data_dir, BUILDER_DIRS[kind], name, VERSION)


def build_dataset(kind: str, name: str, paths, data_dir: str, *, source_format: str | None = None,
                  source: str | None = None, split: str = "train", force: bool = False) -> dict:
  """Builds (or reuses) dataset `name` from JSONL `paths`; returns its build report.

  Bad rows are skipped and counted (see `jsonl`). Raises EmptyDatasetError if no row is valid,
  before anything is written.
  """
  if kind not in BUILDERS:
    raise ValueError(f"unknown record kind {kind!r}; expected one of {records.KINDS}")
  if not _NAME_RE.match(name):
    raise ValueError(f"dataset name {name!r} must match {_NAME_RE.pattern} (it becomes a directory)")
  paths = [os.fspath(p) for p in ([paths] if isinstance(paths, (str, os.PathLike)) else paths)]
  records.get_adapter(kind, source_format)          # fail fast on a bad format name
  for p in paths:
    if not os.path.exists(p):
      raise FileNotFoundError(f"input JSONL not found: {p}")
  fingerprint = {
      "kind": kind, "version": VERSION, "source_format": source_format or kind, "source": source,
      "split": split, "inputs": {p: _sha256(p) for p in paths}}
  out = dataset_dir(data_dir, kind, name)
  report_path = os.path.join(out, REPORT_FILE)
  if os.path.exists(report_path) and not force:
    with open(report_path) as f:
      old = json.load(f)
    if old.get("fingerprint") == fingerprint:
      log.info("reusing dataset %s at %s", name, out)
      return old
  if os.path.exists(out):
    log.info("rebuilding dataset %s at %s (inputs changed or build incomplete)", name, out)
    shutil.rmtree(out)

  jsonl.require_nonempty(paths, kind, source_format, source=source)
  tfds.disable_progress_bar()
  builder = BUILDERS[kind](name=name, paths=paths, source_format=source_format, source=source,
                           split=split, data_dir=data_dir)
  builder.download_and_prepare(
      download_config=tfds.download.DownloadConfig(try_download_gcs=False))
  report = {"name": name, "kind": kind, "split": split, "dir": out, "fingerprint": fingerprint,
            **builder.read_report.to_json()}
  with open(report_path + ".tmp", "w") as f:
    json.dump(report, f, indent=1)
  os.replace(report_path + ".tmp", report_path)
  if report["skipped"]:
    log.warning("dataset %s: kept %d rows, skipped %s", name, report["kept"], report["skipped"])
  return report


def build_shipped(data_dir: str, names: Sequence[str] | None = None, split: str = "train") -> dict:
  """Builds the public sets shipped in data/sources/ (MATH-500, GSM8K train and test, HumanEval,
  MBPP)."""
  out = {}
  for n in names or sorted(records.SHIPPED):
    fname, kind, fmt = records.SHIPPED[n]
    out[n] = build_dataset(kind, n, records.shipped_path(n), data_dir, source_format=fmt,
                           source=n, split=split)
  return out


def find_kind(data_dir: str, name: str) -> str:
  found = [k for k in BUILDERS if os.path.isdir(dataset_dir(data_dir, k, name))]
  if not found:
    raise FileNotFoundError(
        f"dataset {name!r} is not built under {data_dir} (looked for "
        f"{', '.join(dataset_dir(data_dir, k, name) for k in BUILDERS)}); build it with "
        "magistral_jax.data.tfds_builders.build_dataset or launch/filter_data.py")
  if len(found) > 1:
    raise ValueError(f"dataset name {name!r} exists for several kinds {found}; pass kind=")
  return found[0]


def load_source(data_dir: str, name: str, *, kind: str | None = None, split: str = "train"):
  """The random-access data source (array_record, no TensorFlow) of a built dataset."""
  kind = kind or find_kind(data_dir, name)
  d = dataset_dir(data_dir, kind, name)
  if not os.path.exists(os.path.join(d, REPORT_FILE)):
    raise FileNotFoundError(f"dataset {name!r} ({kind}) has no complete build at {d}")
  builder = tfds.builder_from_directory(d)
  if split not in builder.info.splits:
    raise KeyError(f"dataset {name!r} has no split {split!r}; splits: {list(builder.info.splits)}")
  return builder.as_data_source(split=split)


# ---- decoding the stored examples back into plain Python ------------------------------------
def _s(x) -> str:
  return x.decode("utf-8") if isinstance(x, bytes) else str(x)


def _seq(d, keys) -> list[dict]:
  cols = [list(np.asarray(d[k], dtype=object).reshape(-1)) if len(d[k]) else [] for k in keys]
  return [{k: _s(v) for k, v in zip(keys, row)} for row in zip(*cols)]


def decode(kind: str, ex: dict) -> dict:
  """A stored example (bytes, column-wise sequences) as the canonical record of `records`."""
  if kind == "code":
    out = {k: _s(ex[k]) for k in ("id", "statement", "language", "source", "test_type",
                                   "test_setup", "entry_point")}
    out["tests"] = _seq(ex["tests"], ("input", "output"))
    out["solutions"] = _seq(ex["solutions"], ("language", "code"))
    return out
  return {k: _s(v) for k, v in ex.items()}
