"""bench/learn.py's own logic (issue #51), without launching a
model: the task picked from a headroom table, the control's coin rate from the RL run's metrics,
the archive that comes back from a device machine, and the report of two runs written by
eval/in_run.py's write_eval. The whole command ran on CPU with --shrink and on an H100
(BENCHMARKS.md "A real model learns")."""
import json
import os
import subprocess
import sys
import tarfile
from types import SimpleNamespace

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def learn():
  sys.path.insert(0, os.path.join(ROOT, "bench"))
  try:
    import learn
  finally:
    sys.path.pop(0)
  return learn


def _set(p1, head):
  return {"pass@1": p1, "headroom": head}


def test_task_is_the_synthetic_set_with_the_most_headroom_in_the_band(learn):
  table = {"sets": {"gsm8k_test": _set(0.2, 0.5),                 # not synthetic: never picked
                    "synthetic/20/1-3": _set(0.3, 0.4),
                    "synthetic/10/1-2": _set(0.7, 0.25),          # above the band
                    "synthetic/99/2-3": _set(0.12, 0.2)}}
  assert learn.choose_task(table) == "synthetic/20/1-3"
  # None in [0.1, 0.6] (the H100 table: pass@1 0.098): the most headroom all the same.
  table = {"sets": {"synthetic/20/1-3": _set(0.098, 0.34), "synthetic/99/2-3": _set(0.005, 0.08),
                    "synthetic/999/2-4": _set(0.0, 0.0)}}
  assert learn.choose_task(table) == "synthetic/20/1-3"
  assert learn.choose_task({"sets": {"synthetic/999/2-4": _set(0.0, 0.0)}}) is None


