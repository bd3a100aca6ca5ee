"""evaluate(): pass@1 averaged over k, maj@k and the pass@k curve from the real reward, each
problem's correct count, and progress while it generates (a first GPU launch compiles here for
minutes before its first sample)."""
import concurrent.futures
import json
import logging

import numpy as np
import pytest

from magistral_jax.eval.evaluate import evaluate
from magistral_jax.generate.requests import Sample
from magistral_jax.model.char_tokenizer import char_tokenizer
from magistral_jax.rewards.config import RewardConfig
from magistral_jax.rewards.reward import compute_reward

TOK = char_tokenizer()
REWARD = RewardConfig(language_bonus=0.0, math_timeout_s=0)
PROBLEMS = [{"id": f"p{i}", "kind": "math", "problem": f"{i} + 1?", "answer": str(i + 1)}
            for i in range(3)]
# Per problem, the boxed answer of each of its k=3 samples: all right; one right and the majority
# wrong; one right and a wrong majority again.
ANSWERS = {0: ["1", "1", "1"], 1: ["2", "5", "5"], 2: ["7", "7", "3"]}


class SteppedLoop:
  """Stands in for a GeneratorLoop stepped by its caller: one sample finishes per step."""

  def __init__(self):
    self.queue, self.steps = [], 0

  def submit(self, r):
    self.queue += [(r, i) for i in range(r.group_size)]

  def idle(self):
    return not self.queue

  def run_until_idle(self, max_steps=None):
    out = []
    while self.queue and (max_steps is None or len(out) < max_steps):
      r, i = self.queue.pop(0)
      self.steps += 1
      text = f"<think>\nadd one\n</think>\n\\boxed{{{ANSWERS[r.id][i]}}}"
      tokens = TOK.encode(text)
      out.append(Sample(r.id, i, list(r.prompt_tokens), tokens, np.zeros(len(tokens)),
                        np.zeros(len(tokens), np.int32), "eos", r.metadata))
    return out


class InlinePool:
  def submit(self, task, response, tokens, seed):
    fut = concurrent.futures.Future()
    fut.set_result(compute_reward(task, response, tokens, REWARD, seed))
    return fut


def test_pass_at_1_averages_over_k_and_maj_at_k_takes_the_most_frequent_answer():
  res = evaluate(SteppedLoop(), InlinePool(), TOK, PROBLEMS, k=3)
  assert res["pass@1"] == pytest.approx((1 + 1 / 3 + 1 / 3) / 3)
  assert res["maj@3"] == pytest.approx(1 / 3)
  assert res["format_rate"] == 1.0 and res["num_problems"] == 3
  assert [r["pass1"] for r in res["rows"]] == pytest.approx([1.0, 1 / 3, 1 / 3])
  assert [r["maj"] for r in res["rows"]] == [1.0, 0.0, 0.0]


def test_progress_is_logged_while_generating(caplog, monkeypatch):
  monkeypatch.setattr("magistral_jax.eval.evaluate._STEPS_PER_CHECK", 2)
  loop = SteppedLoop()
  with caplog.at_level(logging.INFO, logger="magistral_jax.eval.evaluate"):
    res = evaluate(loop, InlinePool(), TOK, PROBLEMS, k=3, tag="before", log_every_s=0.0)
  lines = [r.getMessage() for r in caplog.records]
  assert lines[0] == "[eval before] generating 9 samples (3 problems x k=3)"
  # Checked every 2 samples, logged at each check before the last.
  done = [line.split()[2] for line in lines[1:]]
  assert done == ["2/9", "4/9", "6/9", "8/9"] and all("ETA" in line for line in lines[1:])
  assert loop.steps == 9 and res["pass@1"] == pytest.approx(5 / 9)


def test_pass_at_k_curve_headroom_and_correct_counts():
  """k=3 samples with 3, 1 and 1 correct: pass@2 = (1 + 2/3 + 2/3) / 3 (a problem with one right
  sample of three is solved by 2 of the 3 pairs), pass@3 = 1, headroom = pass@3 - pass@1."""
  res = evaluate(SteppedLoop(), InlinePool(), TOK, PROBLEMS, k=3)
  assert [(r["n"], r["correct"]) for r in res["rows"]] == [(3, 3), (3, 1), (3, 1)]
  assert list(res["pass_at"]) == [1, 2, 3]
  assert res["pass_at"][1] == pytest.approx(res["pass@1"]) == pytest.approx(5 / 9)
  assert res["pass_at"][2] == pytest.approx(7 / 9) == res["pass@2"]
  assert res["pass_at"][3] == pytest.approx(1.0) == res["pass@3"]
  assert res["headroom"] == pytest.approx(4 / 9)
  assert res["maj@3"] == pytest.approx(1 / 3)   # beside the curve, unchanged
  # It all goes into the eval JSON (launch/eval.py dumps the result as it is).
  back = json.loads(json.dumps(res))
  assert back["pass_at"] == {"1": pytest.approx(5 / 9), "2": pytest.approx(7 / 9),
                             "3": pytest.approx(1.0)}
  assert back["rows"][1]["correct"] == 1 and back["rows"][1]["n"] == 3


def test_one_sample_gives_a_one_point_curve_and_no_headroom():
  res = evaluate(SteppedLoop(), InlinePool(), TOK, PROBLEMS, k=1)
  assert res["pass_at"] == {1: pytest.approx(2 / 3)} and res["headroom"] == 0.0
  assert not [key for key in res if key.startswith("pass@") and key != "pass@1"]
