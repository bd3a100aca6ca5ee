"""Plain values across the sandbox boundary of the assert harness (rewards/code_asserts.py): the
codec our process and the sandboxed driver share as source, and the driver's JSON writer.

Only plain values cross, of exactly these types: None, bool, int, float, str, list, tuple, dict,
set, frozenset, bytes, complex, and collections' Counter, OrderedDict, deque and defaultdict (of
a builtin type's factory); anything else (an object with its own __eq__ included) is refused.
Values nest at most 180 deep; big ints cross in hex. Decoding is linear: sets and dict keys whose
hashes collide are refused, and ints are parsed in base 16.
"""
from __future__ import annotations

import collections

# Plain values to JSON and back (our side: checking and decoding).
# Exact types only: a subclass may override __eq__ (or anything else). Not-plain JSON shapes are
# tagged objects: {"t": [...]} tuple, {"d": [[k, v], ...]} dict, {"s"/"fs": [...]} set/frozenset,
# {"b": hex} bytes, {"c": [re, im]} complex, {"f": "nan"/"inf"/"-inf"} non-finite float.
CODEC = r"""
import collections as _co, json as _json, math as _math
_MAX_DEPTH = 180
_BIG_BITS = 4096
_FACTORIES = {f.__name__: f for f in (int, float, str, bytes, list, dict, set, frozenset, tuple,
                                      bool)}
def _enc(x, depth=0):
  if depth > _MAX_DEPTH:
    raise ValueError("nested too deep")
  t, d = type(x), depth + 1
  if x is None or t is bool or t is str:
    return x
  if t is int:
    return x if x.bit_length() <= _BIG_BITS else {"i": "%x" % x}
  if t is float:
    return x if _math.isfinite(x) else {"f": repr(x)}
  if t is list:
    return [_enc(v, d) for v in x]
  if t is tuple:
    return {"t": [_enc(v, d) for v in x]}
  if t is dict:
    return {"d": [[_enc(k, d), _enc(v, d)] for k, v in x.items()]}
  if t is set or t is frozenset:
    return {"s" if t is set else "fs": [_enc(v, d) for v in x]}
  if t is bytes:
    return {"b": x.hex()}
  if t is complex:
    return {"c": [_enc(x.real), _enc(x.imag)]}
  if t is _co.Counter or t is _co.OrderedDict:
    return {"C" if t is _co.Counter else "O": [[_enc(k, d), _enc(v, d)] for k, v in x.items()]}
  if t is _co.defaultdict:
    f = x.default_factory
    if f is not None and _FACTORIES.get(getattr(f, "__name__", None)) is not f:
      raise TypeError("defaultdict with a factory that is not a builtin type")
    return {"D": [f and f.__name__, [[_enc(k, d), _enc(v, d)] for k, v in x.items()]]}
  if t is _co.deque:
    return {"q": [[_enc(v, d) for v in x], x.maxlen]}
  raise TypeError("not a plain value: " + t.__name__)
def _pairs(v, hook=None):
  pairs = [(_dec(k, hook), _dec(e, hook)) for k, e in v]
  _distinct_hashes([k for k, _ in pairs])
  return pairs
def _dec(x, hook=None):
  # hook(tag, v): decodes the tags it knows (code_asserts: references, remote handles).
  t = type(x)
  if x is None or t in (bool, int, float, str):
    return x
  if t is list:
    return [_dec(v, hook) for v in x]
  if t is not dict or len(x) != 1:
    raise ValueError("bad value")
  (tag, v), = x.items()
  if hook is not None and tag in ("r", "fn", "it", "S"):
    return hook(tag, v)
  if tag == "t":
    return tuple(_dec(e, hook) for e in v)
  if tag == "d":
    return dict(_pairs(v, hook))
  if tag == "s":
    return set(_distinct_hashes([_dec(e, hook) for e in v]))
  if tag == "fs":
    return frozenset(_distinct_hashes([_dec(e, hook) for e in v]))
  if tag == "b":
    return bytes.fromhex(v)
  if tag == "c":
    return complex(_dec(v[0]), _dec(v[1]))
  if tag == "f" and v in ("nan", "inf", "-inf"):
    return float(v)
  if tag == "i" and type(v) is str:
    return int(v, 16)          # base 16: linear, and past the decimal digit limit
  if tag == "C":
    return _co.Counter(dict(_pairs(v, hook)))
  if tag == "O":
    return _co.OrderedDict(_pairs(v, hook))
  if tag == "D":
    if v[0] is not None and v[0] not in _FACTORIES:
      raise ValueError("bad defaultdict factory")
    return _co.defaultdict(v[0] and _FACTORIES[v[0]], _pairs(v[1], hook))
  if tag == "q":
    return _co.deque([_dec(e, hook) for e in v[0]], v[1])
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
"""

