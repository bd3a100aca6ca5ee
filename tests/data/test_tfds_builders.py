"""TFDS builders (array_record, no TensorFlow) from local JSONL, and what bad rows do to a build."""
import json
import os
import sys

import hypothesis
import hypothesis.strategies as st
import pytest

from magistral_jax.data import jsonl
from magistral_jax.data import records
from magistral_jax.data import tfds_builders as tb


def _all(data_dir, name, kind):
  src = tb.load_source(data_dir, name, kind=kind)
  return [tb.decode(kind, src[i]) for i in range(len(src))]


def _write(path, lines):
  with open(path, "wb") as f:
    for ln in lines:
      f.write(ln if isinstance(ln, bytes) else (ln + "\n").encode("utf-8"))
  return str(path)


@pytest.mark.parametrize("kind,rows", [
    ("math", [{"id": "a", "problem": "1+1=?", "answer": "2", "source": "s", "language": "en"},
              {"id": "b", "problem": "Résous $x^2=4$, x>0 — 中文", "answer": "2", "source": "s",
               "language": "fr"}]),
    ("code", [{"id": "c1", "statement": "Echo the input.", "language": "en", "source": "s",
               "tests": [{"input": "hi\n", "output": "hi\n"}, {"input": "", "output": ""}],
               "test_type": "stdin_stdout", "test_setup": "", "entry_point": "",
               "solutions": [{"language": "python", "code": "print(input())"},
                             {"language": "cpp", "code": "int main(){}"}]},
              {"id": "c2", "statement": "No tests yet", "language": "en", "source": "s",
               "tests": [], "test_type": "assert", "test_setup": "import math",
               "entry_point": "f", "solutions": []}]),
    ("sft", [{"id": "t1", "prompt": "Q?", "completion": "<think>x</think> A", "source": "s",
              "language": "en"}]),
])
def test_builder_round_trips_every_field(tmp_path, kind, rows):
  path = tmp_path / "in.jsonl"
  jsonl.write_jsonl(str(path), rows)
  report = tb.build_dataset(kind, "rt", str(path), str(tmp_path / "tfds"))
  assert report["kept"] == len(rows) and report["skipped"] == {}
  got = sorted(_all(str(tmp_path / "tfds"), "rt", kind), key=lambda r: r["id"])
  assert got == sorted(rows, key=lambda r: r["id"])
  assert any(f.endswith(".array_record-00000-of-00001") for f in
             os.listdir(tb.dataset_dir(str(tmp_path / "tfds"), kind, "rt")))


def test_shipped_sets_build_with_all_rows_and_english(tmp_path):
  reports = tb.build_shipped(str(tmp_path))
  assert "tensorflow" not in sys.modules      # array_record written and read without TF
  assert {n: r["kept"] for n, r in reports.items()} == {
      "math500": 500, "gsm8k_test": 1319, "gsm8k_train": 7473, "humaneval": 164,
      "mbpp_sample20": 20}
  he = {r["id"]: r for r in _all(str(tmp_path), "humaneval", "code")}["HumanEval/0"]
  assert he["test_type"] == "assert" and he["entry_point"] == "has_close_elements"
  assert he["tests"][0]["input"].rstrip().endswith("check(has_close_elements)")
  assert he["solutions"][0]["code"].startswith(he["statement"])
  mb = _all(str(tmp_path), "mbpp_sample20", "code")
  assert all(len(r["tests"]) >= 3 and r["tests"][0]["input"].startswith("assert") for r in mb)
  gsm = {r["id"]: r for r in _all(str(tmp_path), "gsm8k_test", "math")}
  assert gsm["gsm8k_test/0"]["answer"] == "18" and gsm["gsm8k_test/0"]["language"] == "en"
  train = {r["id"]: r for r in _all(str(tmp_path), "gsm8k_train", "math")}
  assert train["gsm8k_train/0"]["answer"] == "72"
  assert train["gsm8k_train/0"]["source"] == "gsm8k_train"


def test_rebuild_only_when_inputs_change(tmp_path):
  path = str(tmp_path / "in.jsonl")
  jsonl.write_jsonl(path, [{"problem": "p", "answer": "1"}])
  d = str(tmp_path / "tfds")
  tb.build_dataset("math", "x", path, d)
  stamp = os.path.getmtime(os.path.join(tb.dataset_dir(d, "math", "x"), tb.REPORT_FILE))
  tb.build_dataset("math", "x", path, d)
  assert os.path.getmtime(os.path.join(tb.dataset_dir(d, "math", "x"), tb.REPORT_FILE)) == stamp
  jsonl.write_jsonl(path, [{"problem": "p", "answer": "1"}, {"problem": "q", "answer": "2"}])
  assert tb.build_dataset("math", "x", path, d)["kept"] == 2
  assert len(tb.load_source(d, "x")) == 2


