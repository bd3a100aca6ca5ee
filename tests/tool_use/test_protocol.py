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


def test_the_config_refuses_limits_that_cannot_work():
  assert not ToolConfig().enabled
  with pytest.raises(ValueError, match="max_result_tokens >= 8"):
    ToolConfig(max_result_tokens=4)
  with pytest.raises(ValueError, match="cpu_s > 0"):
    ToolConfig(cpu_s=0)
