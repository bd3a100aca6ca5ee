"""The tool protocol (tool_use/protocol.py): what counts as a call, the result block the policy
reads, and the turn checks that guard multi-turn training."""
import pytest

from magistral_jax.tool_use import protocol as P
from magistral_jax.tool_use.config import ToolConfig


@pytest.mark.parametrize("text, source", [
    ("<think>\nLet me compute.\n<tool>\nprint(52 - 17 + 8)\n</tool>", "print(52 - 17 + 8)"),
    ("<tool>print(1)</tool>\n", "print(1)"),
    # A markdown fence around the code is taken off.
    ("<tool>\n```python\nx = 3\nprint(x * x)\n```\n</tool>", "x = 3\nprint(x * x)"),
    # The last call is the pending one; an earlier one with its result is history.
    ("<tool>print(1)</tool>\n<result>\n1\n</result>\n<tool>print(2)</tool>", "print(2)"),
    ("<tool>\n</tool>", ""),
])
def test_a_response_ending_with_a_close_tag_has_a_pending_call(text, source):
  assert P.pending_call(text) == source


@pytest.mark.parametrize("text", [
    "<think>\nno call here", "<tool>print(1)", "print(1)</tool>",
    # A stray close after a finished call: its open was used by the call before.
    "<tool>print(1)</tool>print(2)</tool>",
])
def test_no_pending_call_without_its_own_open_and_close(text):
  assert P.pending_call(text) is None


def test_the_result_block_is_cut_to_its_limit_and_says_so():
  assert P.result_block("43\n", 400) == "\n<result>\n43\n</result>\n"
  block = P.result_block("x" * 1000, 10)
  assert block.startswith("\n<result>\nxxxxxxxxxx\n[output cut to 10 of 1000 characters]")
  assert block.endswith("</result>\n")


def test_calls_turns_and_void_turns():
  text = ("<think>\nFirst <tool>print(2+2)</tool>\n<result>\n4\n</result>\n"
          "so it is 4.\n</think>\n\\boxed{4}")
  assert P.count_calls(text) == 1
  turns = P.policy_turns(text)
  assert turns == ["<think>\nFirst <tool>print(2+2)</tool>\n", "\nso it is 4.\n</think>\n\\boxed{4}"]
  assert not any(P.void_turn(t) for t in turns)
  # A turn after a result with no call and no answer (the model rambles, or stops): void.
  assert P.void_turn("\nhmm, that is strange and")
  assert P.count_calls("<tool>a</tool><tool>b") == 1
  # A trajectory is void when it read a result and one of its turns is: cut off after a result.
  assert not P.void_trajectory(text)
  cut = text[:text.index("so it is")] + "so it is"
  assert P.void_trajectory(cut)
  # A single-turn response is never one, however it ends (the paper trains on those).
  assert not P.void_trajectory("<think>\nhmm, that is strange and")


def test_the_config_refuses_limits_that_cannot_work():
  assert not ToolConfig().enabled
  with pytest.raises(ValueError, match="max_result_tokens >= 8"):
    ToolConfig(max_result_tokens=4)
  with pytest.raises(ValueError, match="cpu_s > 0"):
    ToolConfig(cpu_s=0)


def test_a_transcript_splits_at_its_result_blocks_and_joins_back():
  text = ("<think>\n<tool>\nprint(2+2)\n</tool>" + P.result_block("4\n", 400) + "so 4\n"
          "<tool>\nprint(1)\n</tool>" + P.result_block("1\n", 400) + "</think>\n\\boxed{4}")
  pieces = P.split_results(text)
  assert "".join(p for p, _ in pieces) == text
  assert [r for _, r in pieces] == [False, True, False, True, False]
  assert pieces[1][0] == "\n<result>\n4\n</result>\n"
  assert P.split_results("no calls") == [("no calls", False)]


def test_tool_traces_teach_the_protocol_and_their_results_are_not_targets():
  """The cold start's tool traces (synthetic.tool_trace): a call the parser reads, the result
  the tool really gives for it, the paper's full reward; tokenized for SFT with the result block
  out of the loss."""
  import random

  from magistral_jax.data import synthetic
  from magistral_jax.model.char_tokenizer import char_tokenizer
  from magistral_jax.rewards.config import RewardConfig
  from magistral_jax.rewards.reward import compute_reward
  from magistral_jax.train.sft import sft_collate, sft_pairs_to_tokens
  p = synthetic.make_problem(random.Random(3), max_operand=9)
  t = synthetic.tool_trace(p)
  call = t[:t.index(P.TOOL_CLOSE) + len(P.TOOL_CLOSE)]
  expr = p["problem"][len("Compute "):-1]
  assert P.pending_call(call) == f"print({expr})" and eval(expr) == int(p["answer"])
  r = compute_reward(p, t, 30, RewardConfig(l_max=512, l_cache=128))
  assert r.parts["failed_condition"] is None and r.parts["correct"] > 0
  tok = char_tokenizer()
  (ex,), _ = sft_pairs_to_tokens([(p["problem"], t)], tok, synthetic.TINY_SYSTEM_PROMPT, 512)
  prompt, response, mask = ex
  block = tok.encode(P.result_block(p["answer"] + "\n", 400))
  start = len(tok.encode(call))
  assert response[start:start + len(block)] == block
  assert mask == [True] * start + [False] * len(block) + [True] * (len(response) - start - len(block))
  arrays, placement = sft_collate([ex, (prompt, response)], 512, 2)
  w = arrays["weights"].reshape(-1)
  # The normaliser counts the targets: the tool trace's policy tokens, and all of the other's.
  assert w.sum() == pytest.approx(1.0) and (w > 0).sum() == sum(mask) + len(response)
  # sft_pairs draws the tool traces at their rate.
  pairs = list(zip(range(200), synthetic.sft_pairs(0, tool_rate=0.5, max_operand=9)))
  share = sum(P.TOOL_OPEN in t for _, (_, t) in pairs) / 200
  assert 0.35 < share < 0.65
