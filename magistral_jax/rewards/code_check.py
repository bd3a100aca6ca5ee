"""Code correctness: the FIRST fenced block of the answer, tagged or not, run against the task's
tests.

Two kinds of test:
  - stdin/stdout pairs (`tests: [{"input", "output"}]`): the output must match the expected one
    token by token, exactly; only where the task gives a `tolerance` do non-integer numbers
    match within it (`outputs_match`). Integers are always exact: a relative tolerance let a
    modular answer plus one, or 10^10 + 1,000, pass.
  - assert tests, HumanEval style (`test_code` defining `check(candidate)` + `entry_point`) or
    MBPP style (`test_list` of assert lines, optional `test_setup_code`). The test code runs in
    OUR process; the candidate's module is loaded in a sandboxed process by _DRIVER, and the test
    code calls its functions through proxies: each call sends the arguments (checked plain, as a
    Python literal) on the child's stdin, and the child answers with the return value as JSON
    (or the exception's name), never pickle. Only plain values cross (_CODEC: None, bool, int,
    float, str, list, tuple, dict, set, frozenset, bytes, complex, of exactly those types);
    anything else, an object with its own __eq__ included, is a failed call. So the comparisons,
    the expected values and the verdict never exist in the candidate's process: exiting early,
    raising, patching builtins, print or sys.stdout, or writing forged answer lines can only make
    calls fail or return values it chose, which pass only if they are the right ones. The verdict
    is "every test statement ran without an exception, and no call into the candidate failed",
    decided here. What the boundary would otherwise hide or change is put back by construction:
      - helpers: the functions the task's own code defines (a HumanEval prompt's `poly` beside
        `find_zero`, `encode_shift` beside `decode_shift`: `test_setup_code`, or for `test_code`
        tasks the prompt less its entry point, data/records.py `prompt_helpers`) run in OUR
        process, so the tests never call a copy the candidate redefined, nor hand the candidate
        the arguments they pass to a helper. For `test_code` tasks the entry point is the only
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
    A stdlib module the solution imported (from a short allowed list, _TEST_MODULES) is imported
    for the tests under the same name.
Limits are CPU seconds; a run stopped at the wall-clock backstop by a loaded host (not by its
own CPU use or idling) raises VerifierFault: no verdict, the group is dropped (rewards/reward.py).
At most `num_tests` tests are drawn with `random.Random(group_seed)`, so every completion of a
group sees the same tests. The reward is binary: all drawn tests must pass.
"""
from __future__ import annotations

import builtins
import dataclasses
import functools
import hashlib
import importlib
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time

from magistral_jax.data.records import prompt_helpers
from magistral_jax.rewards import format as fmt
from magistral_jax.rewards.sandbox import (PRIVATE_FS, Channel, Limits, Sandbox,
                                           interpreter_binds)

LANG_ALIASES = {
  "python": "python", "py": "python", "python3": "python", "py3": "python",
  "cpp": "cpp", "c++": "cpp", "cc": "cpp", "cxx": "cpp", "c++20": "cpp", "c++17": "cpp",
}
CXX_FLAGS = ("-std=c++20", "-O2", "-pipe")

