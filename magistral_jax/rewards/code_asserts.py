"""Assert tests, HumanEval style (`test_code` defining `check(candidate)` + `entry_point`) or
MBPP style (`test_list` of assert lines, optional `test_setup_code`), against a sandboxed candidate.

The test code runs in OUR process; the candidate's module is loaded in a sandboxed process by
_DRIVER, and the test code calls its functions through proxies: each call sends the arguments
(checked plain, as a Python literal) on the child's stdin, and the child answers with the return
value as JSON (or the exception's name), never pickle. Only plain values cross (code_codec.py:
None, bool, int, float, str, list, tuple, dict, set, frozenset, bytes, complex, of exactly those
types); anything else, an object with its own __eq__ included, is a failed call. So the
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
  - exceptions: a call that raises fails the candidate (CandidateError, recorded in
    `_Candidate.failures`), never re-raised as itself: a StopIteration would silently end a
    map() or zip() in the test, and a test's own handlers could swallow anything else;
  - effects: a call's changes to its arguments are applied to the caller's objects in place,
    and a result that is one of the arguments is returned as the caller's own object, so
    tests that check "sorted in place", "input left alone" or `is not x` see what a shared
    process would show;
  - decoding is linear: sets and dict keys whose hashes collide are refused.
A stdlib module the solution imported (from a short allowed list, _TEST_MODULES) is imported for
the tests under the same name.
"""
from __future__ import annotations

import builtins
import collections
import importlib
import json
import os
import secrets
import time

from magistral_jax.rewards import code_guard
from magistral_jax.rewards.code_codec import WRITER, decode_parsed, literal
from magistral_jax.rewards.code_result import CodeResult, VerifierFault, write_source
from magistral_jax.rewards.sandbox_channel import Channel
from magistral_jax.rewards.sandbox_root import interpreter_binds

# The sandboxed side: loads solution.py, then answers calls read from stdin. Our pipes are moved to
# private fds first, so the candidate's prints go to stderr (drained and mostly dropped) and its
# input() sees EOF. A request is a Python literal (id, function, args, kwargs) that we wrote from
# values CODEC accepted; an answer is one JSON line. Nothing here is secret: the candidate may
# read, patch or replace all of it.
_DRIVER = WRITER + r'''
import os, sys, collections as _co
_LITERALS = {"__builtins__": {}, "nan": float("nan"), "inf": _INF, "set": set, "frozenset": frozenset,
             "float": float, "complex": complex, "Counter": _co.Counter, "deque": _co.deque,
             "OrderedDict": _co.OrderedDict, "defaultdict": _co.defaultdict,
             "None": None, "int": int, "str": str, "bytes": bytes, "list": list, "dict": dict,
             "tuple": tuple, "bool": bool}
_handles = []
_LITERALS["_H"] = _handles.__getitem__
_MUTABLE = (list, dict, set, _co.Counter, _co.OrderedDict, _co.defaultdict, _co.deque)
def _paths(x, path, out, depth=0):
  # id -> JSON path of every mutable container in the arguments (before the call).
  t = type(x)
  if depth > 180 or not (t in _MUTABLE or t is tuple):
    return
  if t in _MUTABLE:
    out[id(x)] = (x, path)
  if t is list or t is tuple or t is _co.deque:
    for i, v in enumerate(x):
      _paths(v, path + "," + str(i), out, depth + 1)
  elif t is not set:
    for k, v in list(x.items()):
      _paths(v, path + ',{"key":' + write(k) + "}", out, depth + 1)
_known = {}
def _handle(x):
  kind = "fn" if callable(x) else "it" if hasattr(type(x), "__next__") else None
  if kind is None:
    return None
  if id(x) not in _known:
    _known[id(x)] = len(_handles)
    _handles.append(x)          # kept alive, so no other object takes its id
  return '{"%s":%d}' % (kind, _known[id(x)])
def _state_hook(x):
  return _handle(x) if id(x) in _known else None
def _main():
  rfd, wfd = os.dup(0), os.dup(1)
  null = os.open("/dev/null", os.O_RDONLY)
  os.dup2(null, 0)
  os.dup2(2, 1)
  rin, wout = os.fdopen(rfd, "rb"), os.fdopen(wfd, "wb")
  # A real module, so that what pickles by reference (multiprocessing's calls) finds it.
  mod = type(os)("solution")
  sys.modules["solution"] = mod
  ns = mod.__dict__
  def reply(text):
    wout.write(text.encode() + b"\n")
    wout.flush()
  try:
    with open("solution.py", encoding="utf-8") as f:
      exec(compile(f.read(), "solution.py", "exec"), ns)
  except BaseException as e:
    reply('{"load_error":' + _esc(type(e).__name__ + ": " + str(e)[:300]) + "}")
    return
  items = [(k, v) for k, v in list(ns.items()) if type(k) is str and not k.startswith("__")]
  reply('{"names":' + write(sorted(k for k, v in items if callable(v))) + ',"modules":'
        + write([[k, v.__name__] for k, v in items if type(v) is type(os) and type(v.__name__) is str])
        + "}")
  for line in rin:
    rid, target, args, kwargs = eval(line, _LITERALS)
    before = write([args, kwargs], 0, _state_hook)
    refs = {}
    for i, a in enumerate(args):
      _paths(a, str(i), refs)
    for k, a in kwargs.items():
      _paths(a, _esc(k), refs)
    try:
      if type(target) is str:
        fn = ns[target]
      elif target[0] == "next":
        fn = _handles[target[1]].__next__
      else:
        fn = _handles[target[1]]
      result = fn(*args, **kwargs)
    except BaseException as e:
      base = next((c.__name__ for c in type(e).__mro__ if c.__module__ == "builtins"), "Exception")
      reply('{"id":%d,"err":[%s,%s,%s]}' % (rid, _esc(type(e).__name__), _esc(str(e)[:300]),
                                             _esc(base)))
      continue
    def hook(x):
      # A container of the arguments: the caller's own object, as it is now; a function or an
      # iterator: a handle the caller calls or iterates through us.
      hit = refs.get(id(x))
      if hit is not None and hit[0] is x:
        return '{"r":[[' + hit[1] + "]," + write(x) + "]}"
      return None if type(x) in _MUTABLE or type(x) in (tuple, frozenset, bytes, complex) else _handle(x)
    try:
      # What the caller could see besides the value: the arguments as the call left them (when
      # it changed them), and which of its objects the result is or holds.
      after = write([args, kwargs], 0, _state_hook)
      reply('{"id":%d,"ok":%s,"args":%s}' % (rid, write(result, 0, hook),
                                             "null" if after == before else after))
    except BaseException as e:   # not a plain value: a failed call, not an exception to test for
      reply('{"id":%d,"bad":%s}' % (rid, _esc(str(e)[:300])))
_main()
'''


