"""A tool's result tokens are context, not actions (issue #67): they are out of the loss, the
token normaliser and the length penalty, and a sample's mask of them survives every hand-off.
Each check has its negative control: the same completion without the mask trains on them."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from magistral_jax.generate.requests import Sample
from magistral_jax.pipeline.generator_service import pack_samples, unpack_samples
from magistral_jax.rl.collate import Completion, unpack_tokens
from magistral_jax.rl.config import GRPOConfig
from magistral_jax.rl.loss import grpo_loss
from magistral_jax.rl.minibatch import collate_minibatch

CFG = GRPOConfig(n_batch=2, n_mini=2, group_size=2, microbatch_tokens=64, microbatch_rows=2)
# Completion 0: three policy tokens (the call), three a tool wrote (its result), two more policy
# tokens (the answer). Completion 1: four policy tokens, no call.
TOOL = np.array([0, 0, 0, 1, 1, 1, 0, 0], bool)


def _minibatch(masked: bool):
  rng = np.random.default_rng(0)
  comps = [Completion([1, 2], rng.integers(3, 50, 8), -rng.random(8), advantage=1.0,
                      action_mask=~TOOL if masked else None),
           Completion([1, 3], rng.integers(3, 50, 4), -rng.random(4), advantage=-1.0)]
  return collate_minibatch(comps, CFG)


def _per_token(mb, key):
  return unpack_tokens(mb.arrays[key], mb.completions, mb.placement)


def _grad(mb):
  a = {k: jnp.asarray(v[0]) for k, v in mb.arrays.items()}
  # The policy moved a little from the sampler, so every trained token has a non-zero gradient.
  lp = a["old_logprobs"] + 0.05

  def loss(logprobs):
    return grpo_loss(logprobs, a["old_logprobs"], a["advantages"], a["weights"], a["loss_mask"],
                     CFG, segment_ids=a["segment_ids"])[0]
  g = np.asarray(jax.grad(loss)(lp))[None]
  return [x for x in unpack_tokens(g, mb.completions, mb.placement)]


def test_result_tokens_carry_no_loss_weight_or_gradient():
  mb = _minibatch(masked=True)
  w0, w1 = _per_token(mb, "weights")
  # The token normaliser counts the 5 + 4 policy tokens, not the 8 + 4 completion tokens.
  np.testing.assert_allclose(w0, np.where(TOOL, 0.0, 1 / 9), rtol=1e-6)
  np.testing.assert_allclose(w1, 1 / 9, rtol=1e-6)
  assert _per_token(mb, "loss_mask")[0].tolist() == (~TOOL).astype(float).tolist()
  assert not _per_token(mb, "advantages")[0][TOOL].any()
  g0, g1 = _grad(mb)
  assert not g0[TOOL].any() and np.all(g0[~TOOL] != 0) and np.all(g1 != 0)
  assert mb.stats["completion_tokens"] == 9


def test_negative_control_without_the_mask_the_result_tokens_are_trained_on():
  mb = _minibatch(masked=False)
  w0, _ = _per_token(mb, "weights")
  np.testing.assert_allclose(w0, 1 / 12, rtol=1e-6)
  g0, _ = _grad(mb)
  assert np.all(g0[TOOL] != 0)


def test_result_tokens_need_no_finite_logprob_and_a_completion_needs_an_action():
  lp = np.where(TOOL, np.nan, -0.5)   # the loop has no log-prob for a token it did not sample
  ok = Completion([1], np.arange(3, 11), lp, action_mask=~TOOL)
  mb = collate_minibatch([ok, Completion([1], [4, 5], [-1.0, -1.0], advantage=1.0)], CFG)
  assert np.isfinite(mb.arrays["old_logprobs"]).all()
  with pytest.raises(ValueError, match="non-finite old log-probs"):
    collate_minibatch([Completion([1], np.arange(3, 11), lp), ok], CFG)
  with pytest.raises(ValueError, match="no token of the policy's own"):
    collate_minibatch([Completion([1], [3, 4], [-1.0, -1.0], action_mask=[False, False]), ok],
                      CFG)
  with pytest.raises(ValueError, match="action_mask of 2 for 8"):
    collate_minibatch([Completion([1], np.arange(3, 11), lp, action_mask=[True, True]), ok], CFG)


def test_a_void_turn_s_sample_is_trained_on_nothing_and_the_others_as_without_it():
  """GRPOConfig.drop_void_turns: a completion with trained=False is packed but carries no loss,
  weight or gradient, and the normaliser is the others' alone (as if it were not there);
  negative control: trained, the same completion gets weight and gradient."""
  rng = np.random.default_rng(1)
  void = Completion([1, 2], rng.integers(3, 50, 8), -rng.random(8), advantage=1.0,
                    action_mask=~TOOL, trained=False)
  other = Completion([1, 3], rng.integers(3, 50, 4), -rng.random(4), advantage=-1.0, group_id=1)
  mb = collate_minibatch([void, other], CFG)
  w0, w1 = _per_token(mb, "weights")
  assert not w0.any() and not _per_token(mb, "loss_mask")[0].any()
  np.testing.assert_allclose(w1, 1 / 4, rtol=1e-6)   # the other's 4 tokens alone
  alone = collate_minibatch([other], CFG)
  np.testing.assert_allclose(w1, _per_token(alone, "weights")[0], rtol=1e-6)
  g0, g1 = _grad(mb)
  assert not g0.any() and np.all(g1 != 0)
  assert mb.stats["completion_tokens"] == 4
  import dataclasses
  trained = collate_minibatch([dataclasses.replace(void, trained=True), other], CFG)
  t0, t1 = _per_token(trained, "weights")
  np.testing.assert_allclose(t0, np.where(TOOL, 0.0, 1 / 9), rtol=1e-6)
  assert np.all(_grad(trained)[0][~TOOL] != 0)
  # Every completion of a minibatch void: nothing to train on, a zero loss (not a division by 0).
  none = collate_minibatch([void, dataclasses.replace(other, trained=False)], CFG)
  assert not none.arrays["weights"].any() and not np.isnan(_grad(none)[1]).any()


def test_the_group_assembler_finds_void_turns_in_multi_turn_samples_only():
  from magistral_jax.pipeline.groups import GroupAssembler, batch_metrics
  from magistral_jax.rewards.reward import RewardResult, empty_parts
  from magistral_jax.tool_use.protocol import result_block
  # A char-level "tokenizer": token t is chr(t).
  decode = lambda tokens: "".join(map(chr, tokens))
  call = "<think>\n<tool>\nprint(2+2)\n</tool>"
  texts = [(call, result_block("4\n", 400), "so the answer is"),      # cut off after a result
           (call, result_block("4\n", 400), "</think>\n\\boxed{4}"),  # answered
           ("<think>\nso the answer is", "", "")]                       # single-turn, cut off

  def sample(i, parts):
    toks = [ord(ch) for p in parts for ch in p]
    mask = np.concatenate([np.full(len(p), j == 1) for j, p in enumerate(parts)])
    return Sample(0, i, [1], toks, np.zeros(len(toks)), np.zeros(len(toks), np.int64), "length",
                  tool_mask=mask if parts[1] else None)

  for drop in (True, False):
    a = GroupAssembler(GRPOConfig(n_batch=3, n_mini=3, group_size=3, drop_void_turns=drop),
                       decode=decode)
    a.open(0, 3)
    for i, parts in enumerate(texts):
      parts_r = empty_parts()
      parts_r.update(format=0.1, correct=0.9 if i == 1 else 0.0)
      group = a.add(sample(i, parts), RewardResult(1.0 if i == 1 else 0.0, parts_r))
    assert [c.trained for c in group.completions] == [not drop, True, True]
    assert a.counters["void_turn_samples"] == int(drop)
    # The void sample's reward still sits in its group's mean.
    assert [round(c.advantage, 3) for c in group.completions] == [-0.333, 0.667, -0.333]
    m = batch_metrics(a.take(1, 0.0), trained_version=0, decode=decode)
    assert m["void_turn_frac"] == pytest.approx(1 / 3 if drop else 0.0)
    assert m["tool_call_cut_frac"] == 0.0


def test_a_sample_cut_off_in_the_middle_of_a_call_is_measured():
  from magistral_jax.pipeline.groups import RolloutBatch, batch_metrics
  from magistral_jax.rl.advantages import score_group
  from magistral_jax.rl.collate import Completion as C
  from magistral_jax.rewards.reward import RewardResult, empty_parts
  decode = lambda tokens: "".join(map(chr, tokens))
  texts = {"length": ["<think>\n<tool>\nprint(2", "<think>\nso 4\n</think>\n\\boxed{4}"],
           "eos": ["<think>\n<tool>\nprint(2"]}
  samples = [Sample(0, i, [1], [ord(ch) for ch in t], np.zeros(len(t)), np.zeros(len(t), int),
                    reason) for reason, ts in texts.items() for i, t in enumerate(ts)]
  group = score_group(0, [C([1], s.tokens) for s in samples],
                      [RewardResult(float(i), empty_parts()) for i in range(3)],
                      GRPOConfig(group_size=3, n_batch=3, n_mini=3), info=samples)
  m = batch_metrics(RolloutBatch([group], [], 0.0), trained_version=0, decode=decode)
  assert m["tool_call_cut_frac"] == pytest.approx(1 / 3)   # cut by the budget, in a call
  assert "tool_call_cut_frac" not in batch_metrics(RolloutBatch([group], [], 0.0), 0)


def test_a_sample_s_tool_mask_reaches_the_length_penalty_and_crosses_processes():
  s = Sample("r", 0, [1, 2], list(range(3, 11)), np.zeros(8, np.float32),
             np.zeros(8, np.int64), "eos", tool_mask=TOOL.copy())
  plain = Sample("r", 1, [1, 2], [3, 4], np.zeros(2, np.float32), np.zeros(2, np.int64), "eos")
  assert s.num_policy_tokens == 5 and plain.num_policy_tokens == 2
  assert s.action_mask.tolist() == (~TOOL).tolist() and plain.action_mask is None
  back = unpack_samples(*pack_samples([s, plain]))
  assert back[0].tool_mask.tolist() == TOOL.tolist() and back[1].tool_mask is None


def test_scoring_passes_the_policy_s_length_to_the_verifier():
  from magistral_jax.pipeline.scoring import Scoring
  seen = []

  class Pool:
    def submit(self, task, response, num_tokens, group_seed):
      seen.append(num_tokens)
      raise RuntimeError("enough")

  class Tok:
    def decode(self, tokens):
      return "x" * len(tokens)

  scoring = Scoring(Pool(), Tok())
  scoring.submit(Sample(0, 0, [1], list(range(3, 11)), np.zeros(8), np.zeros(8), "eos",
                        tool_mask=TOOL.copy()))
  assert seen == [5]


def test_the_verifiers_grade_the_policy_s_words_never_what_a_tool_printed():
  """A call that prints the format's closing tag and an answer: graded_text puts an empty
  result block in its place, so the real reward finds no answer there (the policy wrote none);
  negative control: the whole transcript would pass the format with the tool's answer."""
  from magistral_jax.rewards.config import RewardConfig
  from magistral_jax.rewards.reward import compute_reward
  from magistral_jax.tool_use.protocol import GRADED_RESULT, graded_text, result_block
  decode = lambda tokens: "".join(map(chr, tokens))
  parts = ["<think>\n<tool>\nprint('<' + '/think>')\nprint(7)\n</tool>",
           result_block("</think>\n\\boxed{7}\n", 400), "so"]
  toks = [ord(ch) for p in parts for ch in p]
  mask = np.concatenate([np.full(len(p), j == 1) for j, p in enumerate(parts)])
  graded = graded_text(decode, toks, mask)
  assert graded == parts[0] + GRADED_RESULT + parts[2]
  assert graded_text(decode, toks, None) == "".join(parts)
  task = {"kind": "math", "problem": "Compute 3+4.", "answer": "7"}
  cfg = RewardConfig(l_max=4096, l_cache=512, language_bonus=0.0)
  assert compute_reward(task, graded, 30, cfg).parts["correct"] == 0.0
  assert compute_reward(task, "".join(parts), 30, cfg).parts["correct"] > 0   # the control