# Plain values to JSON and back, shared (as source) by our process and the sandboxed driver.
# Exact types only: a subclass may override __eq__ (or anything else). Not-plain JSON shapes are
# tagged objects: {"t": [...]} tuple, {"d": [[k, v], ...]} dict, {"s"/"fs": [...]} set/frozenset,
# {"b": hex} bytes, {"c": [re, im]} complex, {"f": "nan"/"inf"/"-inf"} non-finite float.
_CODEC = r'''
import json as _json, math as _math
_MAX_DEPTH = 100
def _enc(x, depth=0):
  if depth > _MAX_DEPTH:
    raise ValueError("nested too deep")
  t = type(x)
  if x is None or t is bool or t is int or t is str:
    return x
  if t is float:
    return x if _math.isfinite(x) else {"f": repr(x)}
  if t is list:
    return [_enc(v, depth + 1) for v in x]
  if t is tuple:
    return {"t": [_enc(v, depth + 1) for v in x]}
  if t is dict:
    return {"d": [[_enc(k, depth + 1), _enc(v, depth + 1)] for k, v in x.items()]}
  if t is set or t is frozenset:
    return {"s" if t is set else "fs": [_enc(v, depth + 1) for v in x]}
  if t is bytes:
    return {"b": x.hex()}
  if t is complex:
    return {"c": [_enc(x.real), _enc(x.imag)]}
  raise TypeError("not a plain value: " + t.__name__)
def _dec(x):
  t = type(x)
  if x is None or t in (bool, int, float, str):
    return x
  if t is list:
    return [_dec(v) for v in x]
  if t is not dict or len(x) != 1:
    raise ValueError("bad value")
  (tag, v), = x.items()
  if tag == "t":
    return tuple(_dec(e) for e in v)
  if tag == "d":
    pairs = [(_dec(k), _dec(e)) for k, e in v]
    _distinct_hashes([k for k, _ in pairs])
    return dict(pairs)
  if tag == "s":
    return set(_distinct_hashes([_dec(e) for e in v]))
  if tag == "fs":
    return frozenset(_distinct_hashes([_dec(e) for e in v]))
  if tag == "b":
    return bytes.fromhex(v)
  if tag == "c":
    return complex(_dec(v[0]), _dec(v[1]))
  if tag == "f" and v in ("nan", "inf", "-inf"):
    return float(v)
  raise ValueError("bad value")
def _distinct_hashes(items, most=8):
  # Elements that share one hash make building a set or dict quadratic (distinct integers with
  # equal hashes are easy to make): refuse more than `most` per hash, checked in linear time.
  if len(items) > most:
    seen = {}
    for h in map(hash, items):
      seen[h] = seen.get(h, 0) + 1
      if seen[h] > most:
        raise ValueError("set or dict keys with colliding hashes")
  return items
def dumps(x):
  return _json.dumps(_enc(x), allow_nan=False, separators=(",", ":"))
def _no_constant(c):
  raise ValueError("bad constant " + c)
def loads(s):
  return _dec(_json.loads(s, parse_constant=_no_constant))
'''

# The driver's JSON writer: the same text as _CODEC's dumps, without importing json (its regexes
# cost ~20 ms per run on a busy host; _json's C string escaper costs nothing).
_WRITER = r'''
import _json
_esc, _INF = _json.encode_basestring_ascii, float("inf")
def write(x, depth=0):
  if depth > 100:
    raise ValueError("nested too deep")
  t, d = type(x), depth + 1
  if x is None:
    return "null"
  if t is bool:
    return "true" if x else "false"
  if t is int:
    return str(x)
  if t is str:
    return _esc(x)
  if t is float:
    return repr(x) if -_INF < x < _INF else '{"f":"%r"}' % x
  if t is list:
    return "[" + ",".join([write(v, d) for v in x]) + "]"
  if t is tuple:
    return '{"t":[' + ",".join([write(v, d) for v in x]) + "]}"
  if t is dict:
    return '{"d":[' + ",".join(["[" + write(k, d) + "," + write(v, d) + "]"
                               for k, v in x.items()]) + "]}"
  if t is set or t is frozenset:
    return '{"%s":[' % ("s" if t is set else "fs") + ",".join([write(v, d) for v in x]) + "]}"
  if t is bytes:
    return '{"b":"' + x.hex() + '"}'
  if t is complex:
    return '{"c":[' + write(x.real) + "," + write(x.imag) + "]}"
  raise TypeError("not a plain value: " + t.__name__)
'''

# The sandboxed side: loads solution.py, then answers calls read from stdin. Our pipes are moved to
# private fds first, so the candidate's prints go to stderr (drained and mostly dropped) and its
# input() sees EOF. A request is a Python literal (id, function, args, kwargs) that we wrote from
# values _CODEC accepted; an answer is one JSON line. Nothing here is secret: the candidate may
# read, patch or replace all of it.
_DRIVER = _WRITER + r'''
import os
_LITERALS = {"__builtins__": {}, "nan": float("nan"), "inf": _INF, "set": set,
             "frozenset": frozenset}
def _main():
  rfd, wfd = os.dup(0), os.dup(1)
  null = os.open("/dev/null", os.O_RDONLY)
  os.dup2(null, 0)
  os.dup2(2, 1)
  rin, wout = os.fdopen(rfd, "rb"), os.fdopen(wfd, "wb")
  ns = {"__name__": "solution", "__builtins__": __builtins__}
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
    rid, fn, args, kwargs = eval(line, _LITERALS)
    before = write([args, kwargs])
    try:
      result = ns[fn](*args, **kwargs)
    except BaseException as e:
      reply('{"id":%d,"err":[%s,%s]}' % (rid, _esc(type(e).__name__), _esc(str(e)[:300])))
      continue
    try:
      # What the caller could see besides the value: the arguments as the call left them (when
      # it changed them), and which argument the result IS, when it is one of them.
      after = write([args, kwargs])
      same = [i for i, a in enumerate(args) if result is a]
      same = same[0] if same else next((k for k, a in kwargs.items() if result is a), None)
      reply('{"id":%d,"ok":%s,"args":%s,"same":%s}' % (
          rid, write(result), "null" if after == before else after,
          "null" if same is None else write(same)))
    except BaseException as e:   # not a plain value: a failed call, not an exception to test for
      reply('{"id":%d,"bad":%s}' % (rid, _esc(str(e)[:300])))
_main()
'''

