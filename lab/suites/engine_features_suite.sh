#!/usr/bin/env bash
# One GPU call for the engine's newer features: the KV-tier and MoE GPU tests, the multi-turn KV-tier
# benchmark (8B shape, tiers on and off in one run), and the MoE benchmark (Qwen3-30B-A3B shape).
#
#   CARRY=/dir/with/wheels OUT=/some/dir bash lab/suites/engine_features_suite.sh
#   SMOKE=1 PYTHON=.venv/bin/python OUT=/some/dir bash lab/suites/engine_features_suite.sh   # CPU
#
# SMOKE=1 (CI) leaves out the GPU tests and runs both benchmarks in their --smoke mode (the default model's
# multi-turn run with tiers on and off; the MoE shape cut to a tiny CPU model).
#
# Every step runs under `timeout`; the whole suite stays under ~580 s. $OUT gets summary.txt and a
# .log (and .json where the step writes one) per step.
set -u -o pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu-out}
CARRY=${CARRY:-.whl}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
SITE=/tmp/baton-site
if [ "${SMOKE:-0}" != 1 ] && ls "$CARRY"/*.whl >/dev/null 2>&1; then  # the GPU box's wheels (CPU: the venv's)
  $PY -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" "$CARRY"/*.whl || exit 3
  export PYTHONPATH="$PWD:$SITE"
fi
SUMMARY="$OUT/summary.txt"
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  git rev-parse --short HEAD 2>/dev/null; } >"$SUMMARY" 2>&1

STEPS=${STEPS:-gpu_tests multiturn_tiers bench_moe}  # a subset runs only those steps
step() {  # step NAME LIMIT_S CMD...
  local name=$1 limit=$2 start=$SECONDS rc
  shift 2
  [[ " $STEPS " == *" $name "* ]] || return 0
  timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  echo "$name rc=$rc $((SECONDS - start))s (limit ${limit}s)" | tee -a "$SUMMARY"
  tail -n 30 "$OUT/$name.log"
}

if [ "${SMOKE:-0}" = 1 ]; then
  step multiturn_tiers ${TIERS_S:-330} $PY -m lab.micro.bench_multiturn_tiers --smoke \
    --time-limit-s $(( ${TIERS_S:-330} - 70 )) --out "$OUT/multiturn_tiers.json"
  step bench_moe ${MOE_S:-150} $PY -m lab.micro.bench_moe --smoke --out "$OUT/bench_moe.json"
  cat "$SUMMARY"
  exit 0
fi
MODEL8B=$($PY -c 'from lab.micro.bench_decode import LLAMA31_8B, write_model_dir; print(write_model_dir(LLAMA31_8B))')
step gpu_tests ${TESTS_S:-90} $PY -m pytest -m gpu -o addopts="" -q -rs -p no:cacheprovider \
  ${GPU_TESTS:-tests/gpu/test_kv_tiers_gpu.py tests/gpu/test_moe_gpu.py}
step multiturn_tiers ${TIERS_S:-330} $PY -m lab.micro.bench_multiturn_tiers --model "$MODEL8B" \
  --load-format dummy --device cuda --dtype bfloat16 --attention-backend triton --num-blocks 4096 \
  --conversations ${CONVERSATIONS:-32} --turns 8 --first-turn-tokens 1024 --turn-tokens 896 --answer-tokens 128 \
  --host-kv-gib 48 --disk-kv-dir /tmp/baton-kv --disk-kv-gib 32 --zero-hit-host-only-kv-gib ${HOST_ONLY_GIB:-4} \
  --time-limit-s $(( ${TIERS_S:-330} - 70 )) \
  --out "$OUT/multiturn_tiers.json"
step bench_moe ${MOE_S:-150} $PY -m lab.micro.bench_moe --time-limit-s $(( ${MOE_S:-150} - 15 )) \
  --out "$OUT/bench_moe.json"
cat "$SUMMARY"
