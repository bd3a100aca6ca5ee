"""The real-model path (configs/smollm2.py): GSM8K cold-start traces in the Magistral format, then
RL on SmolLM2-135M-Instruct with the full Magistral reward.

The trace tests are fast; the end-to-end test is the short form of the learning recipe (a few
SFT steps on the synthetic task's traces, a few RL batches, launch/sft.py and launch/train.py on
the real 135M model), so it is marked slow, and long: `make test-full` runs it, CI does not
(tests/conftest.py).
"""
import json
import os
import subprocess
import sys

import pytest

from magistral_jax.data import gsm8k_traces, jsonl, records
from magistral_jax.rewards.reward import compute_reward
from magistral_jax.rewards.config import RewardConfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ROW = {"idx": 0, "question": "Janet's ducks lay 16 eggs per day. She eats three for breakfast and "
                              "bakes muffins with four. She sells the rest for $2 each. How much "
                              "does she make every day?",
       "answer": "18",
       "solution": "Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 duck eggs a day.\n"
                   "She makes 9 * 2 = $<<9*2=18>>18 every day at the farmer's market.\n#### 18"}


def test_trace_drops_calculator_annotations_and_the_final_line():
  t = gsm8k_traces.trace(ROW["solution"], ROW["answer"])
  assert t == ("<think>\nJanet sells 16 - 3 - 4 = 9 duck eggs a day.\n"
               "She makes 9 * 2 = $18 every day at the farmer's market.\n</think>\n\n"
               "The answer is 18.\n\n\\boxed{18}")


def test_shipped_traces_pass_the_format_gate_and_grade_correct():
  """Every row of GSM8K's train split (the traces' source) becomes a trace; a sample of them gets
  the full reward from the repo's own compute_reward: format 1, correct 1 (and the
  English-consistency bonus)."""
  rows = [json.loads(l) for l in open(records.shipped_path(gsm8k_traces.SHIPPED))]
  cfg = RewardConfig(l_max=512, l_cache=128)
  for r in rows[::300]:   # 25 rows spread over the file
    t = gsm8k_traces.trace(r["solution"], r["answer"])
    res = compute_reward({"kind": "math", "problem": r["question"], "answer": r["answer"]}, t,
                         100, cfg)
    assert res.error is None and res.parts["failed_condition"] is None, (t, res)
    assert res.parts["format"] == cfg.format_reward and res.parts["correct"] == cfg.correct_reward
    assert res.parts["language"] == cfg.language_bonus
  # A wrong final answer keeps the format but loses correctness.
  wrong = compute_reward({"kind": "math", "problem": ROW["question"], "answer": "17"},
                         gsm8k_traces.trace(ROW["solution"], ROW["answer"]), 100, cfg)
  assert wrong.parts["format"] == cfg.format_reward and wrong.parts["correct"] == 0.0


TOOL_TRACE = ("<think>\n<tool>\nprint(16-3-4)\n</tool>\n<result>\n9\n</result>\n"
              "Janet sells 16 - 3 - 4 = 9 duck eggs a day.\n"
              "<tool>\nprint(9*2)\n</tool>\n<result>\n18\n</result>\n"
              "She makes 9 * 2 = $18 every day at the farmer's market.\n</think>\n\n"
              "The answer is 18.\n\n\\boxed{18}")


