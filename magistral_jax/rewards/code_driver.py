"""The sandboxed side of the function-call harness (rewards/code_asserts.py is ours): the program
that loads the candidate's solution as a module and answers calls, one request line in, one JSON
answer line out. It runs in the candidate's process, so nothing in it is trusted or secret: the
candidate may read, patch or replace all of it, and can only make its own answers wrong.
"""
from magistral_jax.rewards.code_codec import UPDATE, WRITER

# The sandboxed side: loads solution.py, then answers calls read from stdin. Our pipes are moved to
# private fds first, so the candidate's prints go to stderr (drained and mostly dropped) and its
# input() sees EOF. A request is a Python literal (id, function, args, kwargs) that we wrote from
# values CODEC accepted; an answer is one JSON line. Nothing here is secret: the candidate may
# read, patch or replace all of it.
DRIVER = WRITER + UPDATE + r'''
import os, sys, collections as _co
_LITERALS = {"__builtins__": {}, "nan": float("nan"), "inf": _INF, "set": set,
             "frozenset": frozenset, "float": float, "complex": complex, "Counter": _co.Counter,
             "deque": _co.deque, "OrderedDict": _co.OrderedDict, "defaultdict": _co.defaultdict,
             "None": None, "int": int, "str": str, "bytes": bytes, "list": list, "dict": dict,
             "tuple": tuple, "bool": bool}
_handles = []
_LITERALS["_H"] = _handles.__getitem__
# Shared containers (code_asserts: _Candidate.mirror): number -> our copy, and the text of it the
# other side last saw. Ours are odd, the caller's even.
_mirror, _mirror_ids, _mirror_text, _next_odd = {}, {}, {}, [1]
def _share(n, x):
  _mirror[n], _mirror_ids[id(x)], _mirror_text[n] = x, n, write(x, 0, _state_hook)
  return x
_LITERALS["_S"], _LITERALS["_N"] = _mirror.__getitem__, _share
def _sync_out():
  # The shared containers this call changed, as [number, value] pairs.
  out = []
  for n, x in list(_mirror.items()):
    try:
      t = write(x, 0, _state_hook)
    except Exception:
      continue
    if t != _mirror_text[n]:
      _mirror_text[n] = t
      out.append("[%d,%s]" % (n, t))
  return "[" + ",".join(out) + "]"
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
    rid, target, args, kwargs, sync, drop = eval(line, _LITERALS)
    for n in drop:
      x = _mirror.pop(n, None)
      _mirror_ids.pop(id(x), None)
      _mirror_text.pop(n, None)
    for n, value in sync:
      update_in_place(_mirror[n], value)
      _mirror_text[n] = write(_mirror[n], 0, _state_hook)
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
      reply('{"id":%d,"err":[%s,%s,%s],"sync":%s}' % (
          rid, _esc(type(e).__name__), _esc(str(e)[:300]), _esc(base), _sync_out()))
      continue
    busy = set()
    def hook(x):
      if id(x) in busy:
        return None
      # A container of the arguments: the caller's own object, as it is now; a function or an
      # iterator: a handle the caller calls or iterates through us.
      hit = refs.get(id(x))
      if hit is not None and hit[0] is x:
        return '{"r":[[' + hit[1] + "]," + write(x) + "]}"
      n = _mirror_ids.get(id(x))
      if n is None and x is result and type(x) in _MUTABLE:
        n = _next_odd[0]
        _next_odd[0] += 2
        _share(n, x)
      if n is not None and _mirror.get(n) is x:
        busy.add(id(x))       # its own contents are written with this hook, not as a tag again
        try:
          return '{"S":[%d,%s]}' % (n, write(x, 0, hook))
        finally:
          busy.discard(id(x))
      if type(x) in _MUTABLE or type(x) in (tuple, frozenset, bytes, complex):
        return None
      return _handle(x)
    try:
      # What the caller could see besides the value: the arguments as the call left them (when
      # it changed them), and which of its objects the result is or holds.
      after = write([args, kwargs], 0, _state_hook)
      reply('{"id":%d,"ok":%s,"args":%s,"sync":%s}' % (
          rid, write(result, 0, hook), "null" if after == before else after, _sync_out()))
    except BaseException as e:   # not a plain value: a failed call, not an exception to test for
      reply('{"id":%d,"bad":%s}' % (rid, _esc(str(e)[:300])))
_main()
'''
