"""No evaluation includes a problem the run trained on: held-out problems against the RL stream
and the SFT traces, by id and by normalised question text (data/splits.py, data/prompts.py)."""
import json

import pytest

from magistral_jax import config as config_lib
from magistral_jax.data import gsm8k_traces, jsonl, loader, records
from magistral_jax.data import tfds_builders as tb
from magistral_jax.data.prompts import (TrainProblems, check_heldout_unseen, dataset_problems,
                                        heldout_problems, heldout_source)
from magistral_jax.data.splits import (HeldOutOverlapError, KeySet, check_disjoint,
                                       normalise_text, overlap, problem_key)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  """Both shipped GSM8K splits, built once for the module."""
  d = tmp_path_factory.mktemp("splits")
  tb.build_shipped(str(d), ["gsm8k_train", "gsm8k_test"])
  return str(d)


def _config(data_dir, **data):
  c = config_lib.default_config()
  c.data.update(data_dir=data_dir, **data)
  return c


# ---- the keys --------------------------------------------------------------------------------
def test_text_is_normalised_for_case_unicode_and_whitespace_but_not_punctuation():
  assert normalise_text("  What is\n2+3? ") == normalise_text("WHAT IS 2+3?") == "what is 2+3?"
  assert normalise_text("ｗｈａｔ") == "what"     # NFKC: full-width letters
  assert normalise_text("What is 2+3?") != normalise_text("What is 2-3?")


def test_a_code_problem_keys_as_its_record_in_every_language():
  rec = {"id": "c1", "statement": "Read n, print n+1.", "language": "en", "test_type":
         "stdin_stdout", "tests": [{"input": "1\n", "output": "2\n"}], "test_setup": "",
         "source": "c"}
  py, cpp = (loader.problem_dict("code", rec, lang) for lang in ("python", "cpp"))
  assert py["id"] == "c1#python" and py["problem"] != cpp["problem"]
  assert problem_key(py) == problem_key(cpp) == ("c1", "read n, print n+1.")
  math = {"id": "m#python", "kind": "math", "problem": "x"}   # only code ids are stripped
  assert problem_key(math) == ("m#python", "x")


def test_overlap_by_id_and_by_text_and_the_error_names_them():
  held = [("t/1", "q one"), ("t/2", "q two"), ("t/3", "q three")]
  trained = [("t/1", "other"), ("x/9", "q two"), ("x/8", "q four")]
  assert overlap(held, trained) == (["t/1"], [("q two", "t/2", "x/9")])
  check_disjoint(held[2:], trained, heldout_name="h", trained_name="t")   # disjoint: no error
  with pytest.raises(HeldOutOverlapError) as e:
    check_disjoint(held, trained, heldout_name="the held-out set", trained_name="the stream")
  msg = str(e.value)
  assert "the held-out set shares 2 problem(s) with the stream" in msg
  assert "1 by id: t/1" in msg and "'q two' (held out as t/2, trained as x/9)" in msg
  many = [(f"t/{i}", f"q{i}") for i in range(12)]
  with pytest.raises(HeldOutOverlapError, match=r"12 by id: t/0, t/1, t/2, t/3, t/4 and 7 more"):
    check_disjoint(many, many, heldout_name="h", trained_name="t")
  skip = KeySet(held)
  assert ("t/2", "new") in skip and ("new", "q three") in skip and ("new", "new") not in skip


# ---- the shipped GSM8K splits ----------------------------------------------------------------
def test_shipped_gsm8k_train_and_test_share_no_id_and_no_question():
  def keys(name):
    rows = jsonl.iter_rows(records.shipped_path(name), jsonl.ReadReport())
    return [(p["id"], normalise_text(p["problem"])) for p in
            (records.gsm8k(r, source=name, row_number=i) for i, r in rows)]
  train, test = keys("gsm8k_train"), keys("gsm8k_test")
  assert len(train) == 7473 and len(test) == 1319
  check_disjoint(test, train, heldout_name="gsm8k_test", trained_name="gsm8k_train")


def test_a_separate_heldout_source_is_the_heldout_set_and_the_stream_never_meets_it(data_dir):
  c = _config(data_dir, source="gsm8k_train", heldout_source="gsm8k_test", heldout=16)
  assert heldout_source(c) == "gsm8k_test"
  held = heldout_problems(c)
  assert len(held) == 16 and all(p["source"] == "gsm8k_test" for p in held)
  check_heldout_unseen(c, held)   # no overlap: no error
  stream = TrainProblems(c, held)
  assert all(next(stream)["source"] == "gsm8k_train" for _ in range(32))
  # The same seeded order as a run on the test split alone (launch/eval.py's sets).
  alone = _config(data_dir, source="gsm8k_test", heldout=16)
  assert [p["id"] for p in heldout_problems(alone)] == [p["id"] for p in held]


