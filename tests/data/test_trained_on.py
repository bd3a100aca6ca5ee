"""The held-out rule for the synthetic task (data/synthetic.py's evaluation bucket) and the guard
that cannot be forgotten (data/trained_on.py): what a run trained on, counted against each of
its evaluations."""
import itertools
import json

import pytest

from magistral_jax import config as config_lib
from magistral_jax.data import synthetic
from magistral_jax.data.prompts import (SyntheticPrompts, check_heldout_unseen, heldout_problems,
                                        train_prompts)
from magistral_jax.data.splits import HeldOutOverlapError, normalise_text, problem_key
from magistral_jax.data.trained_on import TrainedOn, trained_on_for
from magistral_jax.eval.checkpoint import evaluate_checkpoint

TINY = dict(min_steps=1, max_steps=3, max_operand=9, allow_negative=False)


def _tiny():
  from configs import tiny
  return tiny.get_config()


# ---- the evaluation bucket -------------------------------------------------------------------
def test_heldout_and_training_splits_never_share_a_problem_text():
  held = {normalise_text(p["problem"]) for p in synthetic.take(400, 0, "heldout", **TINY)}
  assert len(held) == 400   # distinct problems
  for split in ("train", "sft"):
    seen = {normalise_text(p["problem"])
            for p in itertools.islice(synthetic.problems(0, split, **TINY), 30_000)}
    assert not held & seen
  # the rule is a function of the text: another seed, another difficulty agree
  other = synthetic.take(200, 5, "heldout", max_operand=99, min_steps=2, max_steps=3)
  assert all(synthetic.is_heldout(p["problem"]) for p in other)
  assert not any(synthetic.is_heldout(p["problem"]) for p in synthetic.take(500, 5, "train",
                                                                            **TINY))


def test_the_bucket_is_about_one_eighth_and_keeps_every_difficulty_class():
  draws = list(itertools.islice(synthetic.draws(1, "x", **TINY), 20_000))
  share = sum(synthetic.is_heldout(p["problem"]) for p in draws) / len(draws)
  assert 0.08 < share < 0.17
  held = synthetic.take(128, 0, "heldout", **TINY)
  assert {len(p["ops"]) for p in held} == {1, 2, 3}


def test_a_heldout_set_larger_than_the_bucket_is_a_clear_error():
  with pytest.raises(ValueError, match="distinct held-out problems"):
    synthetic.take(100, 0, "heldout", min_steps=1, max_steps=1, max_operand=4)


def test_the_rl_stream_resumes_where_it_stopped():
  c = _tiny()
  first = [p["id"] for p in itertools.islice(SyntheticPrompts(0, c.data), 50)]
  s = SyntheticPrompts(0, c.data)
  for _ in range(20):
    next(s)
  resumed = SyntheticPrompts(0, c.data, consumed=s.state()["consumed"])
  assert [p["id"] for p in itertools.islice(resumed, 30)] == first[20:]


def test_the_synthetic_stream_also_skips_a_heldout_set_from_elsewhere():
  c = _tiny()
  head = list(itertools.islice(synthetic.problems(0, "train", **TINY), 10))
  foreign = [dict(p, id=f"other/{i}") for i, p in enumerate(head[:3])]   # as if held out
  got = list(itertools.islice(SyntheticPrompts(0, c.data, heldout=foreign), 7))
  assert [p["problem"] for p in got] == [p["problem"] for p in head[3:]]


def test_check_heldout_unseen_covers_synthetic_sources():
  c = _tiny()
  check_heldout_unseen(c, heldout_problems(c))   # the bucket: fine
  trainable = next(synthetic.problems(0, "train", **TINY))
  with pytest.raises(HeldOutOverlapError, match="outside the evaluation bucket"):
    check_heldout_unseen(c, [trainable], what="evaluation set 'x'")
  check_heldout_unseen(c, [{"id": "g/1", "problem": "Natalia sold clips.", "kind": "math"}])


