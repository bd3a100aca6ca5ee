"""Math correctness through math-verify: equivalences that must hold and ones that must not."""
import pytest

from magistral_jax.rewards import RewardConfig, compute_reward
from magistral_jax.rewards.math_check import last_boxed_answer, math_equal


@pytest.mark.parametrize("pred,ref", [
    ("14/3", r"\frac{14}{3}"),
    ("0.5", r"\frac12"),
    (r"\frac{1}{2}", "0.5"),
    (r"\dfrac{3}{4}", "0.75"),
    (r"\{3,2,1\}", r"\{1,2,3\}"),
    ("[1,3)", "[1,3)"),
    (r"(-\infty,2)\cup(3,\infty)", r"(-\infty, 2) \cup (3, \infty)"),
    (r"\begin{pmatrix}1\\2\end{pmatrix}", r"\begin{pmatrix}1\\2\end{pmatrix}"),
    (r"10\text{ cm}", "10"),
    (r"10\%", "0.1"),
    ("1,000,000", "1000000"),
    ("1{,}000", "1000"),
    (r"\$32,348", "32348"),
    (r"\sqrt{18}", r"3\sqrt{2}"),
    ("(x+1)^2", "x^2+2x+1"),
    (r"(3,\pi/2)", r"\left( 3, \frac{\pi}{2} \right)"),
])
def test_equivalent_answers_are_accepted(pred, ref):
  assert math_equal(pred, ref)


@pytest.mark.parametrize("pred,ref", [
    ("6", "5"),
    ("0.33", "1/3"),
    (r"\{1,2\}", r"\{1,2,3\}"),
    ("(1,3]", "[1,3)"),
    (r"\begin{pmatrix}2\\1\end{pmatrix}", r"\begin{pmatrix}1\\2\end{pmatrix}"),
    ("q-p", "p - q"),
    (r"\text{two}", "2"),
    ("", "5"),
])
def test_wrong_answers_are_rejected(pred, ref):
  assert not math_equal(pred, ref)


def test_the_last_box_after_think_is_graded():
  cfg = RewardConfig(language_bonus=0.0)
  task = {"kind": "math", "problem": "p", "answer": "7"}
  assert last_boxed_answer(r"first \boxed{3}, finally \boxed{\frac{14}{2}}") == r"\frac{14}{2}"
  assert compute_reward(task, "<think>\n\\boxed{7}\n</think>\n\\boxed{7} no, \\boxed{8}", None,
                        cfg).parts["correct"] == 0.0
  assert compute_reward(task, "<think>\nx\n</think>\n\\boxed{8} no, \\boxed{7}", None,
                        cfg).parts["correct"] == 0.9
  # No fallback to a bare number: the box is required (format), and its content is graded.
  assert compute_reward(task, "<think>\nx\n</think>\n7 \\boxed{}", None, cfg).parts["correct"] == 0.0