# A stdin/stdout Python program, run as __main__ by the interpreter that set up the sandbox (see
# Sandbox.run's python_src). An uncaught exception exits non-zero with its traceback, as usual.
_RUN_SOLUTION = """
with open("solution.py", encoding="utf-8") as f:
  src = f.read()
exec(compile(src, "solution.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
"""

_codec: dict = {}
exec(_CODEC, _codec)
encode_value, decode_value, _decode_parsed = _codec["dumps"], _codec["loads"], _codec["_dec"]
_writer: dict = {}
exec(_WRITER, _writer)
driver_write = _writer["write"]     # for the tests: the driver's writer agrees with _CODEC


_TEST_MODULES = frozenset({
    "math", "cmath", "re", "string", "collections", "itertools", "functools", "operator", "heapq",
    "bisect", "fractions", "decimal", "statistics", "copy", "datetime", "random"})


class CandidateError(Exception):
  """A call into the candidate failed: it raised, returned a value that is not plain, died, or
  ran out of time or output. Sticky: once raised, the candidate has failed, whatever the test
  code does with the exception."""


class VerifierFault(Exception):
  """A limit hit on our side, not the program's doing (the wall-clock backstop on an overloaded
  host): the completion gets no verdict, and its group is dropped."""


@dataclasses.dataclass
class CodeResult:
  passed: bool
  detail: str = ""        # why it failed, for logging
  tests_run: int = 0


def task_language(task: dict) -> str:
  """The language a code task's solution must be in: python or cpp (default python)."""
  language = LANG_ALIASES.get(str(task.get("language", "python")).lower())
  if language is None:
    raise ValueError(f"task language must be python or cpp, got {task.get('language')!r}")
  return language


def extract_code_block(answer: str, untagged_language: str | None = None
                       ) -> tuple[str | None, str] | None:
  """(language, code) of the FIRST fenced block of the answer, tagged or not (paper §2 grades the
  first block; that some block carries a tag is the format rule, rewards/format.py). Language
  None when the tag names no language we run. An untagged block is taken to be in
  `untagged_language` (the task's language): the task states the language its solution must be
  in, so the block is run as that, and fails the tests unless it solves the task."""
  block = next(fmt.code_blocks(answer), None)
  if block is None:
    return None
  tag, code = block
  if tag is None:
    return untagged_language, code
  return LANG_ALIASES.get(tag.lower()), code


_INTEGER = re.compile(r"[+-]?\d+")


def _is_number(tok: str) -> float | None:
  try:
    x = float(tok)
  except ValueError:
    return None
  return x if math.isfinite(x) else None


def outputs_match(got: str, expected: str, tolerance: float | None = None) -> bool:
  """Token-by-token comparison, exact. Only where the task gives a `tolerance` (its statement's
  "absolute or relative error at most ..."), a non-integer expected number matches a number
  within it: |got - expected| <= tolerance * max(1, |expected|). An integer is always exact: a
  modular answer off by one is wrong at any size."""
  a, b = got.split(), expected.split()
  if len(a) != len(b):
    return False
  for x, y in zip(a, b):
    if x == y:
      continue
    if tolerance is None or _INTEGER.fullmatch(y):
      return False
    fx, fy = _is_number(x), _is_number(y)
    if fx is None or fy is None or abs(fx - fy) > tolerance * max(1.0, abs(fy)):
      return False
  return True


def task_tolerance(task: dict) -> float | None:
  """The task's numeric tolerance for stdin/stdout answers (None: exact)."""
  tol = task.get("tolerance")
  if tol is None:
    return None
  if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not 0 <= tol < 1:
    raise ValueError(f"task 'tolerance' must be a number in [0, 1), got {tol!r}")
  return float(tol)


