"""Code tasks with a known verdict, for bench/sandbox_soak.py: correct and wrong programs of every
task shape the verifier sees (HumanEval functional tests from the shipped humaneval_full.jsonl,
MBPP assert lists from mbpp_sample20.jsonl, Python and C++ stdin/stdout problems), each first run
bare (plain subprocesses, no sandbox) to confirm its verdict, and the hostile programs of
hostile_programs.py put into the same task shapes; `build_mix` draws a seeded mix of the three.
A correct program must get the pass reward; a wrong or hostile one must not (`verdict_ok`).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import random
import re
import shutil
import subprocess
import tempfile

from hostile_programs import ATTACKS, PROJECT, SECRET

from magistral_jax.rewards import code_check
from magistral_jax.rewards.code_cpp import CXX_FLAGS, precompiled_header_dir
from magistral_jax.rewards.code_stdio import outputs_match, task_tolerance
from magistral_jax.rewards.config import RewardConfig
from magistral_jax.rewards.humaneval import prompt_helpers

SOURCES = os.path.join(PROJECT, "magistral_jax", "data", "sources")
PYTHON = code_check.default_python()


def code_response(src: str, lang: str = "python") -> str:
  """A policy's response whose code block is `src`."""
  return f"<think>\nHere goes.\n</think>\n```{lang}\n{src}\n```\n"


def _jsonl(name):
  with open(os.path.join(SOURCES, name)) as f:
    return [json.loads(l) for l in f]


@dataclasses.dataclass
class Item:
  """One task with a known verdict."""
  category: str              # correct / wrong / hostile
  shape: str                 # humaneval / mbpp / stdin_py / stdin_cpp
  name: str                  # problem and variant
  task: dict
  src: str
  lang: str = "python"

  @property
  def expect_pass(self) -> bool:
    return self.category == "correct"


# ---- stdin/stdout problems --------------------------------------------------------------------

def _t_sum(r):
  a = [r.randint(-1000, 1000) for _ in range(r.randint(2, 30))]
  a[-1] = r.choice([-1, 1]) * r.randint(1, 1000)          # so dropping the last one is wrong
  return f"{len(a)}\n{' '.join(map(str, a))}\n", f"{sum(a)}\n"


def _t_maxdistinct(r):
  a = [r.randint(-50, 50) for _ in range(r.randint(3, 40))]
  a[0], a[1] = -60, 60                                     # min != max
  return f"{len(a)}\n{' '.join(map(str, a))}\n", f"{max(a)} {len(set(a))}\n"


def _t_reverse(r):
  words = ["".join(r.choice("abcdefgh") for _ in range(r.randint(2, 6)))
           for _ in range(r.randint(3, 8))]
  words[0], words[-1] = "start", "end"
  return " ".join(words) + "\n", " ".join(reversed(words)) + "\n"


def _t_fib(r):
  n = r.randint(5, 5000)
  a, b = 0, 1
  for _ in range(n):
    a, b = b, (a + b) % 1000000007
  return f"{n}\n", f"{a}\n"