# The longest answer line a call may send (its value and the arguments it changed, encoded): the
# size is bounded before anything is decoded, so decoding costs our process memory and CPU in
# proportion to this, not to the program's output cap. A longer answer fails the call.
MAX_ANSWER_BYTES = 1 << 20

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
    if isinstance(x, _Remote) and x.cand is self:
      return f"_H({x.n})"
    return None

  def _call(self, target, args: tuple, kwargs: dict):
    self.calls += 1
    try:
      # Sent as a Python literal the driver evals without builtins, of plain values only (exact
      # types), or handles it gave us; the arguments are the tests' (ours), never the candidate's.
      req = literal((self.calls, target, list(args), dict(kwargs)), self._literal_handle)
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

    def hook(tag, v):
      if tag == "r":
        obj = _at_path(args, kwargs, v[0])
        pending.append((obj, decode_parsed(v[1])))
        return obj
      if type(v) is not int:
        raise ValueError("bad handle")
      return (_RemoteFunction if tag == "fn" else _RemoteIterator)(self, v)
    try:
      value = decode_parsed(msg["ok"], hook)
      if msg.get("args") is not None:
        new_args, new_kwargs = decode_parsed(msg["args"], hook)
        _update_in_place(list(args), new_args)
        _update_in_place(dict(kwargs), new_kwargs)
      for obj, new in pending:
        _update_in_place(obj, new)
    except Exception as e:   # OverflowError (complex(10**400)) too: a failed call, never raised
      raise CandidateError(f"bad return value: {type(e).__name__}: {e}") from None
    return value

  def proxy(self, fn: str):
    def call(*args, **kwargs):
      return self.call(fn, args, kwargs)
    call.__name__ = call.__qualname__ = fn
    return call


class UnsupportedTask(VerifierFault):
  """The task's tests do what one process allows and this harness cannot (see the module
  docstring's task format): no verdict, the group is dropped, and the message says why."""


class _Remote:
  """Something the candidate returned that is not data: used through calls into its process."""

  def __init__(self, cand: _Candidate, n: int):
    self.cand, self.n = cand, n


class _RemoteFunction(_Remote):
  def __call__(self, *args, **kwargs):
    return self.cand.call(("call", self.n), args, kwargs)


class _RemoteIterator(_Remote):
  def __iter__(self):
    return self

  def __next__(self):
    return self.cand.call(("next", self.n), (), {})


def _at_path(args: tuple, kwargs: dict, path: list):
  """The caller's object at `path` (the driver's: an argument's position or keyword, then list
  indices and {"key": k} dict keys) in the arguments as they were before the call."""
  obj = args[path[0]] if type(path[0]) is int else kwargs[path[0]]
  for step in path[1:]:
    if type(obj) not in _CONTAINERS:
      raise ValueError("bad reference")
    obj = obj[decode_parsed(step["key"])] if type(step) is dict else obj[step]
  if type(obj) not in _CONTAINERS:
    raise ValueError("bad reference")
  return obj


_CONTAINERS = (list, tuple, dict, set, collections.Counter, collections.OrderedDict,
               collections.defaultdict, collections.deque)
_DICTS = (dict, collections.Counter, collections.OrderedDict, collections.defaultdict)


def _update_in_place(mine, theirs):
  """Makes the caller's containers `mine` equal to `theirs` (what the candidate left its copies
  as), in place, keeping the identity of nested containers where the shapes agree."""
  if type(mine) is not type(theirs):
    raise ValueError("the call changed an argument's type")
  if type(mine) is list:
    if len(mine) != len(theirs):
      mine[:] = theirs
      return
    for i, (a, b) in enumerate(zip(mine, theirs)):
      if type(a) is type(b) and type(a) in _CONTAINERS:
        _update_in_place(a, b)
      elif not (type(a) is type(b) and a == b):
        mine[i] = b
  elif type(mine) in _DICTS:
    for k in [k for k in mine if k not in theirs]:
      del mine[k]
    for k, b in theirs.items():
      a = mine.get(k)
      if k in mine and type(a) is type(b) and type(a) in _CONTAINERS:
        _update_in_place(a, b)
      else:
        mine[k] = b
  elif type(mine) is set:
    if mine != theirs:
      mine.clear()
      mine.update(theirs)
  elif type(mine) is collections.deque:
    if list(mine) != list(theirs):
      mine.clear()
      mine.extend(theirs)
  elif type(mine) is tuple:          # immutable itself; the containers in it may have changed
    if len(mine) != len(theirs):
      raise ValueError("the call changed a tuple")
    for a, b in zip(mine, theirs):
      if type(a) is type(b) and type(a) in _CONTAINERS:
        _update_in_place(a, b)


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
