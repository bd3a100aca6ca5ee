"""grain loaders: shuffling, repeat, data-parallel sharding, exact resume, SFT packing."""
import json

import numpy as np
import pytest

from magistral_jax.data import jsonl
from magistral_jax.data import loader
from magistral_jax.data import tfds_builders as tb


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  d = tmp_path_factory.mktemp("tfds")
  src = d / "src"
  src.mkdir()
  jsonl.write_jsonl(str(src / "m.jsonl"),
                    [{"id": f"m{i}", "problem": f"What is {i}+1?", "answer": str(i + 1)} for i in range(23)])
  jsonl.write_jsonl(str(src / "c.jsonl"),
                    [{"id": f"c{i}", "statement": f"print {i}", "tests": [{"input": "", "output": f"{i}\n"}],
                      "solutions": [f"print({i})"]} for i in range(7)])
  jsonl.write_jsonl(str(src / "s.jsonl"),
                    [{"id": f"s{i}", "prompt": "p" * (1 + i % 5), "completion": "c" * (1 + i % 9)}
                     for i in range(40)])
  tb.build_dataset("math", "m", str(src / "m.jsonl"), str(d))
  tb.build_dataset("code", "c", str(src / "c.jsonl"), str(d))
  jsonl.write_jsonl(str(src / "a.jsonl"),
                    [{"id": "a0", "statement": "Write add(x, y).", "test_type": "assert",
                      "tests": ["assert add(1, 2) == 3", "assert add(0, 0) == 0"],
                      "test_setup": "import math", "solutions": ["def add(x, y):\n  return x + y"]}])
  tb.build_dataset("sft", "s", str(src / "s.jsonl"), str(d))
  tb.build_dataset("code", "a", str(src / "a.jsonl"), str(d))
  return str(d)


def _ids(xs):
  return [x["id"] for x in xs]


def test_problem_dicts_have_the_pipeline_fields(data_dir):
  probs = loader.ProblemLoader(data_dir, ["m", "c", "a"], num_epochs=1, shard_index=0,
                               shard_count=1).take(100)
  # Every stdin/stdout statement is posed in Python and in C++; assert tests exist in Python only.
  assert len(probs) == 23 + 2 * 7 + 1
  by_id = {p["id"]: p for p in probs}
  assert by_id["m4"] == {"id": "m4", "kind": "math", "problem": "What is 4+1?", "answer": "5",
                         "source": "m", "natural_language": "en"}
  py, cpp = by_id["c3#python"], by_id["c3#cpp"]
  assert py["kind"] == "code" and py["answer"] is None and py["language"] == "python"
  assert py["problem"].startswith("print 3\n\n") and "Python 3" in py["problem"]
  assert cpp["language"] == "cpp" and "C++" in cpp["problem"]
  assert py["tests"] == cpp["tests"] == [{"input": "", "output": "3\n"}]
  a = by_id["a0"]
  assert a["language"] == "python" and a["problem"] == "Write add(x, y)."
  assert a["test_list"] == ["assert add(1, 2) == 3", "assert add(0, 0) == 0"]
  assert a["test_setup_code"] == "import math" and "tests" not in a


def test_problem_dicts_score_with_the_reward_function(data_dir):
  from magistral_jax.rewards.reward import compute_reward
  from magistral_jax.rewards.config import RewardConfig
  probs = {p["id"]: p for p in loader.ProblemLoader(data_dir, ["m"], num_epochs=1, shard_index=0,
                                                       shard_count=1).take(100)}
  cfg = RewardConfig(language_bonus=0.0)
  good = compute_reward(probs["m4"], "<think>4 plus 1</think>\n\\boxed{5}", None, cfg)
  bad = compute_reward(probs["m4"], "<think>4 plus 1</think>\n\\boxed{6}", None, cfg)
  assert good.error is None and (good.reward, bad.reward) == (1.0, 0.1)


def test_each_epoch_is_a_new_permutation_of_all_rows(data_dir):
  probs = loader.ProblemLoader(data_dir, "m", seed=3, num_epochs=3, shard_index=0, shard_count=1).take(1000)
  assert len(probs) == 69
  epochs = [_ids(probs[i * 23:(i + 1) * 23]) for i in range(3)]
  assert all(sorted(e) == sorted(f"m{i}" for i in range(23)) for e in epochs)
  assert epochs[0] != epochs[1] and epochs[1] != epochs[2]
  again = loader.ProblemLoader(data_dir, "m", seed=3, num_epochs=3, shard_index=0, shard_count=1).take(23)
  other = loader.ProblemLoader(data_dir, "m", seed=4, num_epochs=3, shard_index=0, shard_count=1).take(23)
  assert _ids(again) == epochs[0] and _ids(other) != epochs[0]


def test_shards_are_disjoint_and_cover_the_data(data_dir):
  shards = [_ids(loader.ProblemLoader(data_dir, ["m", "c"], seed=1, num_epochs=1, shard_index=i,
                                      shard_count=4).take(100)) for i in range(4)]
  flat = [x for s in shards for x in s]
  assert len(flat) == len(set(flat)) == 23 + 2 * 7
  assert max(map(len, shards)) - min(map(len, shards)) <= 1
  with pytest.raises(ValueError, match="shard_index 4"):
    loader.ProblemLoader(data_dir, "m", shard_index=4, shard_count=4)


