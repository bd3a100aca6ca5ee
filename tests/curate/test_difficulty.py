"""Two-stage difficulty filter: pass-rate bounds, wrong-consensus drop, report, resume.

The sampler here is a real (if simple) policy: it does the arithmetic of "What is a+b?" and gets
a fixed number of its k samples right per problem; grading is the project's real reward function.
"""
import json
import os

import pytest

from magistral_jax.curate import difficulty as D
from magistral_jax.rewards.config import RewardConfig
from magistral_jax.rewards.reward import compute_reward

K = 8


def _problems():
  # (a, b, reference, samples right out of K for checkpoint 1, for checkpoint 2)
  spec = [(1, 1, "2", 0, 0), (2, 3, "5", 8, 8), (4, 4, "8", 3, 6), (5, 5, "10", 1, 0),
          (6, 1, "7", 4, 1), (3, 3, "7", 0, 0)]       # the last reference is wrong (6)
  return [{"id": f"p{i}", "kind": "math", "problem": f"What is {a}+{b}?", "answer": ref,
           "skill": (s1, s2)} for i, (a, b, ref, s1, s2) in enumerate(spec)]


def arithmetic_sampler(checkpoint, calls=None):
  def sample(problems, k):
    if calls is not None:
      calls.append([p["id"] for p in problems])
    out = []
    for p in problems:
      a, b = (int(x) for x in p["problem"][len("What is "):-1].split("+"))
      right = p["skill"][checkpoint]
      # Wrong samples slip by 1, 2 or 3 (they rarely agree), except on p5, where every sample
      # computes a+b correctly and so disagrees with the wrong reference.
      out.append([f"<think>adding</think>\n\\boxed{{{a + b if j < right or p['id'] == 'p5' else a + b + 1 + j % 3}}}"
                  for j in range(k)])
    return out
  return sample


def reward_score_fn(problems, completions):
  cfg = RewardConfig(language_bonus=0.0)
  out = []
  for p, cs in zip(problems, completions):
    row = []
    for c in cs:
      r = compute_reward(p, c, None, cfg)
      row.append(D.Grade(r.parts["correct"] > 0, r.info.get("boxed")))
    out.append(row)
  return out


STAGE1 = D.DifficultyStage("stage1", k=K, min_pass_rate=1 / K, max_pass_rate=6 / K, batch_problems=2)
STAGE2 = D.DifficultyStage("stage2", k=K, min_pass_rate=1 / K, max_pass_rate=5 / K,
                           drop_wrong_consensus=True, batch_problems=2)


def test_decide_applies_bounds_and_wrong_consensus():
  s = lambda n, wrong=None, nw=0: {"k": 16, "n_correct": n, "pass_rate": n / 16,
                                   "top_wrong_answer": wrong, "top_wrong_count": nw}
  st = D.DifficultyStage(min_pass_rate=2 / 16, max_pass_rate=12 / 16, drop_wrong_consensus=True)
  assert D.decide(s(0), st) == "never_solved"
  assert D.decide(s(1), st) == "too_hard"
  assert D.decide(s(13), st) == "too_easy"
  assert D.decide(s(2), st) is None and D.decide(s(12), st) is None
  assert D.decide(s(3, "7", 9), st) == "wrong_consensus"
  assert D.decide(s(3, "7", 8), st) is None            # exactly half is not "most"
  assert D.summarize([D.Grade(False, "\\dfrac{1}{2}"), D.Grade(False, "\\frac{1}{2} "),
                      D.Grade(True, "1")])["top_wrong_count"] == 2


def test_two_stages_keep_the_right_problems_with_a_report(tmp_path):
  kept, reports = D.difficulty_filter(
      _problems(), [(STAGE1, arithmetic_sampler(0)), (STAGE2, arithmetic_sampler(1))],
      reward_score_fn, str(tmp_path))
  # Stage 1 drops p0 (never solved), p1 (8/8 > 6/8) and p5 (its wrong reference is never
  # matched); p2 (3/8), p3 (1/8), p4 (4/8) stay. Stage 2's checkpoint solves p2 6/8 (> 5/8: too
  # easy), p3 never, p4 1/8: only p4 is kept.
  assert reports["stage1"]["dropped"] == {"never_solved": 2, "too_easy": 1}
  assert reports["stage1"]["kept"] == 3
  assert reports["stage1"]["pass_rate_histogram"]["0/8"] == 2
  assert reports["stage1"]["pass_rate_histogram"]["8/8"] == 1
  assert reports["stage2"]["dropped"] == {"too_easy": 1, "never_solved": 1}
  assert [p["id"] for p in kept] == ["p4"]
  assert kept[0]["stage1_pass_rate"] == 4 / K and kept[0]["stage2_pass_rate"] == 1 / K


def test_wrong_consensus_drops_a_problem_with_a_bad_reference(tmp_path):
  stage = D.DifficultyStage("s", k=K, min_pass_rate=0.0, max_pass_rate=1.0,
                            drop_wrong_consensus=True)
  kept, report = D.run_stage(_problems(), stage, arithmetic_sampler(0), reward_score_fn, str(tmp_path))
  assert report["dropped"] == {"wrong_consensus": 1}
  assert "p5" not in [p["id"] for p in kept]
  journal = [json.loads(l) for l in open(tmp_path / "s.journal.jsonl")]
  p5 = next(r for r in journal if r["id"] == "p5")
  assert p5["top_wrong_answer"] == "6" and p5["top_wrong_count"] == K


def test_a_killed_run_resumes_where_it_stopped(tmp_path):
  fresh_kept, fresh_report = D.run_stage(_problems(), STAGE1, arithmetic_sampler(0), reward_score_fn,
                                         str(tmp_path / "fresh"))

  def dies_after_two_batches():
    inner, n = arithmetic_sampler(0), [0]
    def sample(problems, k):
      n[0] += 1
      if n[0] > 2:
        raise KeyboardInterrupt("killed")
      return inner(problems, k)
    return sample

  work = str(tmp_path / "resumed")
  with pytest.raises(KeyboardInterrupt):
    D.run_stage(_problems(), STAGE1, dies_after_two_batches(), reward_score_fn, work)
  journal = os.path.join(work, "stage1.journal.jsonl")
  assert len(open(journal).read().splitlines()) == 4
  with open(journal, "a") as f:
    f.write('{"id": "p4", "k": 8, "n_corr')            # torn by the kill
  calls = []
  kept, report = D.run_stage(_problems(), STAGE1, arithmetic_sampler(0, calls), reward_score_fn, work)
  assert calls == [["p4", "p5"]]                       # only the ungraded problems are sampled
  assert kept == fresh_kept and report == fresh_report


def test_bad_sampler_output_is_a_clear_error(tmp_path):
  with pytest.raises(ValueError, match="sample_fn must return 8 completions"):
    D.run_stage(_problems(), STAGE1, lambda ps, k: [["x"]] * len(ps), reward_score_fn, str(tmp_path))


def test_pool_score_fn_grades_through_the_verifier_pool():
  from magistral_jax.verify.pool import VerifierPool
  probs = _problems()[:2]
  with VerifierPool(num_workers=1) as pool:
    grades = D.pool_score_fn(pool)(probs, arithmetic_sampler(0)(probs, 3))
  assert grades == [[D.Grade(False, "3"), D.Grade(False, "4"), D.Grade(False, "5")],
                    [D.Grade(True, "5")] * 3]