def test_a_config_that_trains_on_its_heldout_source_raises_naming_the_ids(data_dir):
  c = _config(data_dir, source="gsm8k_train,gsm8k_test", heldout_source="gsm8k", heldout=8)
  held = heldout_problems(c)
  with pytest.raises(HeldOutOverlapError, match=r"shares 8 problem\(s\) with the RL stream "
                     r"\(data.source='gsm8k_train,gsm8k_test'\): 8 by id: gsm8k_test/"):
    check_heldout_unseen(c, held)


def test_the_same_question_under_another_id_raises_naming_the_text(data_dir, tmp_path):
  """GSM8K's train and test ids never match, so text is what catches a copied question: here
  one held-out test question, re-cased and re-spaced, in a dataset the run trains on."""
  c = _config(data_dir, source="gsm8k_train", heldout_source="gsm8k_test", heldout=4)
  held = heldout_problems(c)
  copy = {"id": "copied/0", "problem": "  " + held[2]["problem"].upper().replace(" ", "\n "),
          "answer": held[2]["answer"]}
  jsonl.write_jsonl(str(tmp_path / "copied.jsonl"), [copy])
  tb.build_dataset("math", "copied", str(tmp_path / "copied.jsonl"), data_dir)
  c.data.source = "gsm8k_train,copied"
  with pytest.raises(HeldOutOverlapError) as e:
    check_heldout_unseen(c, held)
  msg = str(e.value)
  assert "1 by question text" in msg and f"held out as {held[2]['id']}, trained as copied/0" in msg
  assert normalise_text(held[2]["problem"])[:40] in msg


def test_sft_traces_that_hold_a_heldout_question_raise(data_dir, tmp_path):
  test = dataset_problems(_config(data_dir), "gsm8k_test")
  rows = [json.loads(l) for l in open(records.shipped_path("gsm8k_train"))][:5]
  rows.append(dict(rows[0], idx=99, question=test[7]["problem"]))   # a test question, train id
  src = tmp_path / "train_like.jsonl"
  src.write_text("".join(json.dumps(r) + "\n" for r in rows))
  out = tmp_path / "traces.jsonl"
  with pytest.raises(HeldOutOverlapError, match=f"held out as {test[7]['id']}, trained as "
                     "gsm8k_train/99"):
    gsm8k_traces.write_traces(str(out), source_path=str(src), heldout=test)
  assert not out.exists()   # nothing written
  rep = gsm8k_traces.write_traces(str(out), source_path=str(src), heldout=test[8:])
  assert rep["traces"] == 6 and rep["heldout_checked"] == len(test) - 8


# ---- a held-out head of data.source itself ---------------------------------------------------
def test_same_source_stream_skips_the_heldout_questions_under_any_id(tmp_path):
  """Three ids of one question (case and spacing aside) and one other question; whichever the
  held-out head is, the stream never yields its id or its text."""
  qs = ["What is 1+1?", "what is  1+1?", "WHAT IS 1+1?", "What is 2+2?"]
  jsonl.write_jsonl(str(tmp_path / "d.jsonl"),
                    [{"id": f"d{i}", "problem": q, "answer": "2"} for i, q in enumerate(qs)])
  tb.build_dataset("math", "d", str(tmp_path / "d.jsonl"), str(tmp_path))
  for seed in range(3):
    c = _config(str(tmp_path), source="d", heldout=1)
    c.seed = seed
    (head,) = heldout_problems(c)
    check_heldout_unseen(c, [head])   # the head is what the stream skips
    stream = TrainProblems(c, [head])
    got = [next(stream) for _ in range(12)]
    key = problem_key(head)
    assert all(p["id"] != head["id"] and problem_key(p)[1] != key[1] for p in got)


def test_evaluating_past_the_heldout_head_of_the_training_source_raises(data_dir):
  """launch/eval.py's check: with data.heldout=8 the stream trains on every other test problem,
  so an evaluation of 16 of them includes 8 trained ones."""
  c = _config(data_dir, source="gsm8k_test", heldout=8)
  check_heldout_unseen(c, heldout_problems(c))
  more = heldout_problems(config_lib.apply_overrides(c, {"data.heldout": 16}))
  with pytest.raises(HeldOutOverlapError, match=r"shares 8 problem\(s\) with the RL stream"):
    check_heldout_unseen(c, more, what="evaluation set 'gsm8k_test'")


def test_the_synthetic_task_is_not_checked():
  c = config_lib.default_config()
  check_heldout_unseen(c, heldout_problems(c))   # builds nothing, reads nothing
