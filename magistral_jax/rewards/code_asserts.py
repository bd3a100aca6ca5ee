"""Assert tests, HumanEval style (`test_code` defining `check(candidate)` + `entry_point`) or
MBPP style (`test_list` of assert lines, optional `test_setup_code`), against a sandboxed candidate.

The test code runs in OUR process; the candidate's module is loaded in a sandboxed process by
code_driver.py, and the test code calls its functions through proxies: each call sends the
arguments (checked plain, as a Python literal) on the child's stdin, and the child answers with
the return value as JSON (or the exception's name), never pickle. Only plain values cross
(code_codec.py: exact builtin types, and collections' Counter, OrderedDict, defaultdict, deque);
anything else, an object with its own __eq__ included, is a failed call, unless it is a
function or an iterator (a handle, below). So the
comparisons, the expected values and the verdict never exist in the candidate's process: exiting
early, raising, patching builtins, print or sys.stdout, or writing forged answer lines can only
make calls fail or return values it chose, which pass only if they are the right ones. The verdict
is "every test statement ran without an exception, and no call into the candidate failed",
decided here, once every test statement has run (in a shuffled order: code_guard.py, so the
calls it gets never tell the candidate how it is doing). What the boundary would otherwise hide
or change is put back by construction:
  - helpers: the functions the task's own code defines (a HumanEval prompt's `poly` beside
    `find_zero`, `encode_shift` beside `decode_shift`: `test_setup_code`, or for `test_code`
    tasks the prompt less its entry point, humaneval.py) run in OUR process, so the tests
    never call a copy the candidate redefined, nor hand the candidate the arguments they pass
    to a helper. For `test_code` tasks the entry point is the only
    name that reaches the candidate; MBPP asserts name the function to write, so there any
    name the tests and their setup leave undefined is the candidate's;
  - exceptions: an Exception the candidate raises reaches the tests as its builtin class (the
    first builtin in its MRO, with its name and message), so a test's `except ValueError`
    works as in one process; StopIteration (which would silently end a map() or zip() in the
    test) and BaseExceptions (SystemExit, KeyboardInterrupt, GeneratorExit) fail the candidate
    (CandidateError, recorded in `_Candidate.failures`, whatever the tests do with it);
  - effects and identity: a call's changes to its arguments are applied to the caller's objects
    in place; a result that is, or holds, a container of the arguments is the caller's own
    object (as the call left it); a mutable argument or result is shared (code_shared.Shared):
    both sides keep their copy in step at every call, so an argument the candidate keeps and the
    tests change later, or a cache it returns twice, is one object, as in one process;
  - functions and iterators it returns are handles (code_shared.Remote): calling or iterating
    one is a call into its process (an exhausted iterator's StopIteration ends the iteration);
  - its solution is a real module ("solution"), so what pickles by reference (multiprocessing's
    calls) finds its functions;
  - decoding is linear and bounded: an answer line is at most MAX_ANSWER_BYTES, sets and dict
    keys whose hashes collide are refused, big ints cross in hex.
The task format, where one process's semantics cannot be kept safely: arguments the tests pass
must be plain values (code_codec.py) or handles the candidate gave; a test passing a function of
its own (or any other object) is refused (UnsupportedTask: no verdict, never a different one).
A value nests at most 180 deep, an answer is at most MAX_ANSWER_BYTES and the shared containers
at most MAX_SHARED_BYTES; past those a call fails, as it would past its memory limit.
A stdlib module the solution imported (from a short allowed list, _TEST_MODULES) is imported for
the tests under the same name.
"""
from __future__ import annotations

import builtins
import importlib
import json
import os
import secrets
import sys
import time

from magistral_jax.rewards import code_guard
from magistral_jax.rewards.code_codec import decode_parsed, encode_value, literal, update_in_place
from magistral_jax.rewards.code_driver import DRIVER as _DRIVER
from magistral_jax.rewards.code_shared import (MUTABLE, Remote, RemoteFunction, RemoteIterator,
                                              Shared, at_path)
from magistral_jax.rewards.code_result import CodeResult, VerifierFault, write_source
from magistral_jax.rewards.sandbox_channel import Channel
from magistral_jax.rewards.sandbox_root import interpreter_binds

# The longest answer line a call may send (its value and the arguments it changed, encoded): the
# size is bounded before anything is decoded, so decoding costs our process memory and CPU in
# proportion to this, not to the program's output cap. A longer answer fails the call.
MAX_ANSWER_BYTES = 1 << 20
# The most the containers both sides hold (Shared) may weigh, encoded: each call compares them
# all, so this bounds our work per call as MAX_ANSWER_BYTES bounds an answer's.
MAX_SHARED_BYTES = 4 * MAX_ANSWER_BYTES

