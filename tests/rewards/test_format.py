"""Format gate, boxed extraction, length penalty, language consistency, composition."""
import time

import pytest

from magistral_jax.rewards.config import RewardConfig
from magistral_jax.rewards.format import check_format, find_boxed
from magistral_jax.rewards.length import length_penalty
from magistral_jax.rewards.reward import compute_reward
from magistral_jax.rewards import format as fmt
from magistral_jax.rewards.language import detect_language, strip_latex_and_code

MATH = {"kind": "math", "problem": "What is two plus three? Give the number.", "answer": "5"}


@pytest.mark.parametrize("response,kind,failed", [
    ("<think>\nok\n</think>\n\\boxed{5}", "math", None),
    (" <think>\nok\n</think>\n\\boxed{5}", "math", fmt.STARTS_WITH_THINK),
    ("The answer <think>\nok\n</think>\n\\boxed{5}", "math", fmt.STARTS_WITH_THINK),
    ("", "math", fmt.STARTS_WITH_THINK),
    ("<think>\nok\n\\boxed{5}", "math", fmt.ONE_THINK_PAIR),
    ("<think>\n<think>ok</think>\n\\boxed{5}", "math", fmt.ONE_THINK_PAIR),
    ("<think>\nok\n</think></think>\n\\boxed{5}", "math", fmt.ONE_THINK_PAIR),
    ("<think>\n\\boxed{5}\n</think>\nfive", "math", fmt.BOXED_AFTER_THINK),
    ("<think>\nok\n</think>\n\\boxed{5", "math", fmt.BOXED_AFTER_THINK),
    ("<think>\nok\n</think>\n\\fbox{5}", "math", None),
    ("<think>\nok\n</think>\nso $\\boxed 5$", "math", None),
    ("<think>\nok\n</think>\n```python\nprint(1)\n```", "code", None),
    ("<think>\nok\n</think>\n```\nprint(1)\n```", "code", fmt.CODE_BLOCK_AFTER_THINK),
    # At least one tagged block: an untagged one ahead of it does not matter to the format.
    ("<think>\nok\n</think>\n```\nprint(0)\n```\n```python\nprint(1)\n```", "code", None),
    ("<think>\nok\n</think>\n```\nprint(0)\n```\n```\nprint(1)\n```", "code",
     fmt.CODE_BLOCK_AFTER_THINK),
    # A closing fence is not an opening one, whatever follows it on the line.
    ("<think>\nok\n</think>\n```\nprint(0)\n```cpp\nx\n```", "code",
     fmt.CODE_BLOCK_AFTER_THINK),
    ("<think>\n```python\nprint(1)\n```\n</think>\nno code", "code", fmt.CODE_BLOCK_AFTER_THINK),
    # Tool calls (issue #67) inside the reasoning pass; after </think> they do not.
    ("<think>\n<tool>\nprint(2+3)\n</tool>\n<result>\n\n</result>\n</think>\n\\boxed{5}",
     "math", None),
    ("<think>\nok\n</think>\n<tool>\nprint(2+3)\n</tool>\n\\boxed{5}", "math",
     fmt.TOOLS_INSIDE_THINK),
    ("<think>\nok\n</think>\n<result>\n5\n</result>\n\\boxed{5}", "math", fmt.TOOLS_INSIDE_THINK),
])
def test_format_check_reports_the_failed_condition(response, kind, failed):
  res = check_format(response, kind)
  assert res.ok == (failed is None)
  assert res.failed_condition == failed


def test_code_block_scan_stays_linear_on_1mb_answers():
  # Blanks around an optional tag could be matched in ~n^2 ways; each answer takes < 0.5 s linear.
  for answer in ("```" + " " * (1 << 20), "```py" + " \t" * (1 << 19), "``` " * (1 << 18),
                 "```python\n" + "a" * (1 << 20)):
    t = time.time()
    assert not check_format("<think>\nok\n</think>\n" + answer, "code").ok
    assert time.time() - t < 10