# ---- the record and its count ----------------------------------------------------------------
def _record_streams(c, trained, problems):
  """Records what make run draws: its cold start's traces and ~2,090 RL prompts, from
  `problems` (synthetic.problems, or the old synthetic.draws)."""
  opts = synthetic.options(c.data)
  for p in itertools.islice(problems(c.seed, "sft", **opts), c.sft.num_steps * c.sft.batch_size):
    trained.add(("", normalise_text(p["problem"])))
  for p in itertools.islice(problems(c.seed, "train", **opts), 2090):
    trained.add(problem_key(p))


def test_the_record_counts_nothing_for_the_streams_and_catches_the_old_ones(tmp_path):
  c = _tiny()
  keys = [problem_key(p) for p in heldout_problems(c)]
  ok = TrainedOn(str(tmp_path / "a.json"))
  ok.watch(keys)
  _record_streams(c, ok, synthetic.problems)
  assert ok.count(keys) == 0 and not ok.hits and ok.check(keys, "held out") == 0
  # Negative control: the streams as they were (synthetic.draws), against their held-out set.
  old_keys = [problem_key(p) for p in itertools.islice(
      synthetic.draws(c.seed, "heldout", **synthetic.options(c.data)), c.data.heldout)]
  old = TrainedOn(str(tmp_path / "b.json"))
  old.watch(old_keys)
  _record_streams(c, old, synthetic.draws)
  assert old.count(old_keys) > 64 and len(old.hits) == old.count(old_keys)
  with pytest.raises(HeldOutOverlapError, match=r"held out: \d+ problem\(s\) the run trained on"):
    old.check(old_keys, "held out")


def test_the_record_persists_resumes_and_merges(tmp_path):
  path = str(tmp_path / "trained_on.json")
  t = TrainedOn(path)
  t.add(("train-0-1", "compute 1+2."))
  t.add(("", "compute 3+4."))
  t.save()
  again = TrainedOn(path)
  assert again.count([("x", "compute 3+4."), ("train-0-1", ""), ("y", "compute 9+9.")]) == 2
  again.watch([("h", "compute 1+2.")])
  assert again.hits == {"h"}   # what was recorded before the watch counts too
  (tmp_path / "broken.json").write_text("{not json")
  with pytest.raises(ValueError, match="not a readable record of trained problems"):
    TrainedOn(str(tmp_path / "broken.json"))


def test_a_run_counts_its_cold_start_run_on_its_own(tmp_path):
  sft = tmp_path / "sft"
  sft.mkdir()
  t = TrainedOn(str(sft / TrainedOn.FILE))
  t.add(("", "compute 5+5."))
  t.save()
  c = _tiny()
  c.init.update(source="orbax", path=str(sft / "params"))
  run = config_lib.validate(c)
  assert trained_on_for(run, str(tmp_path / "rl")).count([("h", "compute 5+5.")]) == 1


def test_the_rl_stream_records_every_prompt_it_draws(tmp_path):
  c = _tiny()
  trained = TrainedOn(None)
  stream = train_prompts(c, heldout_problems(c), None, trained=trained)
  drawn = [problem_key(p) for p in itertools.islice(stream, 40)]
  assert trained.count(drawn) == 40 and stream.state() == {"consumed": 40}


def test_launch_eval_refuses_a_set_the_run_trained_on_before_any_work(tmp_path):
  c = _tiny()
  held = heldout_problems(c)
  t = TrainedOn(str(tmp_path / TrainedOn.FILE))
  t.add(problem_key(held[3]))
  t.save()
  with pytest.raises(HeldOutOverlapError, match="1 problem\\(s\\) the run trained on"):
    evaluate_checkpoint(c, str(tmp_path), checkpoint="init")
  assert not list(tmp_path.glob("eval_*.json"))
  json.loads((tmp_path / TrainedOn.FILE).read_text())   # left as it was
