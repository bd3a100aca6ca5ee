"""One-process semantics of the function-call harness, tested differentially (issue #64): a corpus
of honest and buggy programs for function tasks, each judged by a plain one-process runner (the
reference: the solution and the tests in one interpreter, with the task format's one rule, that
a StopIteration or BaseException from the solution fails it rather than end the test's
iteration) and by the sandboxed harness (rewards/code_asserts.py). The verdicts must agree, both
ways; where the task format rules a case out, the harness must refuse it (UnsupportedTask), never
give a verdict of its own."""
import json
import subprocess
import sys

import pytest

from magistral_jax.rewards import code_asserts
from magistral_jax.rewards.code_check import default_python
from magistral_jax.rewards.sandbox_limits import Limits

# The reference: one interpreter, the solution a real module, each test statement run in turn.
_REFERENCE = r"""
import json, sys, types
spec = json.loads(sys.stdin.read())
mod = types.ModuleType("solution")
sys.modules["solution"] = mod
failed = []
try:
  exec(compile(spec["solution"], "solution.py", "exec"), mod.__dict__)
except Exception as e:
  failed.append(e)
class Sticky(Exception):
  pass
def wrap(f):
  def call(*a, **k):
    try:
      return f(*a, **k)
    except Exception as e:
      if not isinstance(e, (StopIteration, StopAsyncIteration)):
        raise
      failed.append(e)
      raise Sticky(repr(e))
    except BaseException as e:
      failed.append(e)
      raise Sticky(repr(e))
  return call
ns = {"__name__": "tests"}
for k, v in list(mod.__dict__.items()):
  if callable(v) and not k.startswith("__"):
    ns[k] = wrap(v)
for stmt in spec["tests"]:
  try:
    exec(stmt, ns)
  except Exception as e:
    failed.append(e)
print("PASS" if not failed else "FAIL")
"""


def reference(solution: str, tests: list[str]) -> bool:
  r = subprocess.run([sys.executable, "-I", "-c", _REFERENCE], capture_output=True, timeout=60,
                     input=json.dumps({"solution": solution, "tests": tests}).encode())
  assert r.returncode == 0, r.stderr.decode()[-1000:]
  return r.stdout.strip() == b"PASS"


ALIAS_TESTS = ["a = [3, 1, 2]", "assert f(a) is a", "assert a == [1, 2, 3]"]
EXPECTED_RAISE = ["assert root(4) == 2.0",
                  "try:\n  root(-1)\n  ok = False\nexcept ValueError:\n  ok = True", "assert ok"]
GEN_TESTS = ["assert list(gen(4)) == [0, 1, 4, 9]", "g = gen(3)", "assert next(g) == 0",
             "assert sum(g) == 5"]
BIG = ["assert big() == 3 ** 12000", "assert big() % 7 == pow(3, 12000, 7)"]