STDIN_PROBLEMS = {
  "sum": (_t_sum, {
    ("python", True): "import sys\nd = sys.stdin.read().split()\nn = int(d[0])\n"
                      "print(sum(map(int, d[1:1 + n])))",
    ("python", False): "import sys\nd = sys.stdin.read().split()\nn = int(d[0])\n"
                       "print(sum(map(int, d[1:n])))",
    ("cpp", True): "#include <bits/stdc++.h>\nint main() { long long n, s = 0, x; std::cin >> n;\n"
                   "  for (int i = 0; i < n; i++) { std::cin >> x; s += x; }\n"
                   "  std::cout << s << std::endl; }",
    ("cpp", False): "#include <bits/stdc++.h>\nint main() { long long n, s = 0, x; std::cin >> n;\n"
                    "  for (int i = 0; i < n; i++) { std::cin >> x; if (i + 1 < n) s += x; }\n"
                    "  std::cout << s << std::endl; }"}),
  "maxdistinct": (_t_maxdistinct, {
    ("python", True): "n = int(input())\na = list(map(int, input().split()))\n"
                      "print(max(a), len(set(a)))",
    ("python", False): "n = int(input())\na = list(map(int, input().split()))\n"
                       "print(min(a), len(set(a)))",
    ("cpp", True): "#include <bits/stdc++.h>\nusing namespace std;\nint main() { int n; cin >> n;\n"
                   "  vector<long long> a(n); for (auto &x : a) cin >> x; sort(a.begin(), a.end());\n"
                   "  set<long long> c(a.begin(), a.end()); cout << a.back() << ' ' << c.size() << endl; }",
    ("cpp", False): "#include <bits/stdc++.h>\nusing namespace std;\nint main() { int n; cin >> n;\n"
                    "  vector<long long> a(n); for (auto &x : a) cin >> x; sort(a.begin(), a.end());\n"
                    "  cout << a.back() << ' ' << a.size() << endl; }"}),
  "reverse": (_t_reverse, {
    ("python", True): "print(' '.join(reversed(input().split())))",
    ("python", False): "print(input()[::-1])"}),
  "fib": (_t_fib, {
    ("python", True): "n = int(input())\na, b = 0, 1\nfor _ in range(n):\n"
                      "  a, b = b, (a + b) % 1000000007\nprint(a)",
    ("python", False): "n = int(input())\na, b = 0, 1\nfor _ in range(n - 1):\n"
                       "  a, b = b, (a + b) % 1000000007\nprint(a)"}),
}
INSTANCES = 8        # distinct test sets per stdin problem


@functools.lru_cache(maxsize=None)
def stdin_tests(problem: str, instance: int) -> tuple:
  gen = STDIN_PROBLEMS[problem][0]
  r = random.Random(f"{problem}/{instance}")
  return tuple(gen(r) for _ in range(3))


def stdin_task(problem, instance, lang, tests=None):
  tests = tests if tests is not None else stdin_tests(problem, instance)
  return {"kind": "code", "problem": f"stdin problem {problem}", "language": lang,
          "tests": [{"input": i, "output": o} for i, o in tests]}


def _humaneval_task(row: dict) -> dict:
  return {"kind": "code", "problem": row["prompt"], "language": "python",
          "test_code": row["test"], "entry_point": row["entry_point"]}


def _mbpp_task(row: dict) -> dict:
  return {"kind": "code", "problem": row["text"], "language": "python",
          "test_list": row["test_list"], "test_setup_code": row.get("test_setup_code") or ""}


# ---- functional-test problems ----------------------------------------------------------------

_MUTATIONS = [("return ", "return not "), (" + 1", " + 2"), (" - 1", " - 2"), ("<=", "<"),
              (">=", ">"), (" < ", " <= "), (" > ", " >= "), ("==", "!="), ("[0]", "[-1]")]


def _mutants(code: str, entry: str | None) -> list[tuple[str, str]]:
  """Wrong variants of a correct program, most natural first: one-token mutations, then stubs."""
  out = [(f"mut{k}", code.replace(a, b, 1)) for k, (a, b) in enumerate(_MUTATIONS) if a in code]
  if entry:
    out += [("stub_none", code + f"\n\ndef {entry}(*args, **kwargs):\n    return None\n"),
            ("stub_raise", code + f"\n\ndef {entry}(*args, **kwargs):\n    raise NotImplementedError\n")]
  return out


