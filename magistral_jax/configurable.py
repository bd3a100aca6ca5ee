"""Typed config dataclasses from ml_collections ConfigDicts (or plain mappings)."""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping


def checked_fields(cls, cd: Mapping[str, Any], what: str) -> dict:
  """The mapping as a dict of `cls`'s fields; any other key is an error naming it."""
  d = dict(cd.to_dict() if hasattr(cd, "to_dict") else cd)
  valid = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(d) - valid)
  if unknown:
    raise ValueError(f"unknown {what} config field(s): {unknown}; valid: {sorted(valid)}")
  return d
