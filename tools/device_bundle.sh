#!/usr/bin/env bash
# Builds the folder that carries the project's runtime onto a lent GPU machine (issue #51): it has
# Python 3.12 with JAX (CUDA), flax, optax, orbax, torch and transformers, and no network. What it
# lacks travels as wheels; the shipped SmolLM2 GGUF travels in parts small enough for one call
# each (the device tool carries 64 MiB a call). `bash bench/gpu_suite.sh stage` there installs
# the wheels and joins the parts (checked against their sha256) as they arrive.
#
#   tools/device_bundle.sh [OUTDIR]          (default: device_bundle/, git-ignored)
#
# OUTDIR/whl/*.whl       pinned by requirements.txt and constraints.txt, for cp312 manylinux
#                        x86_64, less what tools/device_has.txt lists (the image's own are used)
#                        and SKIP
# OUTDIR/gguf.partNN     the GGUF split into PART_MB MiB parts (default 42), gguf.sha256
# OUTDIR/MANIFEST        every file with its sha256 and size, sorted: two builds from the same
#                        pins give the same manifest, so a bundle is checked, not trusted
# Carry OUTDIR/whl and gguf.part00 (with the MANIFEST and sha256) in the first call, each further
# part in its own call (bench/gpu_suite.sh's header shows the calls).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-device_bundle}
# 42 MiB: the working tree (~8 MB, the GSM8K train split in it) + the wheels (~12 MB) + one part
# stay under the 64 MiB a call carries; the second call carries the other two parts.
PART_MB=${PART_MB:-42}
# Left behind with their dependencies: mistral-common (Mistral's Tekken tokenizer, its pydantic
# stack and pycountry, ~20 MB) serves the Mistral recipes, not SmolLM2's. SKIP="" carries it.
SKIP=${SKIP-mistral-common}
PY=${PYTHON:-.venv/bin/python}
PLATFORMS="manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64"
norm() { tr 'A-Z_.' 'a-z--'; }
have=" $(grep -v '^#' tools/device_has.txt | tr '\n' ' ' | norm) "
skip=" $(echo "$SKIP" | norm) "
rm -rf "$out" && mkdir -p "$out/whl" "$out/.dl"
# The project's pins, less what the machine has: the rest goes, with its dependencies.
while read -r req; do
  name=$(echo "${req%%==*}" | norm)
  case "$have$skip" in *" $name "*) ;; *) echo "$req";; esac
done < <(grep -E '^[A-Za-z0-9_.-]+==' requirements.txt) > "$out/.dl/requirements.txt"
# promise (a tensorflow-datasets dependency) is published as a source archive only.
"$PY" -m pip wheel -q --no-deps "$(grep -i '^promise==' constraints.txt)" -w "$out/.dl"
plat_args=()
for p in $PLATFORMS; do plat_args+=(--platform "$p"); done
"$PY" -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  "${plat_args[@]}" --find-links "$out/.dl" -r "$out/.dl/requirements.txt" -c constraints.txt \
  -d "$out/.dl"
for whl in "$out"/.dl/*.whl; do
  name=$(basename "$whl" | cut -d- -f1 | norm)
  case $have in *" $name "*) ;; *) cp "$whl" "$out/whl/";; esac
done
rm -rf "$out/.dl"
gguf=$("$PY" -c "from magistral_jax.model.gguf_file import default_gguf_path; print(default_gguf_path())")
sha256sum "$gguf" | cut -d' ' -f1 > "$out/gguf.sha256"
split -b "${PART_MB}m" -d "$gguf" "$out/gguf.part"
(cd "$out" && find . -type f ! -name MANIFEST | sort | while read -r f; do
   echo "$(sha256sum "$f" | cut -d' ' -f1) $(stat -c %s "$f") ${f#./}"; done > MANIFEST)
echo "device bundle in $out: $(ls "$out/whl" | wc -l) wheels ($(du -sh "$out/whl" | cut -f1)), \
$(ls "$out"/gguf.part* | wc -l) GGUF parts of at most ${PART_MB} MiB"