class Catalog:
  """Correct and wrong programs for every shape, each confirmed by a bare run (cached)."""

  def __init__(self, bare_dir: str):
    self.bare_dir = bare_dir
    self.humaneval = _jsonl("humaneval_full.jsonl")
    self.mbpp = _jsonl("mbpp_sample20.jsonl")
    self.dropped: list[str] = []
    self._ok: dict = {}

  def _confirm(self, item: Item) -> bool:
    key = (item.shape, item.name, item.src)
    if key not in self._ok:
      self._ok[key] = bare_run(item, self.bare_dir) == item.expect_pass
    return self._ok[key]

  def benign(self, r: random.Random, category: str, shape: str) -> Item:
    for _ in range(50):
      item = self._draw(r, category, shape)
      if item is not None and self._confirm(item):
        return item
      if item is not None:
        self.dropped.append(item.name)
    raise RuntimeError(f"no confirmed {category} {shape} program")

  def _draw(self, r, category, shape) -> Item | None:
    good = category == "correct"
    if shape == "humaneval":
      row = r.choice(self.humaneval)
      task = _humaneval_task(row)
      code = row["prompt"] + row["canonical_solution"]
      name = row["task_id"]
      if not good:
        variants = _mutants(code, row["entry_point"])
        for vname, src in variants[:1] + r.sample(variants[1:], len(variants) - 1):
          item = Item(category, shape, f"{name}:{vname}", task, src)
          if self._confirm(item):
            return item
        return None
      return Item(category, shape, name, task, code)
    if shape == "mbpp":
      row = r.choice(self.mbpp)
      task = _mbpp_task(row)
      code = row["code"].replace("\r\n", "\n")
      name = f"mbpp/{row['task_id']}"
      if not good:
        m = re.search(r"^def\s+(\w+)", code, re.M)
        variants = _mutants(code, m.group(1) if m else None)
        for vname, src in r.sample(variants, len(variants)):
          item = Item(category, shape, f"{name}:{vname}", task, src)
          if self._confirm(item):
            return item
        return None
      return Item(category, shape, name, task, code)
    lang = "cpp" if shape == "stdin_cpp" else "python"
    problems = [p for p, (_, srcs) in STDIN_PROBLEMS.items() if (lang, True) in srcs]
    p = r.choice(problems)
    inst = r.randrange(INSTANCES)
    return Item(category, shape, f"{p}/{inst}:{lang}:{category}", stdin_task(p, inst, lang),
                STDIN_PROBLEMS[p][1][(lang, good)], lang)


  def functional_task(self, r: random.Random) -> tuple[dict, str, str]:
    """A HumanEval (70 %) or MBPP task: (task, its entry point, shape)."""
    if r.random() < 0.7:
      row = r.choice(self.humaneval)
      return _humaneval_task(row), row["entry_point"], "humaneval"
    row = r.choice(self.mbpp)
    return _mbpp_task(row), re.search(r"^def\s+(\w+)", row["code"], re.M).group(1), "mbpp"


def hostile_item(r: random.Random, catalog: Catalog, cpp_share: float,
                 name: str | None = None) -> Item:
  """The attack `name` of hostile_programs.ATTACKS, or one drawn (C++ with probability
  cpp_share), in a task it cannot pass: a functional one for a "func" attack (and for a Python
  stdin attack now and then, run at import), else stdin/stdout tests whose expected output is the
  planted secret (for the reading attacks) or a fixed answer none of them computes."""
  if name is None:
    cpp = r.random() < cpp_share
    name = r.choice(sorted(n for n, a in ATTACKS.items() if (a.lang == "cpp") == cpp))
  a = ATTACKS[name]
  if a.lang == "python" and (a.shape == "func" or r.random() < 0.3):
    task, entry, shape = catalog.functional_task(r)
    src = a.src if a.shape == "func" else a.src + "\ndef f(x):\n  return None\n"
    if entry != "f":   # the attacks define f(x): the task's entry point reaches it
      src += f"\n\ndef {entry}(*args, **kwargs):\n  return f(*args[:1])\n"
    return Item("hostile", shape, name, task, src)
  tests = tuple((f"{i}\n", SECRET + "\n" if a.reads_secret else f"{7 * i + 3}\n")
                for i in range(2))
  return Item("hostile", f"stdin_{'cpp' if a.lang == 'cpp' else 'py'}", name,
              stdin_task(name, 0, a.lang, tests), a.src, a.lang)