# (name, solution, test statements, the verdict a plain one-process run gives)
CORPUS = [
    ("alias_within_call", "def f(x):\n  x.sort()\n  return x", ALIAS_TESTS, True),
    ("alias_claimed_by_a_copy", "def f(x):\n  return sorted(x)", ALIAS_TESTS, False),
    ("result_is_part_of_an_argument", "def first(xs):\n  return xs[0]",
     ["xs = [[1], [2]]", "r = first(xs)", "r.append(9)", "assert xs[0] == [1, 9]",
      "assert r is xs[0]"], True),
    ("result_part_of_an_argument_where_a_copy_is_due", "def first(xs):\n  return xs[0]",
     ["xs = [[1], [2]]", "r = first(xs)", "r.append(9)", "assert xs == [[1], [2]]"], False),
    ("result_holds_part_of_an_argument", "def pick(d):\n  return [d['a'], 5]",
     ["d = {'a': [1]}", "r = pick(d)", "r[0].append(2)", "assert d == {'a': [1, 2]}"], True),
    ("result_changed_after_it_is_taken", "def take(xs):\n  y = xs[0]\n  xs.clear()\n"
     "  y.append(7)\n  return y",
     ["inner = [1]", "xs = [inner]", "assert take(xs) is inner", "assert inner == [1, 7]",
      "assert xs == []"], True),
    ("expected_exception", "def root(x):\n  if x < 0:\n    raise ValueError('negative')\n"
     "  return x ** 0.5", EXPECTED_RAISE, True),
    ("expected_exception_missing", "def root(x):\n  return abs(x) ** 0.5", EXPECTED_RAISE,
     False),
    ("unexpected_exception", "def root(x):\n  raise KeyError(x)", EXPECTED_RAISE, False),
    ("stop_iteration_cannot_end_the_tests_iteration", "def f(x):\n  raise StopIteration",
     ["assert all(map(f, [1, 2, 3]))"], False),
    ("system_exit_fails", "def f(x):\n  raise SystemExit(0)",
     ["try:\n  f(1)\nexcept BaseException:\n  pass", "assert True"], False),
    ("counter_result", "from collections import Counter\ndef count(s):\n  return Counter(s)",
     ["assert count('abca') == {'a': 2, 'b': 1, 'c': 1}", "assert count('ab')['z'] == 0",
      "assert count('aab').most_common(1) == [('a', 2)]"], True),
    ("dict_where_a_counter_is_due", "def count(s):\n  return {c: s.count(c) for c in s}",
     ["assert count('abca') == {'a': 2, 'b': 1, 'c': 1}", "assert count('ab')['z'] == 0"],
     False),
    ("defaultdict_result", "from collections import defaultdict\ndef group(xs):\n"
     "  d = defaultdict(list)\n  for x in xs:\n    d[x % 2].append(x)\n  return d",
     ["g = group([1, 2, 3])", "assert g[1] == [1, 3]", "assert g[5] == []"], True),
    ("counter_argument", "def total(c):\n  return sum(c.values())",
     ["from collections import Counter", "assert total(Counter('abca')) == 4"], True),
    ("generator_result", "def gen(n):\n  for i in range(n):\n    yield i * i", GEN_TESTS, True),
    ("generator_one_short", "def gen(n):\n  for i in range(n - 1):\n    yield i * i", GEN_TESTS,
     False),
    ("infinite_iterator_result", "import itertools\ndef naturals():\n  return itertools.count()",
     ["import itertools", "assert list(itertools.islice(naturals(), 3)) == [0, 1, 2]"], True),
    ("nested_150_deep", "def nest(n):\n  x = []\n  for _ in range(n):\n    x = [x]\n  return x",
     ["r = nest(150)", "d = 0\nwhile r:\n  r = r[0]\n  d += 1", "assert d == 150"], True),
    ("big_int_result", "def big():\n  return 3 ** 12000", BIG, True),
    ("big_int_result_off_by_one", "def big():\n  return 3 ** 12000 + 1", BIG, False),
    ("big_int_argument", "def half(x):\n  return x // 2",
     ["assert half(2 * 7 ** 6800) == 7 ** 6800"], True),
    ("same_object_from_two_calls", "_c = []\ndef get():\n  return _c",
     ["a = get()", "a.append(1)", "assert get() == []"], False),
    ("cache_returned_and_changed_by_the_tests", "_c = {}\ndef table():\n  return _c\n"
     "def size():\n  return len(_c)", ["t = table()", "t['k'] = 1", "assert size() == 1",
                                        "assert table() is t"], True),
    ("argument_kept_and_changed_later", "_k = []\ndef keep(x):\n  _k.append(x)\n"
     "def total():\n  return sum(map(len, _k))",
     ["a = [1]", "keep(a)", "a.append(2)", "assert total() == 2"], True),
    ("argument_kept_and_changed_by_a_later_call", "_k = []\ndef keep(x):\n  _k.append(x)\n"
     "def grow():\n  _k[0].append(0)",
     ["a = [1]", "keep(a)", "grow()", "assert a == [1, 0]"], True),
    ("argument_kept_where_a_copy_is_due", "_k = []\ndef keep(x):\n  _k.append(x)\n"
     "def total():\n  return sum(map(len, _k))",
     ["a = [1]", "keep(a)", "a.append(2)", "assert total() == 1"], False),
    ("callable_result", "def adder(n):\n  return lambda x: x + n",
     ["assert adder(2)(3) == 5", "assert list(map(adder(1), [1, 2])) == [2, 3]"], True),
    ("callable_result_wrong", "def adder(n):\n  return lambda x: x - n",
     ["assert adder(2)(3) == 5"], False),
    ("multiprocessing_pool", "from multiprocessing import Pool\ndef sq(x):\n  return x * x\n"
     "def squares(xs):\n  with Pool(2) as p:\n    return p.map(sq, xs)",
     ["assert squares([1, 2, 3]) == [1, 4, 9]"], True),
]

# What the task format rules out (the tests' own doing): the harness refuses, never judges.
REFUSED = [
    ("callable_argument", "def apply(f, x):\n  return f(x)",
     ["assert apply(lambda v: v * 2, 3) == 6"]),
    ("callable_argument_caught_by_the_tests", "def apply(f, x):\n  return f(x)",
     ["try:\n  apply(len, 3)\nexcept Exception:\n  pass", "assert True"]),
]


@pytest.fixture(scope="module")
def sbx():
  from magistral_jax.rewards import sandbox
  s = sandbox.Sandbox(uid=sandbox.process_uid_base() + 240)
  if s.isolation not in sandbox.PRIVATE_FS:
    pytest.skip("no private-filesystem sandbox here")
  return s


def sandboxed(sbx, solution: str, tests: list[str]):
  d = sbx.make_dir()
  try:
    return code_asserts.run_assert_tests(sbx, d, default_python(), solution,
                                         "\n".join(tests) + "\n", None, Limits(cpu_s=4.0))
  finally:
    sbx.remove_dir(d)


@pytest.mark.parametrize("name,solution,tests,verdict", CORPUS, ids=[c[0] for c in CORPUS])
def test_the_harness_agrees_with_one_process(sbx, name, solution, tests, verdict):
  assert reference(solution, tests) == verdict, "the corpus's verdict is not one process's"
  res = sandboxed(sbx, solution, tests)
  assert res.passed == verdict, res


@pytest.mark.parametrize("name,solution,tests", REFUSED, ids=[c[0] for c in REFUSED])
def test_what_the_task_format_rules_out_is_refused(sbx, name, solution, tests):
  with pytest.raises(code_asserts.UnsupportedTask, match="cannot send"):
    sandboxed(sbx, solution, tests)
