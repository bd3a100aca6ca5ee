#!/usr/bin/env bash
# Creates (or updates) the peer's own virtual environment for bench/vs_tunix.py:
# bench/peers/.venv-tunix with google-tunix 0.1.7 and its pins (requirements-tunix.txt).
# A setup step: it downloads; the bench itself never does. Nothing here touches our .venv.
#
#   bench/peers/setup_tunix.sh                      # CPU, python3.11
#   PYTHON=python3.12 JAX_CUDA=cuda12 bench/peers/setup_tunix.sh   # a CUDA 12 GPU host
#
# PYTHON: the interpreter to build the venv from (default python3.11).
# TUNIX_VENV: where (default bench/peers/.venv-tunix; vs_tunix.py takes --tunix_python).
# JAX_CUDA: also install jax[$JAX_CUDA] at the pinned jax version (cuda12 or cuda13), so the
#   tunix side can run on an NVIDIA GPU.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
python="${PYTHON:-python3.11}"
venv="${TUNIX_VENV:-$here/.venv-tunix}"
reqs="$here/requirements-tunix.txt"

if [ ! -x "$venv/bin/python" ]; then
  echo "creating $venv with $python"
  "$python" -m venv "$venv"
fi
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q -r "$reqs"
if [ -n "${JAX_CUDA:-}" ]; then
  jax_version="$(sed -n 's/^jax==//p' "$reqs")"
  "$venv/bin/python" -m pip install -q "jax[$JAX_CUDA]==$jax_version"
fi
"$venv/bin/python" - <<'PY'
import importlib.metadata as md
import jax
print("tunix venv ready:", {n: md.version(n) for n in ("google-tunix", "jax", "flax")},
      "devices:", jax.devices())
PY