def test_repeat_forever_keeps_going(data_dir):
  probs = loader.ProblemLoader(data_dir, "c", shard_index=0, shard_count=1).take(50)
  assert len(probs) == 50
  assert set(_ids(probs)) == {f"c{i}#{lang}" for i in range(7) for lang in ("python", "cpp")}


def test_problem_loader_resumes_exactly_from_saved_state(data_dir):
  kw = dict(seed=7, shard_index=1, shard_count=2)
  a = loader.ProblemLoader(data_dir, ["m", "c"], **kw)
  a.take(41)                                   # crosses an epoch boundary (~18 rows per shard)
  state = json.loads(json.dumps(a.state()))    # it goes through the JSON of a checkpoint
  expected = _ids(a.take(40))
  b = loader.ProblemLoader(data_dir, ["m", "c"], **kw)
  b.restore(state)
  assert _ids(b.take(40)) == expected


def test_restoring_into_a_different_loader_is_refused(data_dir):
  state = loader.ProblemLoader(data_dir, "m", seed=1, shard_index=0, shard_count=1).state()
  with pytest.raises(ValueError, match="seed"):
    loader.ProblemLoader(data_dir, "m", seed=2, shard_index=0, shard_count=1).restore(state)
  with pytest.raises(ValueError, match="holds sft records"):
    loader.ProblemLoader(data_dir, "s", shard_index=0, shard_count=1)


def _char_tokenize():
  # A real (if simple) tokenizer: one id per character byte; 1 = BOS, 2 = EOS.
  enc = lambda s: [3 + b for b in s.encode()]
  return loader.sft_tokenize_fn(lambda s: [1] + enc(s), enc, eos_id=2)


def test_sft_packing_keeps_every_token_and_masks_the_prompt(data_dir):
  sft = loader.SftLoader(data_dir, "s", _char_tokenize(), seq_len=24, batch_size=2, seed=0,
                         num_epochs=1, shard_index=0, shard_count=1)
  batches = list(sft)
  assert batches and all(b["tokens"].shape == (2, 24) for b in batches)
  seen = []
  for b in batches:
    for row in range(2):
      tok, seg, pos, mask = (b[k][row] for k in ("tokens", "segment_ids", "positions", "loss_mask"))
      assert np.all(tok[seg == 0] == 0) and np.all(mask[seg == 0] == 0)
      for s in np.unique(seg[seg > 0]):
        t, m, p = tok[seg == s], mask[seg == s], pos[seg == s]
        assert np.array_equal(p, np.arange(len(t)))
        assert t[0] == 1 and t[-1] == 2 and m[0] == 0 and m[-1] == 1   # BOS unmasked.. EOS trained
        n_prompt = int(np.sum(m == 0))
        prompt = bytes(int(x) - 3 for x in t[1:n_prompt]).decode()
        completion = bytes(int(x) - 3 for x in t[n_prompt:-1]).decode()
        seen.append((prompt, completion))
  expected = {("p" * (1 + i % 5), "c" * (1 + i % 9)) for i in range(40)}
  # drop_remainder may leave out the last partial batch; nothing else is lost or altered.
  assert set(seen) <= expected and len(seen) == len(set(seen)) >= 40 - 8


def test_sft_loader_resumes_exactly_from_saved_state(data_dir):
  kw = dict(seq_len=24, batch_size=2, seed=5, shard_index=0, shard_count=1)
  a = loader.SftLoader(data_dir, "s", _char_tokenize(), **kw)
  for _ in range(9):
    next(a)
  state = json.loads(json.dumps(a.state()))
  expected = [next(a) for _ in range(6)]
  b = loader.SftLoader(data_dir, "s", _char_tokenize(), **kw)
  b.restore(state)
  for want in expected:
    got = next(b)
    assert all(np.array_equal(got[k], want[k]) for k in want)


def test_shipped_code_problems_score_their_reference_solutions_in_the_sandbox(tmp_path):
  from magistral_jax.rewards.reward import compute_reward
  from magistral_jax.rewards.config import RewardConfig
  tb.build_shipped(str(tmp_path), names=["humaneval", "mbpp_sample20"])
  cfg = RewardConfig(language_bonus=0.0)
  for name in ("humaneval", "mbpp_sample20"):
    src = tb.load_source(str(tmp_path), name, kind="code")
    for i in range(2):
      rec = tb.decode("code", src[i])
      task = loader.problem_dict("code", rec, "python")
      ref = f"<think>ok</think>\n```python\n{rec['solutions'][0]['code']}\n```"
      wrong = "<think>ok</think>\n```python\ndef unrelated():\n  pass\n```"
      assert compute_reward(task, ref, None, cfg).reward == 1.0, (name, rec["id"])
      assert compute_reward(task, wrong, None, cfg).reward == 0.1
