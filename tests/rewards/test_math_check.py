"""Math correctness through math-verify: equivalences that must hold and ones that must not."""
import pytest

from magistral_jax.rewards.config import RewardConfig
from magistral_jax.rewards.reward import compute_reward
from magistral_jax.rewards import math_check
from magistral_jax.rewards.math_check import (has_variable, last_boxed_answer, math_equal,
                                              parse_reference, relation_sides)


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
    (r"284\%", "284"),    # the datasets write a percent answer without its sign
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
    ("284", "2.84"),      # a bare number is never read as a percent
    (r"28\%", "284"),
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


@pytest.mark.parametrize("pred,ref,ok", [
    # A box of two numbers is a hedge: math-verify alone read only the right-hand side.
    ("1000 = 284", "284", False),
    ("284 = 1000", "284", False),
    ("1000 == 284", "284", False),
    (r"\pi = 3", "3", False),
    (r"\frac{\pi}{2} = 1", "1", False),
    ("x = 5", "6", False),
    ("x = y", "5", False),            # nothing variable-free to check against a number
    ("x = 4 = 5", "5", False),
    ("a = b = c = d = 5", "5", False),  # more sides than an answer has
    (r"x = 3 \text{ or } x = 5", "5", False),   # math-verify's own reading must pass too
    # Names on one side, the value on the other; every variable-free side equals the reference.
    ("x = 5", "5", True),
    ("n=12", "12", True),
    ("2+3 = 5", "5", True),
    ("5 = 5", "5", True),
    ("a = b = 5", "5", True),
    ("f(x) = 5", "5", True),
    (r"\theta = 30", "30", True),
    (r"x = \frac{1}{2}", "0.5", True),
    (r"\frac12 = 0.5", "0.5", True),
    (r"2\pi = 2\pi", r"2\pi", True),
    (r"10\text{ cm} = 10", "10", True),
    (r"50\% = 0.5", "0.5", True),
    (r"\sqrt{4} \cdot 3 = 6", "6", True),
    # A reference with a variable and no variable-free side: graded as before.
    ("f(x) = x^2+1", "x^2+1", True),
    # A reference that is itself an equation: graded as before.
    ("y=2x+3", "y=2x+3", True),
    ("y = 2x + 3", "y=2x+3", True),
    ("y=2x+4", "y=2x+3", False),
    # Not a top-level `=`: relations and `=` inside groups are left to math-verify.
    (r"x \leq 5", "5", False),
    (r"x \le 5", r"x \le 5", True),
])
def test_a_boxed_relation_is_graded_by_every_variable_free_side(pred, ref, ok):
  assert math_equal(pred, ref) is ok


def test_a_hedged_equation_earns_no_correctness_reward():
  cfg = RewardConfig(language_bonus=0.0)
  task = {"kind": "math", "problem": "p", "answer": "284"}
  grade = lambda box: compute_reward(task, "<think>\nx\n</think>\n\\boxed{" + box + "}", None,
                                     cfg).parts["correct"]
  assert grade("1000 = 284") == 0.0
  assert grade("n = 284") == 0.9 and grade("284") == 0.9


@pytest.mark.parametrize("expr,sides", [
    ("5", ["5"]),
    ("x = 5", ["x ", " 5"]),
    ("1000 == 284", ["1000 ", " 284"]),
    ("a<=b", ["a<=b"]), ("a>=b", ["a>=b"]), ("a!=b", ["a!=b"]), ("a:=5", ["a:=5"]),
    (r"x \leq 5", [r"x \leq 5"]), (r"x \neq 5", [r"x \neq 5"]), (r"x \not= 5", [r"x \not= 5"]),
    (r"\{x=1\} = f(y=2) = [z=3)", [r"\{x=1\} ", " f(y=2) ", " [z=3)"]),
    (r"\text{a=b}", [r"\text{a=b}"]),
])
def test_relation_sides_split_only_at_top_level_equals(expr, sides):
  assert relation_sides(expr) == sides


@pytest.mark.parametrize("expr,var", [
    ("5", False), (r"\frac{14}{3}", False), (r"\dfrac{3}{4}", False), (r"\sqrt{2}\cdot 3", False),
    (r"2 \times \pi", False), (r"\left(3, \frac{\pi}{2}\right)", False), (r"10\text{ cm}", False),
    (r"10\,\mathrm{m}^2", False), (r"10\%", False), (r"\sin(\pi/6)", False), (r"30^\circ", False),
    (r"\operatorname{lcm}(4, 6)", False), (r"\infty", False),
    ("x", True), ("2x+3", True), ("f(2)", True), (r"\theta", True), (r"\frac{a}{2}", True),
    (r"\sqrt{n}", True), (r"\mathbf{v}", True), (r"\Omega", True),
])
def test_has_variable_sets_latex_commands_and_units_aside(expr, var):
  assert has_variable(expr) is var


@pytest.mark.parametrize("pred,ref", [
    ("14/3", r"\frac{14}{3}"), ("0.5", r"\frac12"), (r"\frac12", "0.5"), (r"\frac{270}7", "270/7"),
    (r"10\text{ cm}", "10"), (r"10\%", "0.1"), ("25%", "0.25"), ("1,000", "1000"), ("6", "5"),
    (r"\frac{1}{3}", "0.33"), (r"x \in [1, 3)", "[1,3)"), ("x^2+2x+1", "(x+1)^2"),
])
def test_answers_without_a_relation_are_graded_as_math_verify_grades_them(pred, ref):
  from math_verify import parse, verify
  latex_cfg, _ = math_check._configs()
  raw = parse("\\boxed{" + math_check._normalise(pred) + "}", latex_cfg,
              fallback_mode="no_fallback")
  assert math_equal(pred, ref) == bool(raw and verify(list(parse_reference(ref)), raw))
