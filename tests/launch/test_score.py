"""The offline scoring CLI: one output line per input line, errors kept, order preserved."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_score_cli_scores_a_mixed_file_and_survives_malformed_lines(tmp_path):
  lines = [
      {"id": "m1", "kind": "math", "problem": "What is 2+3?", "answer": "5",
       "response": "<think>\nTwo plus three is five.\n</think>\nThe answer is \\boxed{5}.",
       "response_tokens": 950, "max_tokens": 1000},
      {"id": "m2", "kind": "math", "problem": "What is 2+3?", "answer": "5",
       "response": "no think tags \\boxed{5}"},
      {"id": "c1", "kind": "code", "problem": "Double it.", "language": "python",
       "tests": [{"input": "2\n", "output": "4\n"}, {"input": "5\n", "output": "10\n"}],
       "response": "<think>\nx\n</think>\n```python\nprint(2 * int(input()))\n```"},
      {"id": "c2", "kind": "code", "problem": "f", "language": "python",
       "test_code": "def check(candidate):\n  assert candidate(2) == 4\n", "entry_point": "f",
       "response": "<think>\nx\n</think>\n```python\nimport sys\nsys.exit(0)\n```"},
      {"id": "bad", "kind": "math", "problem": "no response field", "answer": "1"},
  ]
  raw = [json.dumps(l) for l in lines]
  raw.insert(2, "{not json")
  raw.append('"a string"')
  inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
  inp.write_bytes(("\n".join(raw) + "\n").encode() + b"\xff\xfe\n")
  proc = subprocess.run([sys.executable, os.path.join(ROOT, "launch", "score.py"),
                         f"--input={inp}", f"--output={out}", "--workers=2", "--l_cache=100",
                         "--noprogress"], capture_output=True, text=True, timeout=300, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr[-2000:]
  rows = [json.loads(l) for l in out.read_text().splitlines()]
  assert len(rows) == 8
  by_id = {r.get("id"): r for r in rows}
  m1 = by_id["m1"]
  assert m1["error"] is None and m1["parts"]["correct"] == 0.9
  assert m1["parts"]["length_penalty"] == -0.05 and abs(m1["reward"] - 1.05) < 1e-9
  assert by_id["m2"]["reward"] == 0.0 and by_id["m2"]["parts"]["failed_condition"] == "starts_with_think"
  assert by_id["c1"]["parts"]["correct"] == 0.9
  assert by_id["c2"]["parts"]["correct"] == 0.0
  assert "response" in by_id["bad"]["error"]
  assert "invalid JSON" in rows[2]["error"] and rows[2]["line"] == 3
  assert [r.get("id") for r in rows[:2]] == ["m1", "m2"]          # input order kept
  assert rows[-2]["error"].endswith("expected a JSON object")
  assert rows[-1]["error"] and rows[-1]["reward"] == 0.0
  assert set(m1["parts"]) == {"format", "correct", "language", "length_penalty", "failed_condition"}