def draw_tests(n: int, num_tests: int, group_seed: int) -> list[int]:
  """Indices of the tests to run: the same for every completion sharing `group_seed`."""
  if n <= num_tests:
    return list(range(n))
  return sorted(random.Random(group_seed).sample(range(n), num_tests))


def _write(path: str, text: str):
  with open(path, "w", encoding="utf-8", errors="replace") as f:
    f.write(text)


# ----------------------------------------------------------------------------- C++

@functools.lru_cache(maxsize=None)
def _gxx_version() -> str:
  return subprocess.run(["g++", "--version"], capture_output=True, text=True).stdout.split("\n")[0]


_pch_dirs: dict = {}


def precompiled_header_dir(flags: tuple[str, ...] = CXX_FLAGS) -> str | None:
  """A directory holding `bits/stdc++.h.gch` built with `flags` (built once, then reused).

  g++ looks for `<name>.gch` in each include directory before the header itself, so `-I<dir>`
  is enough. The build runs unsandboxed: its input is the system header, not model output.
  """
  if flags in _pch_dirs:
    return _pch_dirs[flags]
  key = hashlib.sha1(("|".join(flags) + _gxx_version()).encode()).hexdigest()[:12]
  root = os.path.join(tempfile.gettempdir(), "magistral_jax_pch", key)
  gch = os.path.join(root, "bits", "stdc++.h.gch")
  if not os.path.exists(gch):
    try:
      deps = subprocess.run(["g++", *flags, "-x", "c++", "-M", "-"], input="#include <bits/stdc++.h>\n",
                            capture_output=True, text=True, timeout=60).stdout
      header = next(t for t in deps.split() if t.endswith("bits/stdc++.h"))
      os.makedirs(os.path.dirname(root), exist_ok=True)
      tmp = tempfile.mkdtemp(dir=os.path.dirname(root))
      os.makedirs(os.path.join(tmp, "bits"))
      r = subprocess.run(["g++", *flags, "-x", "c++-header", header, "-o",
                          os.path.join(tmp, "bits", "stdc++.h.gch")], capture_output=True, timeout=120)
      if r.returncode != 0:
        raise RuntimeError(r.stderr.decode(errors="replace")[:500])
      os.chmod(tmp, 0o755)
      try:
        os.rename(tmp, root)      # atomic: concurrent builders keep whichever lands first
      except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    except (StopIteration, RuntimeError, OSError, subprocess.SubprocessError):
      _pch_dirs[flags] = None
      return None
  _pch_dirs[flags] = root
  return root


def compile_cpp(sandbox: Sandbox, workdir: str, source: str, timeout_s: float,
                use_pch: bool = True) -> tuple[bool, str]:
  """Compiles `source` to `workdir/prog` inside the sandbox. Returns (ok, message)."""
  _write(os.path.join(workdir, "prog.cpp"), source)
  argv = ["g++", *CXX_FLAGS]
  pch = precompiled_header_dir() if use_pch else None
  binds = []
  if pch:
    # The header dir is bound read-only into the private root (the host's /tmp is not there).
    inside = "/pch" if sandbox.isolation in PRIVATE_FS else pch
    binds.append((pch, inside))
    argv.append(f"-I{inside}")
  argv += ["prog.cpp", "-o", "prog"]
  # tmp_mb: g++ keeps its temporaries in the private /tmp (little with -pipe). timeout_s is CPU
  # seconds per compiler process, so load cannot fail an honest compile; the wall-clock backstop
  # behind it is a verifier fault (VerifierFault) unless the compiler used its CPU or sat idle.
  limits = Limits(cpu_s=timeout_s, memory_mb=2048, file_size_mb=256, nproc=16, nofile=256,
                  max_output_bytes=1 << 20, tmp_mb=256)
  r = sandbox.run(argv, workdir, limits, ro_binds=binds, inputs=[], writable=True)
  if r.fault:
    raise VerifierFault(f"compile: {r.fault}")
  if r.timed_out:
    return False, f"compile timed out ({r.cpu_s:.1f}s CPU of {timeout_s:g}s)"
  if r.returncode != 0:
    return False, "compile error: " + r.stderr.decode(errors="replace")[:300]
  return True, ""


# ----------------------------------------------------------------------------- runners

