"""Typed config dataclasses <-> ml_collections ConfigDicts.

A dataclass is the one place a section's defaults are written (`config_section` turns it into the
ConfigDict section of the run config); `checked_fields` turns the section back into the
dataclass's keyword arguments.
"""
from __future__ import annotations

import dataclasses
import typing
from typing import Any, Mapping

import ml_collections as mlc

_SCALARS = (bool, int, float, str)


def as_tuples(value):
  """`value` with every list, at any depth, made a tuple: a config written to JSON and read back
  has lists where the config had tuples (every sequence field of the run config is a tuple, so
  that absl flags can override it)."""
  if isinstance(value, (list, tuple)):
    return tuple(as_tuples(v) for v in value)
  if isinstance(value, dict):
    return {k: as_tuples(v) for k, v in value.items()}
  return value


def checked_fields(cls, cd: Mapping[str, Any], what: str) -> dict:
  """The mapping as a dict of `cls`'s fields (lists made tuples); any other key is an error
  naming it."""
  d = dict(cd.to_dict() if hasattr(cd, "to_dict") else cd)
  valid = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(d) - valid)
  if unknown:
    raise ValueError(f"unknown {what} config field(s): {unknown}; valid: {sorted(valid)}")
  return {k: as_tuples(v) for k, v in d.items()}


def _optional_scalar(hint) -> type | None:
  """T for a `T | None` annotation with T a scalar type; None otherwise."""
  args = typing.get_args(hint)
  if len(args) == 2 and type(None) in args:
    (t,) = [a for a in args if a is not type(None)]
    return t if t in _SCALARS else None
  return None


def config_section(cls) -> mlc.ConfigDict:
  """A ConfigDict of every field of the dataclass `cls` at its default. An optional scalar field
  (`float | None`, ...) becomes a FieldReference typed with its scalar type, so a flag override
  can set a value where the default is None (`--config.rl.dual_clip_c=3.0`) and a recipe can
  still set None."""
  hints = typing.get_type_hints(cls)
  instance = cls()
  out = {}
  for f in dataclasses.fields(cls):
    value = getattr(instance, f.name)
    scalar = _optional_scalar(hints[f.name])
    out[f.name] = mlc.FieldReference(value, field_type=scalar) if scalar else value
  return mlc.ConfigDict(out)
