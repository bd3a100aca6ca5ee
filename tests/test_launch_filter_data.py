"""launch/filter_data.py end to end on a shipped set (format filter: no model needed)."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_filter_data_format_filter_on_math500(tmp_path):
  r = subprocess.run([sys.executable, os.path.join(ROOT, "launch/filter_data.py"),
                      "--shipped=math500", "--filters=format", f"--data_dir={tmp_path}/tfds",
                      f"--out_dir={tmp_path}/out"], cwd=ROOT, capture_output=True, text=True,
                     timeout=600)
  assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
  out = tmp_path / "out"
  report = json.load(open(out / "math500.report.json"))
  assert report["read"]["rows_read"] == 500
  assert report["format"]["kept"] == 499 and report["kept"] == 499
  assert report["format"]["dropped"] == {"multiple_choice_unstatable": 1}
  assert report["format"]["rewritten"] == {"multiple_choice": 2}
  rows = [json.loads(l) for l in open(out / "math500.jsonl")]
  assert len(rows) == 499 and all(r["answer"] for r in rows)
  assert os.path.isdir(report["dataset"])   # the filtered TFDS dataset was built
