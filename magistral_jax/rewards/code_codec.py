"""Plain values across the sandbox boundary of the assert harness (rewards/code_asserts.py): the
codec our process and the sandboxed driver share as source, and the driver's JSON writer.

Only plain values cross, of exactly these types: None, bool, int, float, str, list, tuple, dict,
set, frozenset, bytes, complex; anything else (an object with its own __eq__ included) is refused.
Decoding is linear: sets and dict keys whose hashes collide are refused.
"""
from __future__ import annotations

# Plain values to JSON and back, shared (as source) by our process and the sandboxed driver.
# Exact types only: a subclass may override __eq__ (or anything else). Not-plain JSON shapes are
# tagged objects: {"t": [...]} tuple, {"d": [[k, v], ...]} dict, {"s"/"fs": [...]} set/frozenset,
# {"b": hex} bytes, {"c": [re, im]} complex, {"f": "nan"/"inf"/"-inf"} non-finite float.
CODEC = r'''
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

# The driver's JSON writer: the same text as CODEC's dumps, without importing json (importing its
# regexes is a cost every run pays on a busy host; _json's C string escaper is built in).
WRITER = r'''
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

_codec: dict = {}
exec(CODEC, _codec)
encode_value, decode_value, decode_parsed = _codec["dumps"], _codec["loads"], _codec["_dec"]
_writer: dict = {}
exec(WRITER, _writer)
driver_write = _writer["write"]     # for the tests: the driver's writer agrees with CODEC
