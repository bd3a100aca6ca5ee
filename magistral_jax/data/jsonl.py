"""Reading JSONL that may be damaged: every bad row is skipped, counted by reason and logged.

A row can fail in four ways, each with its own counter key: `non_utf8` (bytes that are not
UTF-8, or a \\u escape of a lone surrogate), `malformed_json`, `not_an_object` (valid JSON
that is not an object), and whatever `records.RowError` the adapter raises
(`missing_field:answer`, `bad_type:tests`, ...). Rows with an id seen before count as
`duplicate_id` (the first one is kept). Blank lines are ignored.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
from typing import Iterator

from magistral_jax.data import records

log = logging.getLogger(__name__)

# Row numbers kept per skip reason in the report (all of them are logged).
MAX_ROWS_PER_REASON = 20


class EmptyDatasetError(ValueError):
  pass


@dataclasses.dataclass
class ReadReport:
  """What happened to the rows of one or more files."""
  rows_read: int = 0
  kept: int = 0
  skipped: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  # reason -> ["file:row", ...] (first MAX_ROWS_PER_REASON of each)
  examples: dict = dataclasses.field(default_factory=dict)
  quiet: bool = False                # a probe pass: count, don't log

  def skip(self, path: str, row_number: int, reason: str, detail: str = ""):
    self.skipped[reason] += 1
    where = f"{os.path.basename(path)}:{row_number}"
    rows = self.examples.setdefault(reason, [])
    if len(rows) < MAX_ROWS_PER_REASON:
      rows.append(where)
    if not self.quiet:
      log.warning("skipping %s row %d: %s%s", path, row_number, reason, f" ({detail})" if detail else "")

  def to_json(self) -> dict:
    return {"rows_read": self.rows_read, "kept": self.kept, "skipped": dict(self.skipped),
            "skipped_rows": self.examples}


def iter_rows(path: str, report: ReadReport) -> Iterator[tuple[int, dict]]:
  """Yields (row_number, object) for the parseable rows of `path`; row numbers start at 1."""
  with open(path, "rb") as f:
    for row_number, raw in enumerate(f, start=1):
      if not raw.strip():
        continue
      report.rows_read += 1
      try:
        line = raw.decode("utf-8")
      except UnicodeDecodeError as e:
        report.skip(path, row_number, "non_utf8", str(e))
        continue
      try:
        obj = json.loads(line)
      except json.JSONDecodeError as e:
        report.skip(path, row_number, "malformed_json", str(e))
        continue
      if not isinstance(obj, dict):
        report.skip(path, row_number, "not_an_object", type(obj).__name__)
        continue
      yield row_number, obj


def read_records(paths, kind: str, source_format: str | None = None, *, source: str | None = None,
                 report: ReadReport | None = None) -> Iterator[dict]:
  """Canonical records of `kind` from JSONL files; bad rows are skipped and counted in `report`.

  `source` names the records' origin (default: each file's stem).
  """
  if isinstance(paths, (str, os.PathLike)):
    paths = [paths]
  adapter = records.get_adapter(kind, source_format)
  report = report if report is not None else ReadReport()
  seen = set()
  for path in paths:
    path = os.fspath(path)
    if not os.path.exists(path):
      raise FileNotFoundError(f"input JSONL not found: {path}")
    src = source or os.path.splitext(os.path.basename(path))[0]
    for row_number, obj in iter_rows(path, report):
      try:
        rec = adapter(obj, source=src, row_number=row_number)
      except records.RowError as e:
        report.skip(path, row_number, e.reason, str(e))
        continue
      try:
        # JSON escapes can smuggle in lone surrogates (\ud800) that no UTF-8 writer accepts.
        json.dumps(rec, ensure_ascii=False).encode("utf-8")
      except UnicodeEncodeError as e:
        report.skip(path, row_number, "non_utf8", f"lone surrogate: {e}")
        continue
      if rec["id"] in seen:
        report.skip(path, row_number, "duplicate_id", rec["id"])
        continue
      seen.add(rec["id"])
      report.kept += 1
      yield rec


def require_nonempty(paths, kind, source_format=None, *, source=None) -> None:
  """Raises EmptyDatasetError, with the skip counts, if no row of `paths` makes a record."""
  probe = ReadReport(quiet=True)     # the real pass logs the skipped rows
  for _ in read_records(paths, kind, source_format, source=source, report=probe):
    return
  raise EmptyDatasetError(
      f"no valid {kind} rows in {list(map(os.fspath, [paths] if isinstance(paths, (str, os.PathLike)) else paths))}: "
      f"{probe.rows_read} rows read, skipped by reason: {dict(probe.skipped) or 'none (files are empty)'}")


def write_jsonl(path: str, rows) -> int:
  """Writes rows atomically (temp file + rename) and returns how many were written."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  tmp = path + ".tmp"
  n = 0
  with open(tmp, "w", encoding="utf-8") as f:
    for r in rows:
      f.write(json.dumps(r, ensure_ascii=False) + "\n")
      n += 1
  os.replace(tmp, path)
  return n
