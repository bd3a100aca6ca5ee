#!/usr/bin/env bash
# The CPU rehearsal of bench/gpu_suite.sh's `tunix` mode: the same bundle script, staging step and
# bench, on this host, against a venv that stands in for the lent GPU machine's image (no tunix,
# none of its requirements beyond the image's packages: tools/gpu-host-mirror.txt).
#   1. MIRROR_VENV (default /tmp/tunix_mirror_venv) from $PYTHON (default python3.11; the GPU
#      image has 3.12, whose jax 0.11.2 / flax 0.12.10 / numpy 2.5.2 need 3.12, so the mirror
#      takes the newest for 3.11): gpu-host-mirror.txt, torch from a local CPU wheel where there
#      is one, less what pip pulled in that the image does not list (NOT_ON_IMAGE);
#   2. tools/tunix_bundle.py build --python_version <that python's> into BUNDLE;
#   3. tunix_bundle.py stage with the mirror's interpreter into TUNIX_SITE (as on the GPU host);
#   4. bench/vs_tunix.py, tiny model, both sides: ours from .venv, tunix from TUNIX_SITE/bin/python
#      (the mirror's python, TUNIX_SITE first on its path); REHEARSE_ARGS adds flags.
# Downloads (steps 1 and 2): a setup step, like setup_tunix.sh; the bench downloads nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3.11}
venv=${MIRROR_VENV:-/tmp/tunix_mirror_venv}
bundle=${BUNDLE:-/tmp/tunix_mirror_bundle}
site=${TUNIX_SITE:-/tmp/tunix_mirror_site}
NOT_ON_IMAGE=${NOT_ON_IMAGE-annotated-types pydantic pydantic-core typing-inspection tzdata}
pyver=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
if [ ! -x "$venv/bin/python" ]; then
  echo "== creating the image's stand-in $venv with $python"
  "$python" -m venv "$venv"
fi
"$venv/bin/python" -m pip install -q -r tools/gpu-host-mirror.txt
torch_whl=$(ls /opt/wheels/torch-*-cp${pyver/./}-*.whl 2>/dev/null | head -1 || true)
if [ -n "$torch_whl" ]; then
  "$venv/bin/python" -m pip install -q "$torch_whl"
else
  echo "(no local torch wheel for python $pyver: the stand-in has no torch;" \
    "the tunix side does not import it)"
fi
# shellcheck disable=SC2086
[ -z "$NOT_ON_IMAGE" ] ||
  "$venv/bin/python" -m pip uninstall -y -q $NOT_ON_IMAGE 2>/dev/null || true
echo "== bundle for python $pyver in $bundle"
.venv/bin/python tools/tunix_bundle.py build --out "$bundle" --python_version "$pyver"
echo "== stage into $site"
rm -rf "$site"
"$venv/bin/python" tools/tunix_bundle.py stage --bundle "$bundle" --site "$site"
echo "== bench/vs_tunix.py (tiny), tunix from $site/bin/python"
# shellcheck disable=SC2086
.venv/bin/python bench/vs_tunix.py --model=tiny --tokenizer="$site/tokenizer" \
  --tunix_python="$site/bin/python" --prompts 2 --group_size 2 --max_new_tokens 8 \
  --iterations 1 --warmup 1 ${REHEARSE_ARGS:-}