def test_tool_traces_call_the_interpreter_before_each_computed_line():
  """Issue #67 on GSM8K: each calculator annotation becomes a call that prints its expression,
  with the result block the tool returns (tests/rewards/test_tool_run.py runs them in the
  sandbox), before the line that uses it."""
  assert gsm8k_traces.trace(ROW["solution"], ROW["answer"], tool=True) == TOOL_TRACE
  # Python's arithmetic, as `print` writes it; what is not arithmetic is refused, never run.
  assert [gsm8k_traces.printed(e) for e in ("48/2", "2**3", "(3+4)*2.5", "-7//2")] == [
      "24.0", "8", "17.5", "-4"]
  for expr, reason in (("__import__('os').getcwd()", "calculator_not_arithmetic"),
                       ("True+1", "calculator_not_arithmetic"), ("9**99**9", "calculator_large_power"),
                       ("1/0", "calculator_error"), ("3+", "calculator_syntax")):
    with pytest.raises(records.RowError, match=reason):
      gsm8k_traces.printed(expr)
  # Shipped rows: one call per annotation; graded as the verifiers read a transcript (each
  # result emptied: tool_use/protocol.graded_text), the trace passes the format and is correct.
  from magistral_jax.tool_use.protocol import GRADED_RESULT, count_calls, split_results
  rows = [json.loads(l) for l in open(records.shipped_path(gsm8k_traces.SHIPPED))]
  cfg = RewardConfig(l_max=512, l_cache=128)
  for r in rows[::500]:
    t = gsm8k_traces.trace(r["solution"], r["answer"], tool=True)
    assert count_calls(t) == r["solution"].count("<<") > 0
    graded = "".join(GRADED_RESULT if res else piece for piece, res in split_results(t))
    res = compute_reward({"kind": "math", "problem": r["question"], "answer": r["answer"]},
                         graded, 100, cfg)
    assert res.parts["format"] == cfg.format_reward and res.parts["correct"] == cfg.correct_reward
  # tool_rate: a coin per problem id, the same in every build.
  ids = [f"gsm8k_train/{i}" for i in range(2000)]
  share = sum(gsm8k_traces.calls_tool(i, 0.5) for i in ids) / len(ids)
  assert 0.45 < share < 0.55
  assert [gsm8k_traces.calls_tool(i, 0.5) for i in ids] == [gsm8k_traces.calls_tool(i, 0.5)
                                                            for i in ids]
  assert not any(gsm8k_traces.calls_tool(i, 0.0) for i in ids)


def test_a_cold_start_on_tool_traces_learns_the_calls_not_the_results():
  """The SFT datasets' tokenization (data/loader.sft_tokenize_fn, launch/sft.py's path for
  gsm8k_traces) masks each result block out of the loss, and nothing else; a trace without calls
  is all targets (the negative control)."""
  from magistral_jax.data.loader import sft_tokenize_fn
  from magistral_jax.model.gguf_file import default_gguf_path
  from magistral_jax.model.tokenizer import load_tokenizer
  from magistral_jax.tool_use.protocol import split_results
  tok = load_tokenizer(default_gguf_path())
  fn = sft_tokenize_fn(tok.encode, tok.encode, tok.eos_id)
  ex = fn({"prompt": "Q", "completion": TOOL_TRACE})
  n_prompt = len(tok.encode("Q"))
  pieces = split_results(TOOL_TRACE)
  want = [0] * n_prompt
  for piece, is_result in pieces:
    want += [int(not is_result)] * len(tok.encode(piece))
  assert list(ex["loss_mask"]) == want + [1] and len(ex["tokens"]) == len(want) + 1
  results = "".join(piece for piece, is_result in pieces if is_result)
  assert results == "\n<result>\n9\n</result>\n\n<result>\n18\n</result>\n"
  masked = [t for t, m in zip(ex["tokens"][n_prompt:], ex["loss_mask"][n_prompt:]) if not m]
  assert tok.decode(masked) == results
  plain = fn({"prompt": "Q", "completion": gsm8k_traces.trace(ROW["solution"], ROW["answer"])})
  assert plain["loss_mask"][n_prompt:].all()