_TEST_MODULES = frozenset({
    "math", "cmath", "re", "string", "collections", "itertools", "functools", "operator", "heapq",
    "bisect", "fractions", "decimal", "statistics", "copy", "datetime", "random"})


class CandidateError(Exception):
  """A call into the candidate failed: it raised, returned a value that is not plain, died, or
  ran out of time or output. Sticky: once raised, the candidate has failed, whatever the test
  code does with the exception."""


class _Candidate:
  """Our end of the conversation with the driver: proxies that call the candidate's functions.

  A call's effects come back as a shared-process harness would show them: arguments the call
  changed are changed in the caller's objects, in place, and a result that IS one of the
  arguments is the caller's own object. Every failure (see CandidateError) is recorded in
  `failures`, and a candidate with any fails, even when the test code catches the exception."""

  def __init__(self, channel: Channel):
    self.channel = channel
    self.calls = 0
    self.failures: list[str] = []
    self.unsupported: str | None = None   # why the tests cannot be judged here (UnsupportedTask)
    # Containers both sides hold (a mutable argument, a mutable result): number -> our object,
    # and the text of it the driver last saw. Each call first sends what the tests changed in
    # them, and its answer brings what the candidate changed, so a kept argument or a returned
    # cache is one object across calls, as in one process. Ours are even, the driver's odd.
    self.mirror: dict[int, object] = {}
    self.mirror_ids: dict[int, int] = {}
    self.mirror_text: dict[int, str] = {}
    self._next_even = 0
    try:   # the driver speaks first, once the solution is loaded
      hello = self._parse(channel.read_line())
    except Channel.Closed as e:
      raise self._closed(e, "solution did not load") from None
    if "load_error" in hello:
      raise CandidateError("solution does not load: " + str(hello["load_error"])[:300])
    names = hello.get("names")
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
      raise CandidateError("bad hello from the driver")
    self.names = names
    modules = hello.get("modules", [])
    self.modules = {m[0]: m[1] for m in modules if isinstance(m, list) and len(m) == 2
                    and all(isinstance(x, str) for x in m)} if isinstance(modules, list) else {}

  @staticmethod
  def _closed(e: Channel.Closed, what: str) -> Exception:
    if e.fault:
      return VerifierFault(f"{what}: {e.fault}")
    return CandidateError(f"{what}: {e}")

  @staticmethod
  def _parse(line: bytes) -> dict:
    try:
      msg = json.loads(line)
    except (ValueError, RecursionError):   # RecursionError: a line nested deeper than we parse
      raise CandidateError("garbled answer") from None
    if not isinstance(msg, dict):
      raise CandidateError("garbled answer")
    return msg

  def call(self, target, args: tuple, kwargs: dict):
    """Calls the candidate's function `target` (its name, or ("call" | "next", handle) of a
    function or iterator it returned) with the tests' `args`, `kwargs`."""
    try:
      return self._call(target, args, kwargs)
    except CandidateError as e:
      self.failures.append(str(e))
      raise

  def _literal_handle(self, x):
    if isinstance(x, Remote) and x.cand is self:
      return f"_H({x.n})"
    if type(x) is Shared:
      return f"_S({x.n})" if x.value is None else f"_N({x.n}, {literal(x.value)})"
    return None

  def _share(self, n: int, obj):
    self.mirror[n], self.mirror_ids[id(obj)] = obj, n
    self.mirror_text[n] = encode_value(obj)

  def _forget(self, n: int):
    obj = self.mirror.pop(n)
    self.mirror_ids.pop(id(obj), None)
    self.mirror_text.pop(n, None)

  def _outgoing(self, args: tuple, kwargs: dict):
    """(args, kwargs with shared containers as Shared, changed [(n, value)], dropped [n]):
    containers no test holds any more are dropped (our table is then their only holder)."""
    sync, drop = [], []
    for n in list(self.mirror):
      obj = self.mirror[n]
      if sys.getrefcount(obj) <= 3:          # the table, `obj`, getrefcount's argument
        self._forget(n)
        drop.append(n)
        continue
      try:
        text = encode_value(obj)
      except (TypeError, ValueError):        # holds something not plain now: no longer shared
        self._forget(n)
        drop.append(n)
        continue
      if text != self.mirror_text[n]:
        self.mirror_text[n] = text
        sync.append((n, obj))
    self._check_shared()

    def mark(a):
      if type(a) not in MUTABLE:
        return a
      n = self.mirror_ids.get(id(a))
      if n is not None and self.mirror[n] is a:
        return Shared(n, None)
      n, self._next_even = self._next_even, self._next_even + 2
      try:
        self._share(n, a)
      except (TypeError, ValueError):
        return a                             # not plain: literal() refuses it below
      return Shared(n, a)
    return ([mark(a) for a in args], {k: mark(a) for k, a in kwargs.items()}, sync, drop)

  def _incoming(self, msg: dict, hook):
    """Applies what the call changed in the shared containers."""
    for n, v in msg.get("sync") or []:
      obj = self.mirror.get(n)
      if obj is not None:
        update_in_place(obj, decode_parsed(v, hook))
        self.mirror_text[n] = encode_value(obj)
    self._check_shared()

  def _check_shared(self):
    if sum(map(len, self.mirror_text.values())) > MAX_SHARED_BYTES:
      raise CandidateError(f"shared containers over {MAX_SHARED_BYTES} bytes")

  def _call(self, target, args: tuple, kwargs: dict):
    self.calls += 1
    try:
      # Sent as a Python literal the driver evals without builtins, of plain values only (exact
      # types), or handles it gave us; the arguments are the tests' (ours), never the candidate's.
      sent_args, sent_kwargs, sync, drop = self._outgoing(args, kwargs)
      req = literal((self.calls, target, sent_args, sent_kwargs, sync, drop), self._literal_handle)
    except (TypeError, ValueError) as e:
      # The task's tests pass what the task format does not allow (a function of their own, an
      # object): no verdict can be one process's, so none is given.
      self.unsupported = f"the tests pass an argument the harness cannot send: {e}"
      raise UnsupportedTask(self.unsupported) from None
    name = target if isinstance(target, str) else f"{target[0]} of a returned object"
    try:
      msg = self._parse(self.channel.request(req.encode()))
    except Channel.Closed as e:
      raise self._closed(e, f"call {name}") from None
    if msg.get("id") != self.calls:
      raise CandidateError("answer out of sequence")
    if "ok" in msg:
      return self._value(msg, args, kwargs)
    try:
      self._incoming(msg, self._decode_hook([]))
    except Exception as e:
      raise CandidateError(f"bad answer: {type(e).__name__}: {e}") from None
    if "bad" in msg:
      raise CandidateError(f"returned a value that is not plain data: {str(msg['bad'])[:200]}")
    err = msg.get("err")
    if not (isinstance(err, list) and len(err) == 3 and all(isinstance(x, str) for x in err)):
      raise CandidateError("garbled answer")
    if err[2] == "StopIteration" and not isinstance(target, str) and target[0] == "next":
      raise StopIteration        # an iterator it returned is exhausted, as in one process
    cls = getattr(builtins, err[2], None)
    if (isinstance(cls, type) and issubclass(cls, Exception)
        and not issubclass(cls, (StopIteration, StopAsyncIteration))):
      try:
        exc = cls(f"{err[0]}: {err[1]}")
      except Exception:
        exc = None
      if exc is not None:
        raise exc        # as in one process: the test may expect it (`except ValueError`)
    # Sticky, never raised as itself: a StopIteration would silently end a map() or zip() in the
    # test, and BaseExceptions (SystemExit, KeyboardInterrupt) are no test's business.
    raise CandidateError(f"raised {err[0]}: {err[1]}")

  def _value(self, msg: dict, args: tuple, kwargs: dict):
    """The call's value: plain data, or the caller's own objects where the result is (or holds)
    a container of the arguments, or remote handles; the arguments updated in place."""
    pending = []
    hook = self._decode_hook(pending, args, kwargs)
    try:
      # References first (they name the arguments as they were before the call), then what the
      # call changed: in shared containers, in the arguments, in what the value holds.
      value = decode_parsed(msg["ok"], hook)
      self._incoming(msg, hook)
      if msg.get("args") is not None:
        new_args, new_kwargs = decode_parsed(msg["args"], hook)
        update_in_place(list(args), new_args)
        update_in_place(dict(kwargs), new_kwargs)
      for obj, new in pending:
        update_in_place(obj, new)
    except Exception as e:   # OverflowError (complex(10**400)) too: a failed call, never raised
      raise CandidateError(f"bad return value: {type(e).__name__}: {e}") from None
    return value

  def _decode_hook(self, pending: list, args: tuple = (), kwargs: dict | None = None):
    """Decodes the driver's tags: references into the call's arguments ("r": the caller's
    object), shared containers ("S": ours) and handles ("fn", "it"); the contents the driver
    sent for the first two are put into `pending` (object, new contents) to apply last."""
    def hook(tag, v):
      if tag == "r":
        obj = at_path(args, kwargs or {}, v[0])
        pending.append((obj, decode_parsed(v[1])))
        return obj
      if tag == "S":
        n, value = v
        if type(n) is not int:
          raise ValueError("bad shared number")
        new = decode_parsed(value, hook)
        obj = self.mirror.get(n)
        if obj is None:
          self._share(n, new)
          return new
        pending.append((obj, new))
        return obj
      if type(v) is not int:
        raise ValueError("bad handle")
      return (RemoteFunction if tag == "fn" else RemoteIterator)(self, v)
    return hook

  def proxy(self, fn: str):
    def call(*args, **kwargs):
      return self.call(fn, args, kwargs)
    call.__name__ = call.__qualname__ = fn
    return call


