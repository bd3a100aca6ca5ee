"""The offline scoring CLI: one output line per input line, errors kept, order preserved."""
import json
import os
import subprocess
import sys

from magistral_jax.verify import score_file as score_mod

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


def _run_cli(tmp_path, raw_lines):
  """Runs launch/score.py on the given raw lines (str or bytes); the output rows, in order."""
  inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
  inp.write_bytes(b"\n".join(l if isinstance(l, bytes) else l.encode() for l in raw_lines) + b"\n")
  proc = subprocess.run([sys.executable, os.path.join(ROOT, "launch", "score.py"),
                         f"--input={inp}", f"--output={out}", "--workers=1", "--noprogress"],
                        capture_output=True, text=True, timeout=300, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr[-2000:]
  text = out.read_bytes().decode("utf-8")   # strict: the output must be valid UTF-8
  return [json.loads(l) for l in text.splitlines()]


def _math(i, answer="5", box="5", thoughts="Two plus three is five."):
  return {"id": f"g{i}", "kind": "math", "problem": "What is 2+3?", "answer": answer,
          "response": f"<think>\n{thoughts}\n</think>\nThe answer is \\boxed{{{box}}}."}


def test_score_cli_scores_good_lines_around_unreadable_ones(tmp_path):
  # Each bad kind of the red-team review (issue #50) once used to end the run with 0 lines written.
  surrogate = _math("s", thoughts="\ud800 Two plus three is five.")
  raw = [
      json.dumps(_math(1)),
      json.dumps(surrogate),   # ASCII escape of a lone surrogate: parses, cannot be UTF-8 encoded
      '{"id": "big", "kind": "math", "problem": "p", "answer": "1", "response": "r", "n": '
      + "9" * 5000 + "}",      # past Python's 4,300-digit int limit: json.loads raises ValueError
      json.dumps(_math(2, box="6")),
      "[" * 100000,            # RecursionError in json.loads
      "",                      # blank lines are skipped but still counted in line numbers
      # Parses, but too deep to pickle for the worker (in CPython 3.11 at least).
      json.dumps({**_math("deep"), "meta": json.loads("[" * 700 + "]" * 700)}),
      json.dumps(_math(3, answer="7", box=r"\frac{14}{2}")),
  ]
  rows = _run_cli(tmp_path, raw)
  assert len(rows) == 7
  assert [r.get("id") for r in rows] == ["g1", "gs", None, "g2", None, "gdeep", "g3"]
  for r in (rows[0], rows[1], rows[6]):   # good lines are scored correct
    assert r["error"] is None and r["parts"]["correct"] == 0.9 and r["reward"] > 1.0, r
  assert rows[1]["response"] == surrogate["response"]   # the escape round-trips
  assert rows[3]["error"] is None and rows[3]["parts"]["correct"] == 0.0   # scored, wrong
  big, deep = rows[2], rows[4]
  assert big["error"].startswith("line 3: invalid JSON value") and "digits" in big["error"]
  assert big["line"] == 3 and big["reward"] == 0.0
  assert deep["error"] == "line 5: invalid JSON: nested too deeply to parse"
  assert deep["line"] == 5 and deep["reward"] == 0.0 and deep["raw"] == "[" * 1000
  unsendable = rows[5]
  assert unsendable["reward"] == 0.0 and unsendable["error"].startswith("line 7: ")
  if sys.version_info[:2] == (3, 11):
    assert "could not send task to worker" in unsendable["error"]




class _FakePool:
  """Stands in for VerifierPool: scores "ok" responses, and fails in the ways a real pool or a
  record might (submit raising, a future raising, parts json cannot write)."""

  def __init__(self, *args, **kwargs):
    pass

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    pass

  def submit(self, task, response, response_tokens=None, group_seed=0):
    import concurrent.futures
    from magistral_jax.rewards.reward import RewardResult, empty_parts
    if response == "submit raises":
      raise RuntimeError("queue broke")
    fut = concurrent.futures.Future()
    if response == "future raises":
      fut.set_exception(OSError("pipe gone"))
    elif response == "unwritable parts":
      fut.set_result(RewardResult(1.0, {**empty_parts(), "extra": object()}))
    elif response == "pool error":
      fut.set_result(RewardResult(0.0, empty_parts(), "verification timed out after 1s"))
    else:
      fut.set_result(RewardResult(1.0, {**empty_parts(), "correct": 0.9}))
    return fut

  def metrics(self):
    return {}


def test_score_file_keeps_going_when_a_task_cannot_be_sent_scored_or_written(tmp_path,
                                                                              monkeypatch):
  from magistral_jax.rewards.config import RewardConfig
  monkeypatch.setattr(score_mod, "VerifierPool", _FakePool)
  responses = ["ok", "submit raises", "ok", "future raises", "unwritable parts", "pool error",
               "ok"]
  inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
  inp.write_text("\n".join(json.dumps({"id": i, "kind": "math", "problem": "p", "answer": "1",
                                       "response": r}) for i, r in enumerate(responses)) + "\n")
  stats = score_mod.score_file(str(inp), str(out), 1, RewardConfig(), progress=False)
  rows = [json.loads(l) for l in out.read_text().splitlines()]
  assert [r["id"] for r in rows] == list(range(7))
  assert stats["lines"] == 7 and stats["lines_with_error"] == 4
  for i in (0, 2, 6):
    assert rows[i]["error"] is None and rows[i]["reward"] == 1.0
  assert rows[1]["error"] == "line 2: could not submit the task: RuntimeError: queue broke"
  assert rows[3]["error"] == "line 4: OSError: pipe gone"
  assert rows[4]["error"].startswith("line 5: the record could not be written back (TypeError")
  assert rows[4]["line"] == 5 and rows[4]["parts"]["correct"] == 0.0
  assert rows[5]["error"] == "line 6: verification timed out after 1s"
  for i in (1, 3, 4, 5):
    assert rows[i]["reward"] == 0.0


def test_output_line_falls_back_to_line_and_id_when_the_record_cannot_be_written():
  from magistral_jax.rewards.reward import empty_parts
  deep = []
  for _ in range(5000):   # deeper than json's encoder goes, whatever the caller's stack depth
    deep = [deep]
  for rec in ({"id": "x", "meta": deep}, {"id": "x", "meta": {1, 2}}):
    text, err = score_mod.output_line(9, rec, 1.0, empty_parts(), None)
    row = json.loads(text)
    assert row == {"line": 9, "id": "x", "reward": 0.0, "parts": empty_parts(), "error": err}
    assert err.startswith("line 9: the record could not be written back")
  text, err = score_mod.output_line(1, {"id": 1, "s": "\udc80"}, 0.5, empty_parts(), None)
  assert err is None and text.isascii() and json.loads(text)["s"] == "\udc80"