def test_find_boxed_handles_nesting_escapes_and_unbalanced_braces():
  assert find_boxed(r"\boxed{\frac{1}{2}} and \boxed{\{1,2\}}") == [r"\frac{1}{2}", r"\{1,2\}"]
  assert find_boxed(r"\boxed 42.") == ["42."]
  assert find_boxed(r"\fbox{x^{2}}") == ["x^{2}"]
  assert find_boxed(r"\boxed{{{{") == []
  assert find_boxed(r"\boxedx{3}") == []


def test_length_penalty_follows_the_dapo_formula():
  l_max, l_cache = 1000, 200
  assert length_penalty(0, l_max, l_cache) == 0.0
  assert length_penalty(800, l_max, l_cache) == 0.0
  assert length_penalty(900, l_max, l_cache) == pytest.approx(-0.05)
  assert length_penalty(1000, l_max, l_cache) == pytest.approx(-0.1)
  assert length_penalty(5000, l_max, l_cache) == pytest.approx(-0.1)
  assert length_penalty(1001, l_max, 0) == -0.1 and length_penalty(1000, l_max, 0) == 0.0
  with pytest.raises(ValueError, match="l_cache"):
    length_penalty(10, 100, 200)


def test_language_detection_ignores_latex_and_code():
  assert strip_latex_and_code(r"Soit $x^2$ et \(y\) ```py\nprint(1)\n``` fin \boxed{3}") == "Soit et fin"
  assert detect_language("Quelle est la somme de deux et trois ? Donnez le nombre exact.") == "fr"
  assert detect_language(r"$x^2 + 1$ \boxed{5}") is None


def test_reward_composition_and_parts():
  cfg = RewardConfig(l_max=1000, l_cache=200)
  good = "<think>\nTwo plus three equals five, so the answer is five.\n</think>\nThe answer is \\boxed{5}."
  r = compute_reward(MATH, good, 100, cfg)
  assert r.error is None
  assert r.parts == dict(format=0.1, correct=0.9, language=0.1, length_penalty=0.0,
                         failed_condition=None)
  assert r.reward == pytest.approx(1.1)
  # Overlong: the penalty is added; wrong answer keeps only the format reward.
  assert compute_reward(MATH, good, 900, cfg).reward == pytest.approx(1.05)
  assert compute_reward({**MATH, "max_tokens": 500}, good, 900, cfg).reward == pytest.approx(1.0)
  wrong = compute_reward(MATH, good.replace("{5}", "{6}"), 100, cfg)
  assert wrong.parts["correct"] == 0.0 and wrong.reward == pytest.approx(0.2)
  # Thoughts in French, problem in English: no language bonus.
  fr = ("<think>\nDeux plus trois font cinq, donc la réponse est cinq.\n</think>\n"
        "La réponse est \\boxed{5}.")
  r = compute_reward(MATH, fr, 100, cfg)
  assert r.parts["language"] == 0.0 and r.info["languages"][1] == "fr"
  # Format failure: everything is zero, even with a correct box.
  r = compute_reward(MATH, "\\boxed{5}", 100, cfg)
  assert r.reward == 0.0 and r.parts["failed_condition"] == fmt.STARTS_WITH_THINK


def test_bad_tasks_give_reward_zero_with_an_error():
  cfg = RewardConfig()
  r = compute_reward({"kind": "poem", "problem": "x"}, "<think>a</think>b", None, cfg)
  assert r.reward == 0.0 and "kind" in r.error
  r = compute_reward({"kind": "math", "problem": "x"}, "<think>a</think>\\boxed{1}", None, cfg)
  assert r.reward == 0.0 and "answer" in r.error
  r = compute_reward({"kind": "code", "problem": "x", "language": "cobol", "tests": []},
                     "<think>a</think>\n```cobol\nX\n```", None, cfg)
  assert r.reward == 0.0 and "language" in r.error