def _run_stdin_tests(sandbox, workdir, argv, tests, limits, ro_binds=(), python_src=None,
                     inputs=None, tolerance=None) -> CodeResult:
  """One run per test; the output is compared here, in our process, to the expected one."""
  for k, t in enumerate(tests):
    r = sandbox.run(argv, workdir, limits, ro_binds=ro_binds, python_src=python_src,
                    stdin=str(t["input"]).encode("utf-8", errors="replace"), inputs=inputs)
    if r.fault:
      raise VerifierFault(f"test {k}: {r.fault}")
    if r.timed_out:
      return CodeResult(False, f"test {k}: time limit", k + 1)
    if r.output_truncated:
      return CodeResult(False, f"test {k}: output limit", k + 1)
    if r.returncode != 0:
      return CodeResult(False, f"test {k}: exit code {r.returncode}: "
                        + r.stderr.decode(errors="replace")[-200:], k + 1)
    if not outputs_match(r.stdout.decode("utf-8", errors="replace"), str(t["output"]), tolerance):
      return CodeResult(False, f"test {k}: wrong answer", k + 1)
  return CodeResult(True, "", len(tests))


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

  def call(self, fn: str, args: tuple, kwargs: dict):
    try:
      return self._call(fn, args, kwargs)
    except CandidateError as e:
      self.failures.append(str(e))
      raise

  def _call(self, fn: str, args: tuple, kwargs: dict):
    self.calls += 1
    try:
      # Checked plain (exact types), then sent as a Python literal the driver can eval without
      # builtins; the arguments are the tests' (ours), never the candidate's.
      sent_args, sent_kwargs = decode_value(encode_value([list(args), dict(kwargs)]))
      req = repr((self.calls, fn, sent_args, sent_kwargs)).encode()
    except (TypeError, ValueError) as e:
      raise CandidateError(f"argument not passable as plain data: {e}") from None
    try:
      msg = self._parse(self.channel.request(req))
    except Channel.Closed as e:
      raise self._closed(e, f"call {fn}") from None
    if msg.get("id") != self.calls:
      raise CandidateError("answer out of sequence")
    if "ok" in msg:
      try:
        value = _decode_parsed(msg["ok"])
        if msg.get("args") is not None:
          new_args, new_kwargs = _decode_parsed(msg["args"])
          _update_in_place(list(args), new_args)
          _update_in_place(dict(kwargs), new_kwargs)
      except (TypeError, ValueError, KeyError, IndexError, RecursionError) as e:
        raise CandidateError(f"bad return value: {type(e).__name__}: {e}") from None
      same = msg.get("same")
      if type(same) is int and 0 <= same < len(args):
        return args[same]
      if type(same) is str and same in kwargs:
        return kwargs[same]
      return value
    if "bad" in msg:
      raise CandidateError(f"returned a value that is not plain data: {str(msg['bad'])[:200]}")
    err = msg.get("err")
    if isinstance(err, list) and len(err) == 2 and all(isinstance(x, str) for x in err):
      # Never re-raised as itself: a StopIteration would silently end a map() or zip() in the
      # test, and any exception could be caught by the test's own handlers.
      raise CandidateError(f"raised {err[0]}: {err[1]}")
    raise CandidateError("garbled answer")

  def proxy(self, fn: str):
    def call(*args, **kwargs):
      return self.call(fn, args, kwargs)
    call.__name__ = call.__qualname__ = fn
    return call


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
      if type(a) is type(b) and type(a) in (list, dict, set, tuple):
        _update_in_place(a, b)
      elif not (type(a) is type(b) and a == b):
        mine[i] = b
  elif type(mine) is dict:
    for k in [k for k in mine if k not in theirs]:
      del mine[k]
    for k, b in theirs.items():
      a = mine.get(k)
      if k in mine and type(a) is type(b) and type(a) in (list, dict, set, tuple):
        _update_in_place(a, b)
      else:
        mine[k] = b
  elif type(mine) is set:
    if mine != theirs:
      mine.clear()
      mine.update(theirs)
  elif type(mine) is tuple:          # immutable itself; the containers in it may have changed
    if len(mine) != len(theirs):
      raise ValueError("the call changed a tuple")
    for a, b in zip(mine, theirs):
      if type(a) is type(b) and type(a) in (list, dict, set, tuple):
        _update_in_place(a, b)