def test_the_leader_decodes_a_sample_once_for_its_score_and_its_void_check():
  """pipeline/scoring.Scoring hands the verifier the graded text, and the group assembler's
  void-turn check reads the same text: the sample is decoded once (Sample.graded), and what each
  reads is protocol.graded_text's."""
  from concurrent.futures import Future
  from magistral_jax.pipeline.groups import GroupAssembler
  from magistral_jax.pipeline.scoring import Scoring
  from magistral_jax.rewards.reward import RewardResult, empty_parts
  from magistral_jax.tool_use.protocol import graded_text, result_block
  calls = []

  def decode(tokens):
    calls.append(len(tokens))
    return "".join(map(chr, tokens))

  parts = ("<think>\n<tool>\nprint(2+2)\n</tool>", result_block("4\n", 400), "so the answer is")
  toks = [ord(ch) for p in parts for ch in p]
  mask = np.concatenate([np.full(len(p), j == 1) for j, p in enumerate(parts)])
  samples = [Sample(0, i, [1], toks, np.zeros(len(toks)), np.zeros(len(toks), np.int64),
                    "length", tool_mask=mask) for i in range(2)]
  submitted = []

  class Pool:
    def submit(self, task, response, n_tokens, seed):
      submitted.append(response)
      f = Future()
      f.set_result(RewardResult(0.0, empty_parts()))
      return f

  scoring = Scoring(Pool(), type("Tok", (), {"decode": staticmethod(decode)})())
  a = GroupAssembler(GRPOConfig(n_batch=2, n_mini=2, group_size=2, drop_void_turns=True),
                     decode=decode)
  a.open(0, 2)
  for sample in samples:
    scoring.submit(sample)
    a.add(*scoring.scored.get_nowait())
  assert a.counters["void_turn_samples"] == 2
  once = len(calls) // 2
  calls.clear()
  assert submitted == 2 * [graded_text(decode, toks, mask)]
  assert len(calls) == once   # the leader decoded each sample as one graded_text does
