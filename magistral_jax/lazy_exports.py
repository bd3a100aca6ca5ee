"""A package's public names, imported on first use (PEP 562).

A package's `__init__.py` hands on the names of its modules; importing them all eagerly would
make `import magistral_jax.pipeline.config` (a plain dataclass) load the whole pipeline, JAX and
the verifiers with it. magistral_jax/config.py imports every section's config module, and must
stay below the code that uses config, so the packages' faces resolve their names lazily.
"""
from __future__ import annotations

import importlib
from typing import Callable, Mapping, Sequence


def lazy_exports(package: str, modules: Mapping[str, Sequence[str]]
                 ) -> tuple[Callable[[str], object], list[str]]:
  """(`__getattr__`, `__all__`) for `package`'s __init__.py: each name of `modules` (module
  path relative to the package -> names) is imported from its module when first asked for."""
  where = {name: f"{package}.{module}" for module, names in modules.items() for name in names}

  def __getattr__(name: str):
    if name not in where:
      raise AttributeError(f"module {package!r} has no attribute {name!r}")
    return getattr(importlib.import_module(where[name]), name)

  return __getattr__, sorted(where)
