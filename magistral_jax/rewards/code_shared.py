"""What the function-call harness (rewards/code_asserts.py) keeps of the candidate's objects on our
side: a container both sides hold (Shared, kept in step call by call), a function or iterator it
returned (Remote: used through calls into its process), and the caller's own object a reference
names (at_path).
"""
from __future__ import annotations

import collections

from magistral_jax.rewards.code_codec import CONTAINERS, decode_parsed


class Shared:
  """A container both sides hold, in a request: the driver's copy (value None) or a new one."""

  def __init__(self, n: int, value):
    self.n, self.value = n, value


MUTABLE = (list, dict, set, collections.Counter, collections.OrderedDict,
           collections.defaultdict, collections.deque)


class Remote:
  """Something the candidate returned that is not data: used through calls into its process."""

  def __init__(self, cand, n: int):
    self.cand, self.n = cand, n


class RemoteFunction(Remote):
  def __call__(self, *args, **kwargs):
    return self.cand.call(("call", self.n), args, kwargs)


class RemoteIterator(Remote):
  def __iter__(self):
    return self

  def __next__(self):
    return self.cand.call(("next", self.n), (), {})


def at_path(args: tuple, kwargs: dict, path: list):
  """The caller's object at `path` (the driver's: an argument's position or keyword, then list
  indices and {"key": k} dict keys) in the arguments as they were before the call."""
  obj = args[path[0]] if type(path[0]) is int else kwargs[path[0]]
  for step in path[1:]:
    if type(obj) not in CONTAINERS:
      raise ValueError("bad reference")
    obj = obj[decode_parsed(step["key"])] if type(step) is dict else obj[step]
  if type(obj) not in CONTAINERS:
    raise ValueError("bad reference")
  return obj