def test_bad_rows_are_skipped_and_counted_and_held_out_ids_are_excluded(tmp_path):
  src = tmp_path / "g.jsonl"
  rows = [dict(ROW, idx=i) for i in range(5)]
  rows[1] = dict(ROW, idx=1, solution="#### 18")                         # nothing to think
  rows[2] = dict(ROW, idx=2, solution="a <think> b\n#### 18")            # would break the format
  rows[3] = {k: v for k, v in ROW.items() if k != "solution"} | {"idx": 3}
  src.write_text("".join(json.dumps(r) + "\n" for r in rows) + "{not json\n")
  out = tmp_path / "traces.jsonl"
  rep = gsm8k_traces.write_traces(str(out), exclude_ids=["gsm8k_train/4"], source_path=str(src))
  assert rep["traces"] == 1 and rep["excluded"] == 1
  assert rep["read"]["skipped"] == {"empty_solution": 1, "think_tag_in_solution": 1,
                                    "missing_field:solution": 1, "malformed_json": 1}
  (got,) = [json.loads(l) for l in open(out)]
  assert got["id"] == "gsm8k_train/0" and got["prompt"] == ROW["question"]
  assert rep["tool_traces"] == 0 and "<tool>" not in got["completion"]
  rep = gsm8k_traces.write_traces(str(out), exclude_ids=["gsm8k_train/4"], source_path=str(src),
                                  tool_rate=1.0)
  (got,) = [json.loads(l) for l in open(out)]
  assert rep["tool_traces"] == 1 and got["completion"] == TOOL_TRACE
  with pytest.raises(ValueError, match="no GSM8K trace"):
    gsm8k_traces.write_traces(str(out), exclude_ids=["gsm8k_train/0", "gsm8k_train/4"],
                              source_path=str(src))


def test_sft_and_rl_train_on_gsm8k_train_and_evaluate_on_gsm8k_test(tmp_path):
  """configs/smollm2.py: the traces launch/sft.py builds (its block, replayed) are all of GSM8K's
  train split, checked against every test problem; the RL runs' held-out sets are test problems
  and their prompt streams train problems, checked as launch/train.py does."""
  from configs import smollm2
  from magistral_jax.data.prompts import (check_heldout_unseen, dataset_problems,
                                          heldout_problems, train_prompts)
  from magistral_jax import config as config_lib
  sft_cfg = smollm2.get_config("sft")
  sft_cfg.data.data_dir = str(tmp_path / "data")
  assert sft_cfg.data.heldout_source == "gsm8k_test" == smollm2.TEST
  test = dataset_problems(sft_cfg, sft_cfg.data.heldout_source)
  rep = gsm8k_traces.build_trace_dataset(sft_cfg.data.data_dir, heldout=test)
  assert rep["traces"] == 7473 and rep["excluded"] == 0 and rep["heldout_checked"] == 1319
  built = jsonl.read_records(str(tmp_path / "data" / "gsm8k_traces.jsonl"), "sft")
  assert all(r["id"].startswith("gsm8k_train/") for r in built)
  for arg in ("", "ci", "gpu"):
    rl_cfg = smollm2.get_config(arg)
    rl_cfg.data.data_dir = str(tmp_path / "data")
    assert (rl_cfg.data.source, rl_cfg.data.heldout_source) == ("gsm8k_train", "gsm8k_test")
    held = heldout_problems(rl_cfg)
    assert len(held) == rl_cfg.data.heldout and all(p["source"] == "gsm8k_test" for p in held)
    check_heldout_unseen(rl_cfg, held)
    stream = train_prompts(rl_cfg, held, None)
    assert all(next(stream)["source"] == "gsm8k_train" for _ in range(8))
  # Every variant is a valid run configuration (gpu: a 2-accelerator layout, or one GPU
  # colocated: the README's recipe).
  for arg, devices in (("", 8), ("ci", 8), ("sft,ci", 8), ("gpu", 2), ("sft,gpu", 2),
                       ("gpu,colocated", 1), ("sft,gpu,colocated", 1), ("tools", 8),
                       ("sft,tools,colocated", 1), ("gpu,colocated,tools,tool_rate=0.5", 1)):
    config_lib.validate(smollm2.get_config(arg), devices)
  # `tools` (issue #67): the interpreter on, every trace that computes calls it, and room for it.
  tools, plain = smollm2.get_config("sft,tools"), smollm2.get_config("sft")
  assert tools.tools.enabled and tools.data.sft_tool_rate == 1.0
  assert tools.sft.row_len > plain.sft.row_len
  assert smollm2.get_config("tools").sampling.max_new_tokens > smollm2.get_config(
      "").sampling.max_new_tokens
  assert smollm2.get_config("ci,init=/x/params").init.to_dict() == {"source": "orbax",
                                                                     "path": "/x/params"}
  assert smollm2.get_config("init=gguf").init.source == "gguf"
  with pytest.raises(ValueError, match="bad config argument"):
    smollm2.get_config("sft,steps=3")


