"""The data filters that need a model, run end to end through the real generator and verifier
pool with a tiny random decoder: difficulty filter (sampling, grading, journal, report) and
translation (prompting, fastText check), inside `filters.filter_to_dataset`."""
import json

import pytest

from magistral_jax.curate import difficulty as D
from magistral_jax.curate import filters
from magistral_jax.curate import translate as T
from magistral_jax.data import jsonl
from magistral_jax.data import loader


class ByteTokenizer:
  """A complete byte-level tokenizer (ids 3..258 are bytes; 1 BOS, 2 EOS) for a tiny model."""
  bos_id, eos_id, pad_id, vocab_size = 1, 2, 0, 259

  def encode(self, text, add_bos=False):
    return ([1] if add_bos else []) + [3 + b for b in text.encode("utf-8")]

  def decode(self, ids, skip_special_tokens=True):
    return bytes(int(i) - 3 for i in ids if int(i) >= 3).decode("utf-8", errors="replace")

  def apply_chat_template(self, problem, system_prompt=None):
    return self.encode(f"Q: {problem[-40:]}\nA:", add_bos=True)   # short: the tiny engine's window


@pytest.mark.slow   # engine compiles: ~1.5 min on a loaded 2-core host
def test_difficulty_and_translation_through_the_engine_and_pool(tmp_path):
  import jax
  from magistral_jax.generate.config import SamplingConfig
  from magistral_jax.generate.engine import Engine
  from magistral_jax.generate.loop import GeneratorLoop
  from magistral_jax.model import transformer as TR
  from magistral_jax.model.config import ModelConfig
  from magistral_jax.parallel.sharding import make_mesh
  from magistral_jax.verify.pool import VerifierPool

  cfg = ModelConfig(vocab_size=259, hidden_size=32, intermediate_size=64, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=8)
  eng = Engine(cfg, make_mesh({"tensor": 1}, jax.devices()[:1]), max_concurrent_decodes=4,
               max_prefill_length=64, max_decode_length=8, prefill_buckets=(64,),
               sampling=SamplingConfig(temperature=1.0, max_new_tokens=8, eos_id=2),
               truncate_prompts=True)
  loop = GeneratorLoop(eng, TR.init_params(cfg, jax.random.PRNGKey(0)), seed=0,
                       sampling=eng.sampling)
  tok = ByteTokenizer()

  src = tmp_path / "raw.jsonl"
  jsonl.write_jsonl(str(src), [
      {"id": "a", "problem": "What is 2+3?", "answer": "5"},
      {"id": "b", "problem": "Prove that 2 < 3.", "answer": "proof"},      # format filter
      {"id": "c", "problem": "What is 7*6?", "answer": "42"},
      {"id": "d", "problem": "What is 9-4?", "answer": "5"}])
  stage = D.DifficultyStage("stage1", k=3, min_pass_rate=0.0, max_pass_rate=1.0, batch_problems=2)
  with VerifierPool(num_workers=1) as pool:
    report = filters.filter_to_dataset(
        [str(src)], kind="math", name="e2e", data_dir=str(tmp_path / "tfds"),
        out_dir=str(tmp_path / "out"), filters=["format", "difficulty", "translate"],
        difficulty_stages=[(stage, D.generator_sample_fn(loop, tok, max_new_tokens=8))],
        score_fn=D.pool_score_fn(pool),
        translate_fn=T.generator_translate_fn(loop, tok, max_new_tokens=8),
        translate_config=T.TranslationConfig(fraction=1.0))

  assert report["format"]["dropped"] == {"proof": 1}
  # A random tiny model never writes "<think>...\boxed{}": every sample fails the format check.
  diff = report["difficulty"]["stage1"]
  assert diff["pass_rate_histogram"] == {"0/3": 3, "1/3": 0, "2/3": 0, "3/3": 0}
  assert diff["kept"] == 3
  journal = [json.loads(l) for l in open(tmp_path / "out" / "e2e.difficulty" / "stage1.journal.jsonl")]
  assert sorted(r["id"] for r in journal) == ["a", "c", "d"] and all(r["k"] == 3 for r in journal)
  tr = report["translate"]
  assert tr["selected"] == 3
  assert sum(tr["translated"].values()) + sum(tr["rejected"].values()) == 3
  probs = loader.ProblemLoader(str(tmp_path / "tfds"), "e2e", num_epochs=1, shard_index=0,
                               shard_count=1).take(10)
  assert len(probs) == 3 and {p["answer"] for p in probs} == {"5", "42"}
