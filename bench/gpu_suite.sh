#!/usr/bin/env bash
# The generation engine's GPU measurements (issue: tokens/s at batch 256 for SmolLM2-135M and a 1B
# config, the fraction of the memory-bandwidth roofline, and the generator against transformers on
# the same GPU) in one call on a lent device machine. Its image has jax, flax, optax, transformers
# and torch; the working tree travels with the call; nothing is installed. From the repo root:
#   bash bench/gpu_suite.sh [all|roofline|generate]     (device tool: run with this command)
# `all` (the default) fits one 10-minute call; `roofline` and `generate` split it over two.
# Logs go under $OUT (the device tool's output folder; ./gpu_out elsewhere). Prints the versions,
# then each benchmark's exit code and its last JSON line. Override the arguments with
# ROOFLINE_ARGS / GENERATE_ARGS, the time limits with ROOFLINE_TIMEOUT / GENERATE_TIMEOUT
# (seconds). A persistent XLA compilation cache spares the repeated runs' compiles.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu_out}
mkdir -p "$out"
py=${PYTHON:-python3}
what=${1:-all}
case $what in all|roofline|generate) ;; *) echo "usage: $0 [all|roofline|generate]" >&2; exit 2;; esac
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/magistral_jax_xla_cache}
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=${JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS:-0.2}
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1 |
  tee "$out/gpu.csv"
$py -c "import jax, flax, transformers, torch
print('jax', jax.__version__, jax.devices(), '| flax', flax.__version__, '| transformers',
      transformers.__version__, '| torch', torch.__version__)" 2>&1 | tee "$out/versions.txt"

run() {
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit} s): $*"
  timeout "$limit" "$py" "$@" > "$out/$name.log" 2>&1
  echo "$name rc=$?"
  grep '^{' "$out/$name.log" | tail -1 | cut -c1-3000
  grep -v '^{' "$out/$name.log" | grep -iE "error|traceback" | tail -5
}
# Batch 256 decode for SmolLM2-135M and the Llama-3.2-1B shapes (bf16) against the roofline.
if [ "$what" != generate ]; then
  run decode_roofline "${ROOFLINE_TIMEOUT:-230}" bench/decode_roofline.py ${ROOFLINE_ARGS:-}
fi
# Continuous batching against transformers generate on the same GPU, bf16, RL-shaped outputs.
if [ "$what" != roofline ]; then
  run generate "${GENERATE_TIMEOUT:-300}" bench/generate.py \
    ${GENERATE_ARGS:---batches 64,256 --dtype bfloat16 --min_new 32 --requests_per_slot 2 --repeats 2}
fi
