"""Code correctness: HumanEval, MBPP, C++ stdin tasks, test drawing and output comparison."""
import json
import os
import random

import pytest

import magistral_jax
from magistral_jax.rewards.config import RewardConfig
from magistral_jax.rewards.reward import compute_reward
from magistral_jax.rewards.code_check import draw_tests, extract_code_block
from magistral_jax.rewards.code_stdio import outputs_match

SOURCES = os.path.join(os.path.dirname(magistral_jax.__file__), "data", "sources")
CFG = RewardConfig(language_bonus=0.0)

# Wraps the entry point so that every return value is off by a little: a plausible wrong answer.
MUTATION = '''
_orig_{e} = {e}
def {e}(*a, **k):
  r = _orig_{e}(*a, **k)
  if isinstance(r, bool): return not r
  if isinstance(r, (int, float)): return r + 1
  if isinstance(r, str): return r + "x"
  if isinstance(r, (list, tuple)): return type(r)(list(r) + [0])
  return "mutated"
'''


def _load(name):
  with open(os.path.join(SOURCES, name)) as f:
    return [json.loads(l) for l in f]


def _answer(code, lang="python"):
  return f"<think>\nI will write the program.\n</think>\nHere it is:\n```{lang}\n{code}\n```\n"


def _humaneval_task(p):
  return {"kind": "code", "problem": p["prompt"], "language": "python", "test_code": p["test"],
          "entry_point": p["entry_point"]}


HUMANEVAL = _load("humaneval_full.jsonl")


def test_all_humaneval_canonical_solutions_pass():
  failed = []
  for p in HUMANEVAL:
    r = compute_reward(_humaneval_task(p), _answer(p["prompt"] + p["canonical_solution"]), None, CFG)
    if r.reward != pytest.approx(1.0):
      failed.append((p["task_id"], r.error, r.info.get("code")))
  assert not failed


def _processes_of_uid(uid):
  found = []
  for d in os.listdir("/proc"):
    try:
      with open(f"/proc/{d}/status") as f:
        fields = dict(l.split(":", 1) for l in f if ":" in l)
    except (OSError, ValueError):
      continue
    if int(fields["Uid"].split()[0]) == uid:
      found.append((d, fields["State"].strip()))
  return found


def test_functional_calls_leave_no_process_of_the_sandbox_uid():
  """Each functional test's driver is killed when its calls are done; the namespace's first
  process must be reaped then, not left as a zombie of the slot uid (zombies count against its
  RLIMIT_NPROC: 29 of them once made the next C++ compile fail with EAGAIN)."""
  from magistral_jax.rewards import sandbox
  if "uid" not in sandbox.isolation_level():
    pytest.skip("the program runs under our own uid here")
  for p in HUMANEVAL[:20]:
    r = compute_reward(_humaneval_task(p), _answer(p["prompt"] + p["canonical_solution"]), None, CFG)
    assert r.reward == pytest.approx(1.0)
  uid = sandbox.DEFAULT_UID_BASE + os.getpid() % 5000
  assert _processes_of_uid(uid) == []


def test_mutated_humaneval_solutions_fail():
  sample = random.Random(0).sample(HUMANEVAL, 30)
  passed = []
  for p in sample:
    code = p["prompt"] + p["canonical_solution"] + MUTATION.format(e=p["entry_point"])
    r = compute_reward(_humaneval_task(p), _answer(code), None, CFG)
    if r.parts["correct"] != 0.0:
      passed.append(p["task_id"])
  assert not passed


def test_mbpp_sample_passes_and_wrong_code_fails():
  rows = _load("mbpp_sample20.jsonl")
  failed = []
  for p in rows:
    task = {"kind": "code", "problem": p["text"], "language": "python",
            "test_list": p["test_list"], "test_setup_code": p["test_setup_code"]}
    r = compute_reward(task, _answer(p["code"]), None, CFG)
    if r.reward != pytest.approx(1.0):
      failed.append((p["task_id"], r.info))
  assert not failed
  p = rows[0]
  bad = {"kind": "code", "problem": p["text"], "language": "python", "test_list": p["test_list"]}
  assert compute_reward(bad, _answer("def remove_Occ(s, ch):\n  return s"), None,
                        CFG).parts["correct"] == 0.0


CPP_SUM = """#include <bits/stdc++.h>
using namespace std;
int main() { long long n, s = 0, x; cin >> n; for (int i = 0; i < n; ++i) { cin >> x; s += x; }
  cout << s << "\\n" << fixed << setprecision(9) << (double)s / n << endl; }
"""


def _sum_task(n_tests=30):
  rng = random.Random(1)
  tests = []
  for _ in range(n_tests):
    xs = [rng.randint(-1000, 1000) for _ in range(rng.randint(1, 8))]
    # Expected mean printed with fewer digits: the task's numeric tolerance must accept it.
    tests.append({"input": f"{len(xs)}\n{' '.join(map(str, xs))}\n",
                  "output": f"{sum(xs)}\n{sum(xs) / len(xs):.7f}\n"})
  return {"kind": "code", "problem": "Print the sum and the mean (error at most 1e-6).",
          "language": "cpp", "tests": tests, "tolerance": 1e-6}