def _run_assert_tests(sandbox, workdir, python, code, test_src, entry_point, limits,
                      setup_src: str = "") -> CodeResult:
  """Runs the assert tests in OUR process against the candidate in a sandboxed one (see the module
  docstring): passed only if every test statement ran without raising and no call into the
  candidate failed. `setup_src` (the task's own helpers) runs here first; with an
  `entry_point` (HumanEval), the entry point is the only name that reaches the candidate."""
  _write(os.path.join(workdir, "solution.py"), code)
  exe, binds = interpreter_binds(python)
  # One process serves all calls, so the backstop covers the whole test program.
  start = time.monotonic()
  proc = sandbox.start([exe], workdir, limits, ro_binds=binds, python_src=_DRIVER,
                       inputs=["solution.py"])
  channel = Channel(proc, start, limits)
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
    try:
      # The task's helpers and tests define their names over the candidate's: a helper the tests
      # call is the prompt's, run here, never the candidate's copy of it.
      exec(compile(setup_src + "\n" + test_src, "tests.py", "exec"), ns)
      if entry_point:
        if entry_point not in cand.names:
          return CodeResult(False, f"entry point {entry_point!r} not defined", 1)
        ns["check"](cand.proxy(entry_point))
    except VerifierFault:
      raise
    except CandidateError as e:
      return CodeResult(False, f"call failed: {e}: "
                        + bytes(channel.err).decode(errors="replace")[-200:], 1)
    except Exception as e:   # AssertionError and whatever a wrong value makes the tests raise
      return CodeResult(False, f"test failed: {type(e).__name__}: {str(e)[:200]}", 1)
    if cand.failures:          # a failed call that the test code caught and went on from
      return CodeResult(False, f"call failed: {cand.failures[0][:300]}", 1)
    return CodeResult(True, "", 1)
  except CandidateError as e:
    return CodeResult(False, str(e), 1)
  finally:
    channel.close()


def check_code(task: dict, language: str | None, code: str, *, sandbox: Sandbox, num_tests: int,
               test_timeout_s: float, memory_mb: int, compile_timeout_s: float, python: str,
               group_seed: int = 0) -> CodeResult:
  """Runs the candidate `code` on the task's tests; passed only if every drawn test passes."""
  want = task_language(task)
  if language != want:
    return CodeResult(False, f"code block language {language!r} does not match task {want!r}")
  limits = Limits(cpu_s=test_timeout_s, memory_mb=memory_mb)
  workdir = sandbox.make_dir()
  try:
    if "tests" in task:
      tests = task["tests"]
      if not isinstance(tests, list) or not tests or not all(
          isinstance(t, dict) and "input" in t and "output" in t for t in tests):
        raise ValueError("task 'tests' must be a non-empty list of {input, output} objects")
      chosen = [tests[i] for i in draw_tests(len(tests), num_tests, group_seed)]
      tolerance = task_tolerance(task)
      if want == "cpp":
        ok, msg = compile_cpp(sandbox, workdir, code, compile_timeout_s)
        if not ok:
          return CodeResult(False, msg)
        argv, binds, src, inputs = ["./prog"], [], None, ["prog"]
      else:
        _write(os.path.join(workdir, "solution.py"), code)
        exe, binds = interpreter_binds(python)
        argv, src, inputs = [exe], _RUN_SOLUTION, ["solution.py"]
      return _run_stdin_tests(sandbox, workdir, argv, chosen, limits, binds, src, inputs,
                              tolerance)
    if want != "python":
      raise ValueError("assert tests (test_code / test_list) are Python only")
    setup = str(task.get("test_setup_code") or "")
    if "test_code" in task:
      entry = task.get("entry_point")
      if not entry or not isinstance(entry, str):
        raise ValueError("task with 'test_code' needs 'entry_point'")
      # HumanEval: the helpers the prompt defines come from the prompt (when no setup is given).
      setup = setup or prompt_helpers(str(task.get("problem", "")), entry) or ""
      return _run_assert_tests(sandbox, workdir, python, code, str(task["test_code"]), entry,
                               limits, setup)
    if "test_list" in task:
      asserts = list(task["test_list"])
      if not asserts:
        raise ValueError("task 'test_list' is empty")
      chosen = [asserts[i] for i in draw_tests(len(asserts), num_tests, group_seed)]
      return _run_assert_tests(sandbox, workdir, python, code, "\n".join(chosen) + "\n", None,
                               limits, setup)
    raise ValueError("code task needs 'tests', 'test_code' + 'entry_point', or 'test_list'")
  finally:
    sandbox.remove_dir(workdir)


def default_python() -> str:
  """An interpreter the sandbox uid can execute (our venv may live under a private home)."""
  for p in ("/usr/bin/python3", "/usr/local/bin/python3"):
    if os.access(p, os.X_OK):
      return p
  return sys.executable