# The driver's JSON writer: the same text as CODEC's dumps, without importing json (importing its
# regexes is a cost every run pays on a busy host; _json's C string escaper is built in).
# `hook(x)`, where given, sees every value that is not a scalar first: its text stands for x
# when it returns one (code_asserts: a reference to an argument, a remote handle).
WRITER = r"""
import _json
_esc, _INF = _json.encode_basestring_ascii, float("inf")
_BUILTIN_TYPES = (int, float, str, bytes, list, dict, set, frozenset, tuple, bool)
def _pairs_text(x, d, hook):
  return ",".join(["[" + write(k, d, hook) + "," + write(v, d, hook) + "]" for k, v in x.items()])
def write(x, depth=0, hook=None):
  if depth > 180:
    raise ValueError("nested too deep")
  t, d = type(x), depth + 1
  if x is None:
    return "null"
  if t is bool:
    return "true" if x else "false"
  if t is int:
    return str(x) if x.bit_length() <= 4096 else '{"i":"%x"}' % x
  if t is str:
    return _esc(x)
  if t is float:
    return repr(x) if -_INF < x < _INF else '{"f":"%r"}' % x
  if hook is not None:
    h = hook(x)
    if h is not None:
      return h
  if t is list:
    return "[" + ",".join([write(v, d, hook) for v in x]) + "]"
  if t is tuple:
    return '{"t":[' + ",".join([write(v, d, hook) for v in x]) + "]}"
  if t is dict:
    return '{"d":[' + _pairs_text(x, d, hook) + "]}"
  if t is set or t is frozenset:
    return ('{"%s":[' % ("s" if t is set else "fs") + ",".join([write(v, d, hook) for v in x])
            + "]}")
  if t is bytes:
    return '{"b":"' + x.hex() + '"}'
  if t is complex:
    return '{"c":[' + write(x.real) + "," + write(x.imag) + "]}"
  if t.__module__ == "collections":
    n = t.__name__
    if n == "Counter" or n == "OrderedDict":
      return '{"%s":[' % n[0] + _pairs_text(x, d, hook) + "]}"
    if n == "defaultdict":
      f = x.default_factory
      if f is not None and f not in _BUILTIN_TYPES:
        raise TypeError("defaultdict with a factory that is not a builtin type")
      return ('{"D":[' + ("null" if f is None else _esc(f.__name__)) + ",["
              + _pairs_text(x, d, hook) + "]]}")
    if n == "deque":
      return ('{"q":[[' + ",".join([write(v, d, hook) for v in x]) + "],"
              + ("null" if x.maxlen is None else str(x.maxlen)) + "]}")
  raise TypeError("not a plain value: " + t.__name__)
"""