def test_bad_rows_are_skipped_counted_and_located(tmp_path, caplog):
  path = _write(tmp_path / "bad.jsonl", [
      json.dumps({"id": "ok1", "problem": "p1", "answer": "1"}),
      "{not json",
      b'{"id": "x", "problem": "caf\xe9", "answer": "1"}\n',      # latin-1, not UTF-8
      json.dumps({"id": "nofield", "problem": "p"}),
      json.dumps([1, 2]),
      "",
      json.dumps({"id": "ok1", "problem": "dup", "answer": "3"}),
      json.dumps({"id": "badtype", "problem": {"x": 1}, "answer": "1"}),
      json.dumps({"problem": "p2", "answer": "2"}),
      '{"id": "sur", "problem": "bad \\ud800 escape", "answer": "1"}',     # lone surrogate
  ])
  with caplog.at_level("WARNING"):
    report = tb.build_dataset("math", "bad", path, str(tmp_path / "tfds"))
  assert report["kept"] == 2 and report["rows_read"] == 9
  assert report["skipped"] == {"malformed_json": 1, "non_utf8": 2, "missing_field:answer": 1,
                               "not_an_object": 1, "duplicate_id": 1, "bad_type:problem": 1}
  assert report["skipped_rows"]["non_utf8"] == ["bad.jsonl:3", "bad.jsonl:10"]
  assert report["skipped_rows"]["duplicate_id"] == ["bad.jsonl:7"]
  assert "bad.jsonl row 2: malformed_json" in caplog.text
  ids = sorted(r["id"] for r in _all(str(tmp_path / "tfds"), "bad", "math"))
  assert ids == ["bad/9", "ok1"]     # a row without id is named after its file and row


def test_empty_dataset_is_a_clear_error_and_writes_nothing(tmp_path):
  path = _write(tmp_path / "junk.jsonl", ["{oops", json.dumps({"problem": "no answer"})])
  with pytest.raises(jsonl.EmptyDatasetError, match=r"no valid math rows.*malformed_json"):
    tb.build_dataset("math", "junk", path, str(tmp_path / "tfds"))
  assert not os.path.exists(tb.dataset_dir(str(tmp_path / "tfds"), "math", "junk"))
  empty = _write(tmp_path / "empty.jsonl", [])
  with pytest.raises(jsonl.EmptyDatasetError, match="files are empty"):
    tb.build_dataset("math", "empty", empty, str(tmp_path / "tfds"))


def test_unknown_names_and_formats_are_clear_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="not built"):
    tb.load_source(str(tmp_path), "nothing")
  with pytest.raises(ValueError, match="gives math records, not code"):
    tb.build_dataset("code", "x", records.shipped_path("math500"), str(tmp_path), source_format="gsm8k")
  with pytest.raises(FileNotFoundError, match="input JSONL not found"):
    tb.build_dataset("math", "x", str(tmp_path / "missing.jsonl"), str(tmp_path))



def _json_values():
  return st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
                      | st.text(max_size=8), lambda c: st.lists(c, max_size=3)
                      | st.dictionaries(st.text(max_size=5), c, max_size=3), max_leaves=6)


_CODE_FIELDS = ("id", "statement", "tests", "solutions", "test_type", "language")
_ROWS = st.lists(st.one_of(
    st.binary(max_size=40),
    st.fixed_dictionaries({}, optional={k: _json_values() for k in _CODE_FIELDS}).map(
        lambda d: json.dumps(d).encode())), max_size=12)


@hypothesis.settings(max_examples=30, deadline=None)
@hypothesis.given(rows=_ROWS)
def test_every_row_is_either_kept_or_counted(tmp_path_factory, rows):
  path = tmp_path_factory.mktemp("h") / "rows.jsonl"
  with open(path, "wb") as f:
    for r in rows:
      f.write(r.replace(b"\n", b" ") + b"\n")
  report = jsonl.ReadReport(quiet=True)
  kept = list(jsonl.read_records(str(path), "code", report=report))
  assert len(kept) == report.kept
  assert report.kept + sum(report.skipped.values()) == report.rows_read
  for rec in kept:   # what is kept is exactly what the TFDS features can store
    assert all(isinstance(rec[k], str) for k in ("id", "statement", "language", "test_type"))
    assert all(set(t) == {"input", "output"} for t in rec["tests"])
