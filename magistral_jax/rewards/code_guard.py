"""The assert tests, rewritten so that no test's result decides what the candidate is asked next
(rewards/code_asserts.py runs them; code_stdio.py does the same for stdin/stdout tests).

Why: a harness that stops at the first failed test is a verdict oracle. The candidate sees the
calls it is given; when the next call comes only after a pass, the sequence tells it whether its
last answer was right, and any channel to a later run of the same problem (the fourth red-team
wave used the kernel keyring and the host's page cache) then carries answers it could not
compute. So here every test runs whatever the others did, in an order the candidate cannot
predict, and the verdict is formed only at the end, in our process:
  - each test statement is guarded: a failed assert, or any exception of the test (a failed call
    into the candidate included), is recorded and the next statement runs. For HumanEval's
    `check(candidate)` the statements are those of check's body, for MBPP the assert lines; an
    assert nested in a loop, an `if` or a `with` is guarded too, so a loop of asserts runs to its
    end. Asserts under a `try` (the test's own handling), and in functions the tests define, are
    left alone: their exceptions reach the guard of the statement that called them;
  - consecutive asserts that share no variable of the tests are run in a shuffled order
    (random.Random of a secret drawn in our process per check, which the candidate cannot read:
    `order_seed`). Statements that bind or read the tests' variables keep their place, so
    "x = [3, 1]; assert f(x) is None; assert x == [1, 3]" means what it says;
  - a VerifierFault is never recorded: it ends the check (no verdict: the group is dropped).
What the candidate can still learn is what it already knows: its own answers and the inputs. A
candidate that crashes or times out is not called again (the conversation is over; every later
call fails at once), which tells it nothing it did not decide itself.
"""
from __future__ import annotations

import ast
import random

FAIL = "__mj_test_failed__"      # ns name of the recorder: FAIL(exception)
FAULT = "__mj_verifier_fault__"  # ns name of the exception class a guard re-raises
_ERR = "__mj_test_error__"


def _guard(stmt: ast.stmt) -> ast.stmt:
  """try: stmt / except FAULT: raise / except Exception as e: FAIL(e)"""
  return ast.Try(
      body=[stmt],
      handlers=[
          ast.ExceptHandler(type=ast.Name(FAULT, ast.Load()), name=None, body=[ast.Raise()]),
          ast.ExceptHandler(type=ast.Name("Exception", ast.Load()), name=_ERR, body=[
              ast.Expr(ast.Call(ast.Name(FAIL, ast.Load()), [ast.Name(_ERR, ast.Load())], []))]),
      ],
      orelse=[], finalbody=[])


class _GuardNested(ast.NodeTransformer):
  """Guards the asserts inside loops, ifs and withs; leaves try blocks and nested scopes alone."""

  def visit_Assert(self, node):
    return _guard(node)

  def visit_Try(self, node):
    return node

  visit_TryStar = visit_Try

  def visit_FunctionDef(self, node):
    return node

  visit_AsyncFunctionDef = visit_ClassDef = visit_Lambda = visit_FunctionDef


def bound_names(tree: ast.AST) -> set[str]:
  """Names the code binds as variables (assignments, loop and with targets, :=, del), not the
  functions, classes and modules it defines."""
  out = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
      out.add(node.id)
  return out


def _movable(stmt: ast.stmt, variables: set[str]) -> bool:
  """An assert that neither binds nor reads a variable of the tests: its place in the order
  cannot change what it checks."""
  if not isinstance(stmt, ast.Assert):
    return False
  for node in ast.walk(stmt):
    if isinstance(node, ast.NamedExpr):
      return False
    if isinstance(node, ast.Name) and node.id in variables:
      return False
  return True


def guarded_body(body: list[ast.stmt], variables: set[str], rng: random.Random) -> list[ast.stmt]:
  """`body` with each statement guarded and each run of movable asserts shuffled."""
  out, run = [], []

  def flush():
    rng.shuffle(run)
    out.extend(_guard(s) for s in run)
    run.clear()

  for stmt in body:
    if _movable(stmt, variables):
      run.append(stmt)
      continue
    flush()
    if isinstance(stmt, ast.Assert):
      out.append(_guard(stmt))
    else:
      out.append(_guard(_GuardNested().visit(stmt)))
  flush()
  return out


def unordered_tests(test_src: str, entry_point: str | None, order_seed: int,
                    setup_src: str = "") -> ast.Module:
  """The tests as a module to exec (see the module docstring). With `entry_point` (HumanEval) the
  top-level `check` function's body is rewritten and the rest of the module is left as it is;
  without (MBPP), the module's own statements are. `setup_src`'s variables count as the tests'
  variables too. Raises SyntaxError for tests that do not parse."""
  tree = ast.parse(test_src, "tests.py")
  variables = bound_names(tree) | bound_names(ast.parse(setup_src or "", "setup.py"))
  rng = random.Random(order_seed)
  if entry_point:
    for node in tree.body:
      if isinstance(node, ast.FunctionDef) and node.name == "check":
        node.body = guarded_body(node.body, variables, rng)
  else:
    tree.body = guarded_body(tree.body, variables, rng)
  return ast.fix_missing_locations(tree)