def literal(x, handle=None, depth: int = 0) -> str:
  """A Python literal of a value CODEC accepts, for the driver to eval with its _LITERALS (no
  builtins): repr where it is linear, hex for big ints (whose decimal repr is quadratic, and
  refused past the digit limit). `handle(x)`: the text for a value of no plain type (a remote
  handle of code_asserts), or None; without, such a value raises TypeError."""
  if depth > 180:
    raise ValueError("nested too deep")
  t, d = type(x), depth + 1
  lit = lambda v: literal(v, handle, d)
  if t is int:
    return repr(x) if x.bit_length() <= 4096 else hex(x)
  if t is float:
    return repr(x) if x == x and abs(x) != float("inf") else f"float({repr(x)!r})"
  if x is None or t is bool or t is str or t is bytes:
    return repr(x)
  if t is complex:
    return f"complex({lit(x.real)}, {lit(x.imag)})"
  if t is list:
    return "[" + ", ".join(map(lit, x)) + "]"
  if t is tuple:
    return "(" + "".join(lit(v) + ", " for v in x) + ")"
  if t is dict:
    return "{" + ", ".join(f"{lit(k)}: {lit(v)}" for k, v in x.items()) + "}"
  if t is set or t is frozenset:
    return f"{t.__name__}([" + ", ".join(map(lit, x)) + "])"
  if t is collections.defaultdict:
    f = x.default_factory
    if f is not None and f not in _BUILTIN_FACTORIES:
      raise TypeError("defaultdict with a factory that is not a builtin type")
    return f"defaultdict({'None' if f is None else f.__name__}, {lit(dict(x))})"
  if t is collections.deque:
    return f"deque({lit(list(x))}, {x.maxlen!r})"
  if t is collections.Counter or t is collections.OrderedDict:
    return f"{t.__name__}({lit(dict(x))})"
  h = handle(x) if handle is not None else None
  if h is None:
    raise TypeError("not a plain value: " + t.__name__)
  return h


_BUILTIN_FACTORIES = (int, float, str, bytes, list, dict, set, frozenset, tuple, bool)

# Bringing one side's containers up to date with the other's, in place: shared (as source) by our
# process and the sandboxed driver (code_driver.py), which both apply the other side's changes.
UPDATE = r"""
import collections as _co
CONTAINERS = (list, tuple, dict, set, _co.Counter, _co.OrderedDict, _co.defaultdict, _co.deque)
_DICTS = (dict, _co.Counter, _co.OrderedDict, _co.defaultdict)
def update_in_place(mine, theirs):
  # Makes the containers `mine` equal to `theirs` (what the other side left its copies as), in
  # place, keeping the identity of nested containers where the shapes agree.
  if type(mine) is not type(theirs):
    raise ValueError("the call changed an argument's type")
  if type(mine) is list:
    if len(mine) != len(theirs):
      mine[:] = theirs
      return
    for i, (a, b) in enumerate(zip(mine, theirs)):
      if type(a) is type(b) and type(a) in CONTAINERS:
        update_in_place(a, b)
      elif not (type(a) is type(b) and a == b):
        mine[i] = b
  elif type(mine) in _DICTS:
    for k in [k for k in mine if k not in theirs]:
      del mine[k]
    for k, b in theirs.items():
      a = mine.get(k)
      if k in mine and type(a) is type(b) and type(a) in CONTAINERS:
        update_in_place(a, b)
      else:
        mine[k] = b
  elif type(mine) is set:
    if mine != theirs:
      mine.clear()
      mine.update(theirs)
  elif type(mine) is _co.deque:
    if list(mine) != list(theirs):
      mine.clear()
      mine.extend(theirs)
  elif type(mine) is tuple:          # immutable itself; the containers in it may have changed
    if len(mine) != len(theirs):
      raise ValueError("the call changed a tuple")
    for a, b in zip(mine, theirs):
      if type(a) is type(b) and type(a) in CONTAINERS:
        update_in_place(a, b)
"""


_codec: dict = {}
exec(CODEC, _codec)
encode_value, decode_value, decode_parsed = _codec["dumps"], _codec["loads"], _codec["_dec"]
_writer: dict = {}
exec(WRITER, _writer)
driver_write = _writer["write"]     # for the tests: the driver's writer agrees with CODEC
_update: dict = {}
exec(UPDATE, _update)
update_in_place, CONTAINERS = _update["update_in_place"], _update["CONTAINERS"]