def test_control_rate_is_the_rl_runs_mean_verdict_rate(learn, tmp_path):
  rows = [{"step": 1, "sft/loss": 1.0},                             # an SFT row: not counted
          {"step": 1, "reward": 0.2, "accuracy": 0.1},
          {"step": 2, "reward": 0.3, "accuracy": 0.3}]
  (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  assert learn.mean_accuracy(str(tmp_path)) == pytest.approx(0.2)
  (tmp_path / "metrics.jsonl").write_text("")
  with pytest.raises(RuntimeError, match="no RL batch"):
    learn.mean_accuracy(str(tmp_path))


def _write_run(wd, tag_batches, correct):
  from magistral_jax.eval.in_run import write_eval
  os.makedirs(wd, exist_ok=True)
  for tag, batch in tag_batches:
    rows = [{"id": f"heldout-0-{i}", "n": 4, "correct": c} for i, c in enumerate(correct[tag])]
    res = {"pass@1": sum(correct[tag]) / (4 * len(rows)), "format_rate": 1.0,
           "response_length_mean": 50.0, "headroom": 0.1, "num_problems": len(rows),
           "rows": rows}
    write_eval(wd, tag, batch, res, k=4)
  with open(os.path.join(wd, "metrics.jsonl"), "w") as f:
    for b in range(1, 5):
      f.write(json.dumps({"step": b, "reward": 0.1 * b, "accuracy": 0.05 * b,
                          "format_rate": 1.0, "response_length_mean": 50.0}) + "\n")


def test_report_of_two_runs_and_the_archive(learn, tmp_path):
  """write_eval's files (eval/in_run.py) are what the report pairs and plots; the archive
  keeps the evaluations, curves, metrics and logs, and leaves the weights behind."""
  from magistral_jax.eval.paired import compare_evals
  correct = {"before": [0, 1, 2, 0, 1, 0, 0, 1], "batch2": [1, 1, 2, 1, 1, 0, 1, 1],
             "after": [2, 2, 3, 1, 2, 1, 1, 2]}
  _write_run(tmp_path / "rl", [("before", 0), ("batch2", 2), ("after", 4)], correct)
  _write_run(tmp_path / "control", [("after", 4)], {"after": correct["before"]})
  from magistral_jax.analysis.report import load_heldout_curve
  curve = load_heldout_curve(str(tmp_path / "rl"))
  assert [(c["tag"], c["batch"]) for c in curve] == [("before", 0), ("batch2", 2), ("after", 4)]
  before = learn.read_json(str(tmp_path / "rl" / "eval_before.json"))
  after = learn.read_json(str(tmp_path / "rl" / "eval_after.json"))
  g = compare_evals(before["rows"], after["rows"])
  assert g["gain"] == pytest.approx((14 - 5) / 32) and g["ci_low"] > 0
  ctl = learn.read_json(str(tmp_path / "control" / "eval_after.json"))
  assert compare_evals(before["rows"], ctl["rows"])["gain"] == 0.0
  pytest.importorskip("matplotlib")
  png = learn.plot(str(tmp_path / "learn.png"), {"rl": str(tmp_path / "rl"),
                                                 "control": str(tmp_path / "control")}, before)
  assert png and os.path.getsize(png) > 10_000
  os.makedirs(tmp_path / "rl" / "checkpoints" / "4")
  (tmp_path / "rl" / "checkpoints" / "4" / "eval_x.json").write_text("{}")   # weights' dir
  os.makedirs(tmp_path / "logs")
  (tmp_path / "logs" / "rl.log").write_text("log")
  path = learn.pack(str(tmp_path), str(tmp_path / "out.tar.gz"))
  names = set(tarfile.open(path).getnames())
  assert {"rl/eval_before.json", "rl/eval_after.json", "rl/heldout_curve.jsonl",
          "rl/metrics.jsonl", "control/eval_after.json", "logs/rl.log"} <= names
  assert not any("checkpoints" in n for n in names)


def test_gpu_suite_knows_the_learn_mode():
  r = subprocess.run(["bash", "bench/gpu_suite.sh", "nosuchmode"], cwd=ROOT, capture_output=True,
                     text=True, timeout=60)
  assert r.returncode == 2 and "learn" in r.stderr


def test_the_tool_recipe_and_its_baseline_differ_only_in_the_tool(learn):
  """bench/learn.py --tools compares configs/smollm2_learn.py:tools with the same recipe without
  the tool (its task and lengths given, as learn.without_tool gives them): every setting but the
  tool's own (tools.enabled, the cold start's tool rate) is the same, in both phases."""
  m = learn.recipe("smollm2_learn")
  for phase in ("", "sft,"):
    tools = m.get_config(f"{phase}tools,colocated").to_dict()
    plain = m.get_config(f"{phase}task={m.TOOLS_TASK},new_tokens="
                         f"{tools['sampling']['max_new_tokens']},colocated").to_dict()
    assert tools["tools"]["enabled"] and not plain["tools"]["enabled"]
    assert tools["data"].pop("sft_tool_rate") == m.TOOL_RATE and plain["data"].pop(
        "sft_tool_rate") == 0.0
    for c in (tools, plain):
      c.pop("tools")
    assert tools == plain


def test_the_gsm8k_arms_differ_only_in_the_tool_and_its_room(learn):
  """bench/learn.py --tools --gsm8k compares configs/smollm2.py's cold start with the tool
  (`tools`) against the same without it: they differ in the tool's own settings and in the
  lengths that make room for its calls (both evaluations then decode to the tool's budget)."""
  m = learn.recipe("smollm2")
  room = {("sft", "row_len"), ("sampling", "max_new_tokens"), ("eval", "max_new_tokens"),
          ("reward", "l_max"), ("reward", "l_cache"), ("rl", "microbatch_tokens"),
          ("data", "sft_tool_rate")}
  for phase in ("sft,", "", "gpu,sft,", "gpu,"):
    tools = m.get_config(f"{phase}tools,colocated").to_dict()
    plain = m.get_config(f"{phase}colocated").to_dict()
    assert tools.pop("tools")["enabled"] and not plain.pop("tools")["enabled"]
    differ = {(s, k) for s in tools for k in (tools[s] if isinstance(tools[s], dict) else [None])
              if (tools[s].get(k) if k else tools[s]) != (plain[s].get(k) if k else plain[s])}
    assert differ <= room, differ - room
    assert ("data", "sft_tool_rate") in differ


def test_the_gsm8k_comparison_runs_two_arms_apart_only_in_the_tool(learn, tmp_path):
  """gsm8k_tool's launches, recorded instead of run: a cold start and an evaluation per arm, the
  tool's arm with the `tools` switch and nothing else apart; both evaluations on the same test
  problems at the tool recipe's budget, compared pairwise."""
  launched = []

  def phase(name, cmd, out):
    launched.append((name, cmd))
    if not name.startswith("eval_"):
      return {}
    rows = [{"id": f"gsm8k_test/{i}", "n": 1, "correct": int(name == "eval_tool" or i % 2)}
            for i in range(8)]
    return {"sets": {"gsm8k_test": {"rows": rows, "pass@1": 0.5, "k": 1, "num_problems": 8}}}

  a = SimpleNamespace(shrink=True, sft_steps=0, gsm8k_problems=8)
  out = learn.gsm8k_tool(a, str(tmp_path), ",ci", phase)
  assert [n for n, _ in launched] == ["sft_tool", "eval_tool", "sft_plain", "eval_plain"]
  cmds = dict(launched)
  budget = learn.recipe("smollm2").get_config("tools,ci").eval.max_new_tokens
  for arm in ("tool", "plain"):
    assert f"--config.eval.max_new_tokens={budget}" in cmds[f"eval_{arm}"]
    assert "--sets=gsm8k_test" in cmds[f"eval_{arm}"] and "--num_problems=8" in cmds[f"eval_{arm}"]
  strip = lambda cmd, arm: [c.replace("tools,", "").replace(f"_{arm}", "_ARM") for c in cmd]
  assert strip(cmds["sft_tool"], "tool") == strip(cmds["sft_plain"], "plain")
  assert strip(cmds["eval_tool"], "tool") == strip(cmds["eval_plain"], "plain")
  assert "tools," in cmds["sft_tool"][1] and "tools" not in cmds["sft_plain"][1]
  assert out["gsm8k_tool_over_plain"]["gain"] == 0.5