class UnsupportedTask(VerifierFault):
  """The task's tests do what one process allows and this harness cannot (see the module
  docstring's task format): no verdict, the group is dropped, and the message says why."""


def run_assert_tests(sandbox, workdir, python, code, test_src, entry_point, limits,
                     setup_src: str = "", order_seed: int | None = None) -> CodeResult:
  """Runs the assert tests in OUR process against the candidate in a sandboxed one (see the module
  docstring): passed only if every test statement ran without raising and no call into the
  candidate failed. `setup_src` (the task's own helpers) runs here first; with an
  `entry_point` (HumanEval), the entry point is the only name that reaches the candidate. Every
  test statement runs, in an order shuffled by `order_seed` (None: a fresh secret), see
  code_guard.py."""
  write_source(os.path.join(workdir, "solution.py"), code)
  exe, binds = interpreter_binds(python)
  # One process serves all calls, so the backstop covers the whole test program.
  start = time.monotonic()
  proc = sandbox.start([exe], workdir, limits, ro_binds=binds, python_src=_DRIVER,
                       inputs=["solution.py"])
  channel = Channel(proc, start, limits, line_cap=MAX_ANSWER_BYTES)
  try:
    try:
      cand = _Candidate(channel)
    except CandidateError as e:
      return CodeResult(False, f"{e}: " + bytes(channel.err).decode(errors="replace")[-300:], 1)
    ns = {"__name__": "tests", "__builtins__": builtins}
    if entry_point and entry_point in cand.names:
      ns[entry_point] = cand.proxy(entry_point)   # a test may name it (HumanEval/33 does)
    if not entry_point:
      # MBPP style: the asserts call the function to write by its name; any name they use that
      # the task's code does not define is the candidate's.
      for name in cand.names:
        if not hasattr(builtins, name):
          ns[name] = cand.proxy(name)
    # Tests sometimes use a module only the solution imported (`math.isclose(...)`): the same
    # stdlib module, imported here, where it is in _TEST_MODULES (the candidate names them; we
    # import nothing else on its word).
    for name, module in cand.modules.items():
      if module in _TEST_MODULES and name not in ns and not hasattr(builtins, name):
        ns[name] = importlib.import_module(module)
    # No verdict oracle (code_guard.py): every test statement runs whatever the others did, in
    # an order drawn from a secret of ours, and the verdict is formed once all have run.
    failed: list[BaseException] = []
    ns[code_guard.FAIL], ns[code_guard.FAULT] = failed.append, VerifierFault
    if order_seed is None:
      order_seed = secrets.randbits(64)
    try:
      # The task's helpers and tests define their names over the candidate's: a helper the tests
      # call is the prompt's, run here, never the candidate's copy of it.
      exec(compile(setup_src, "setup.py", "exec"), ns)
      exec(compile(code_guard.unordered_tests(test_src, entry_point, order_seed, setup_src),
                   "tests.py", "exec"), ns)
      if entry_point:
        if entry_point not in cand.names:
          return CodeResult(False, f"entry point {entry_point!r} not defined", 1)
        ns["check"](cand.proxy(entry_point))
    except VerifierFault:
      raise
    except Exception as e:   # outside any guarded statement: the setup, check's own definition
      failed.append(e)
    if cand.unsupported:       # even where the tests' own handler caught it
      raise UnsupportedTask(cand.unsupported)
    first = failed[0] if failed else None
    if isinstance(first, CandidateError):
      return CodeResult(False, f"call failed: {first}: "
                        + bytes(channel.err).decode(errors="replace")[-200:], 1)
    if first is not None:    # AssertionError and whatever a wrong value makes the tests raise
      return CodeResult(False, f"test failed: {type(first).__name__}: {str(first)[:200]}", 1)
    if cand.failures:          # a failed call that the test code caught and went on from
      return CodeResult(False, f"call failed: {cand.failures[0][:300]}", 1)
    return CodeResult(True, "", 1)
  except CandidateError as e:
    return CodeResult(False, str(e), 1)
  finally:
    channel.close()
    sandbox.remove_keys()
