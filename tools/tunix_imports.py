"""Which distributions the tunix side really imports: runs bench/peers/tunix_side.py (same
arguments) and, when it exits, writes the top-level modules in sys.modules and the installed
distributions that provide them to --imports_out (JSON), one record per distribution with its
version. Run under a venv with tunix's whole requirements closure (bench/peers/setup_tunix.sh):

    bench/peers/.venv-tunix/bin/python tools/tunix_imports.py --imports_out=imports.json \
        --spec=WORKDIR/spec.json

This is how tools/tunix-carry.txt (what tools/tunix_bundle.py carries to a GPU host, beyond
what the host has) was chosen. Standard library only."""
from __future__ import annotations

import atexit
import importlib.metadata as md
import json
import os
import runpy
import sys

PEERS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "peers")


def imported_distributions(modules) -> dict:
  """{distribution: {"version": v, "modules": [top-level module, ...]}}: the installed
  distributions whose files the imported `modules` (name -> module) were loaded from (so a
  namespace package such as google.* counts only the distributions whose parts were imported;
  the standard library's modules are in none)."""
  owner = {}
  for dist in md.distributions():
    for f in dist.files or ():
      if f.suffix in (".py", ".so", ".pyc") or ".so" in f.suffixes:
        owner[os.path.realpath(dist.locate_file(f))] = dist.metadata["Name"]
  out: dict = {}
  for name, mod in list(modules.items()):
    path = getattr(mod, "__file__", None)
    dist = owner.get(os.path.realpath(path)) if path else None
    if dist is None:
      continue
    rec = out.setdefault(dist, {"version": _version(dist), "modules": set()})
    rec["modules"].add(name.split(".")[0])
  return {k: {"version": v["version"], "modules": sorted(v["modules"])}
          for k, v in sorted(out.items(), key=lambda kv: kv[0].lower())}


def _version(dist):
  try:
    return md.version(dist)
  except md.PackageNotFoundError:
    return None


def main(argv):
  out_path = None
  rest = []
  for a in argv:
    if a.startswith("--imports_out="):
      out_path = a.split("=", 1)[1]
    else:
      rest.append(a)
  if not out_path:
    raise SystemExit("usage: tunix_imports.py --imports_out=FILE [tunix_side.py's arguments]")

  def dump():
    with open(out_path, "w") as f:
      json.dump({"python": sys.version.split()[0],
                 "distributions": imported_distributions(dict(sys.modules))}, f, indent=1)
  atexit.register(dump)
  sys.path.insert(0, PEERS)
  sys.argv = [os.path.join(PEERS, "tunix_side.py")] + rest
  runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
  main(sys.argv[1:])