def test_cpp_stdin_problem_passes_and_wrong_answer_fails():
  task = _sum_task()
  r = compute_reward(task, _answer(CPP_SUM, "cpp"), None, CFG)
  assert r.error is None and r.parts["correct"] == 0.9, r.info
  wrong = CPP_SUM.replace("s += x", "s += x + (x == 7)")   # wrong only on some inputs
  task["tests"].append({"input": "1\n7\n", "output": "7\n7.0\n"})
  r = compute_reward({**task, "tests": task["tests"][-3:]}, _answer(wrong, "cpp"), None, CFG)
  assert r.parts["correct"] == 0.0 and "wrong answer" in r.info["code"]
  r = compute_reward(task, _answer("int main( {", "cpp"), None, CFG)
  assert r.parts["correct"] == 0.0 and "compile error" in r.info["code"]
  # A Python block for a C++ task is graded as wrong, not run.
  r = compute_reward(task, _answer("print(1)", "python"), None, CFG)
  assert r.parts["correct"] == 0.0 and "language" in r.info["code"]


def test_python_stdin_problem_uses_token_comparison():
  task = {"kind": "code", "problem": "Double it.", "language": "python",
          "tests": [{"input": f"{i}\n", "output": f"{2 * i}\n"} for i in range(5)]}
  assert compute_reward(task, _answer("print(2 * int(input()), end='  \\n\\n')"), None,
                        CFG).parts["correct"] == 0.9
  assert compute_reward(task, _answer("print(2 * int(input()) + 1)"), None,
                        CFG).parts["correct"] == 0.0


def test_the_same_tests_are_drawn_for_a_whole_group():
  a = draw_tests(100, 20, group_seed=7)
  assert a == draw_tests(100, 20, group_seed=7) and len(set(a)) == 20
  assert a != draw_tests(100, 20, group_seed=8)
  assert draw_tests(5, 20, group_seed=7) == [0, 1, 2, 3, 4]


def test_outputs_match_tokens_exactly_and_numbers_within_a_tolerance_only_where_asked():
  assert outputs_match("YES", "YES\n")
  assert outputs_match("1  2\n3\n", "1 2 3")
  assert not outputs_match("1 2", "1 2 3")
  assert not outputs_match("yes", "YES")
  # Exact by default: a float printed with less precision than asked, or more, is wrong.
  assert not outputs_match("3.0000001", "3.0")
  assert not outputs_match("0.33", "0.333333")
  # With the task's tolerance (absolute or relative), non-integer numbers match within it ...
  assert outputs_match("1 2\n3.0000001\n", "1 2 3.0", tolerance=1e-6)
  assert outputs_match("12345678901.5", "12345678901.0", tolerance=1e-6)
  assert not outputs_match("0.33", "0.333333", tolerance=1e-6)
  assert not outputs_match("nan", "1.5", tolerance=1e-6)
  # ... and integers stay exact at any size: a modular answer plus one, or off by 1,000 in 1e10.
  assert not outputs_match("1000000008", "1000000007", tolerance=1e-6)
  assert not outputs_match("10000001000", "10000000000", tolerance=1e-6)
  assert not outputs_match("3.0000001", "3", tolerance=1e-6)


def test_first_code_block_is_taken():
  assert extract_code_block("```c++\nint main(){}\n```\n```python\nx\n```") == ("cpp", "int main(){}\n")
  assert extract_code_block("no code") is None
  # Untagged blocks count: the first block is the first one, in the task's language.
  answer = "```\nprint(0)\n```\nthen\n```python\nx\n```"
  assert extract_code_block(answer, "python") == ("python", "print(0)\n")
  assert extract_code_block(answer) == (None, "print(0)\n")
  assert extract_code_block("```text\n3 4\n```\n```python\nx\n```") == (None, "3 4\n")


DOUBLE = {"kind": "code", "problem": "Double it.", "language": "python",
          "tests": [{"input": f"{i}\n", "output": f"{2 * i}\n"} for i in range(5)]}
RIGHT, WRONG = "print(2 * int(input()))", "print(0)"


def _blocks(*blocks):
  return "<think>\nI will write the program.\n</think>\n" + "\nor\n".join(
      f"```{tag}\n{code}\n```" for tag, code in blocks) + "\n"


def test_an_untagged_first_block_is_graded_not_a_later_tagged_one():
  # The example: an untagged print(0) ahead of a correct tagged block scored 1.0.
  r = compute_reward(DOUBLE, _blocks(("", WRONG), ("python", RIGHT)), None, CFG)
  assert r.parts["format"] == 0.1 and r.parts["correct"] == 0.0, r.info
  assert "wrong answer" in r.info["code"]
  # An untagged first block runs in the task's language, and passes if it solves the task.
  r = compute_reward(DOUBLE, _blocks(("", RIGHT), ("python", WRONG)), None, CFG)
  assert r.parts["correct"] == 0.9, r.info


def test_the_first_block_is_graded_even_when_a_later_one_is_correct():
  r = compute_reward(DOUBLE, _blocks(("python", WRONG), ("python", RIGHT)), None, CFG)
  assert r.parts["format"] == 0.1 and r.parts["correct"] == 0.0, r.info
  # A first block in another language (or none we run) is graded as wrong, not skipped.
  for tag in ("cpp", "text"):
    r = compute_reward(DOUBLE, _blocks((tag, WRONG), ("python", RIGHT)), None, CFG)
    assert r.parts["correct"] == 0.0 and "language" in r.info["code"], (tag, r.info)
  r = compute_reward(DOUBLE, _blocks(("python", RIGHT), ("python", WRONG)), None, CFG)
  assert r.parts["correct"] == 0.9, r.info