# The short form's sizes: a cold start too short to settle the format, a few RL batches of two
# groups each (the recipe's four would double the time for the same lesson: the format).
SHORT_SFT_STEPS, SHORT_BATCHES, SHORT_WARMUP, SHORT_N_BATCH = 3, 4, 1, 16


def _launch(script, workdir, *flags):
  # Generous timeout: on a shared 2-core host the two launches take several minutes each.
  r = subprocess.run([sys.executable, os.path.join(ROOT, "launch", script), f"--workdir={workdir}",
                      *flags], cwd=ROOT, capture_output=True, text=True, timeout=2400)
  assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
  return r.stdout + r.stderr


@pytest.mark.slow
@pytest.mark.long
def test_the_real_model_learns_short_form(tmp_path):
  """The short form of the learning recipe (configs/smollm2_learn.py; bench/learn.py records
  the full one): a cold start on the task's worked traces too short to settle the format, then a
  few GRPO batches on the real 135M model with the full reward. The reward rises, mostly through
  the format the verifier pays for. Each evaluation writes its per-problem counts, which the
  paired bootstrap reads."""
  sft = tmp_path / "sft"
  _launch("sft.py", sft, "--config=configs/smollm2_learn.py:sft,colocated",
          f"--config.sft.num_steps={SHORT_SFT_STEPS}")
  s = json.load(open(sft / "sft_summary.json"))
  assert s["sft_steps"] == SHORT_SFT_STEPS and 0 < s["final_nll_per_token"] < 3.0
  assert (sft / "trained_on.json").exists()   # the RL run counts its held-out set against it

  rl = tmp_path / "rl"
  _launch("train.py", rl, f"--config=configs/smollm2_learn.py:colocated,init={sft / 'params'}",
          f"--config.num_batches={SHORT_BATCHES}", "--config.data.heldout=8",
          "--config.eval.k=2", f"--config.optimizer.warmup_steps={SHORT_WARMUP}",
          f"--config.rl.n_batch={SHORT_N_BATCH}", f"--config.rl.n_mini={SHORT_N_BATCH}")
  summary = json.load(open(rl / "summary.json"))
  assert summary["batches"] == SHORT_BATCHES == summary["optimizer_steps"]
  assert summary["heldout_trained_on"] == 0
  rows = [json.loads(l) for l in open(rl / "metrics.jsonl")]
  steps = [r for r in rows if "reward" in r and "grad_norm" in r]
  assert len(steps) == SHORT_BATCHES and all(r["update_applied"] == 1.0 for r in steps)
  # After so short a cold start most samples miss the format; RL teaches it first.
  reward = [r["reward"] for r in steps]
  assert sum(reward[-2:]) > sum(reward[:2]), reward
  assert summary["format_rate"] > summary["format_rate_before"], summary
  from magistral_jax.eval.paired import compare_evals
  before = json.load(open(rl / "eval_before.json"))
  after = json.load(open(rl / "eval_after.json"))
  g = compare_evals(before["rows"], after["rows"], n_boot=1000)
  assert g["n"] == 8 and g["ci_low"] <= g["gain"] <= g["ci_high"]