def build_mix(n: int, seed: int, hostile_share: float, cpp_share: float, catalog: Catalog,
              categories=("hostile", "correct", "wrong"), include=()) -> list[Item]:
  """n tasks: one of each attack in `include`, the rest drawn; in a seeded order."""
  r = random.Random(seed)
  benign_share = (1.0 - hostile_share) / 2
  py_shapes, py_weights = ["humaneval", "mbpp", "stdin_py"], [0.5, 0.2, 0.3]
  items = [hostile_item(r, catalog, cpp_share, name) for name in include[:n]]
  while len(items) < n:
    u = r.random()
    category = "hostile" if u < hostile_share else "correct" if u < hostile_share + benign_share \
        else "wrong"
    if category not in categories:
      continue
    if category == "hostile":
      items.append(hostile_item(r, catalog, cpp_share))
      continue
    shape = "stdin_cpp" if r.random() < cpp_share else r.choices(py_shapes, py_weights)[0]
    items.append(catalog.benign(r, category, shape))
  if include:
    r.shuffle(items)
  return items


def verdict_ok(item: Item, res, cfg: RewardConfig) -> bool:
  """A correct program gets the pass reward; a wrong or hostile one gets none."""
  if item.expect_pass:
    return res.error is None and res.parts.get("correct") == cfg.correct_reward
  return res.parts.get("correct", 0.0) == 0.0


def bare_run(item: Item, root: str, timeout_s: float = 10.0) -> bool:
  """Runs `item`'s program with plain subprocess calls, as bench/verifiers.py does: functional
  tests in one process with the test code, stdin/stdout tests one process each (C++: g++ with the
  same flags and precompiled header first). Returns whether it passed."""
  d = tempfile.mkdtemp(dir=root)
  try:
    t = item.task
    if "tests" not in t:
      if "test_code" in t:
        # The prompt's helpers over the candidate's, as the harness runs them (code_asserts.py).
        helpers = prompt_helpers(t.get("problem", ""), t["entry_point"]) or ""
        test = f"{helpers}\n{t['test_code']}\ncheck({t['entry_point']})\n"
      else:
        test = (t.get("test_setup_code") or "") + "\n" + "\n".join(t["test_list"]) + "\n"
      path = os.path.join(d, "prog.py")
      with open(path, "w") as f:
        f.write(f"{item.src}\n\n{test}\nprint('__bare_ok__')\n")
      try:
        r = subprocess.run([PYTHON, "-I", path], capture_output=True, timeout=timeout_s, cwd=d)
      except subprocess.TimeoutExpired:
        return False
      return r.returncode == 0 and r.stdout.rstrip().endswith(b"__bare_ok__")
    if item.lang == "cpp":
      with open(os.path.join(d, "prog.cpp"), "w") as f:
        f.write(item.src)
      pch = precompiled_header_dir()
      argv = ["g++", *CXX_FLAGS] + ([f"-I{pch}"] if pch else []) + \
          ["prog.cpp", "-o", "prog"]
      if subprocess.run(argv, capture_output=True, timeout=60, cwd=d).returncode != 0:
        return False
      argv = ["./prog"]
    else:
      with open(os.path.join(d, "prog.py"), "w") as f:
        f.write(item.src)
      argv = [PYTHON, "-I", "prog.py"]
    for case in t["tests"]:
      try:
        r = subprocess.run(argv, input=case["input"].encode(), capture_output=True,
                           timeout=timeout_s, cwd=d)
      except subprocess.TimeoutExpired:
        return False
      if r.returncode != 0 or not outputs_match(r.stdout.decode(errors="replace"),
                                                case["output"], task_tolerance(t)):
        return False
    return True
  finally:
    shutil.rmtree(d, ignore_errors=True)

