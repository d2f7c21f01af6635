#!/usr/bin/env bash
# Pipeline parallelism on 2 GPUs in one call (nvidia-h200-x2; 70B bf16 at PP=2 or TP=2 needs ~71 GiB
# of weights per GPU), each step under its own hard time limit (~9 min in all at worst):
#   1. identity: the 8B shape greedy-decoded at PP=1, PP=2 (1 micro-batch: must be identical) and
#      PP=2 with 2 micro-batches (reported);
#   2. decode: the 70B shape at TP=2 (graphs, eager) and PP=2 (1 and 2 micro-batches), batch 1/32/128,
#      context 1024, against the per-GPU floor.
#   OUT=/dir bash lab/suites/pp70b_suite.sh
#   SMOKE=1 PYTHON=.venv/bin/python OUT=/dir bash lab/suites/pp70b_suite.sh   # CPU: both parts in --smoke mode
# $OUT (5 files): summary.txt, identity.json, identity.log, decode.json, decode.log.
set -u -o pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/pp-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
SMOKE_FLAG=()
if [ "${SMOKE:-0}" = 1 ]; then SMOKE_FLAG=(--smoke); fi
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
# The GPU image lacks the pure-Python `gguf` package that engine/loader imports: the caller carries it in .whl/.
if ! $PY -c 'import gguf' 2>/dev/null && ls .whl/gguf-*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --target /tmp/baton-site .whl/gguf-*.whl
  export PYTHONPATH="/tmp/baton-site${PYTHONPATH:+:$PYTHONPATH}"
fi
{ date -u; nvidia-smi --query-gpu=index,name,memory.total,memory.used --format=csv,noheader || echo "no nvidia-smi"; } \
  >"$OUT/summary.txt" 2>&1
timeout -k 10 "${IDENTITY_LIMIT_S:-200}" $PY -m lab.micro.bench_pp70b "${SMOKE_FLAG[@]}" --part identity --out "$OUT/identity.json" \
  >"$OUT/identity.log" 2>&1
echo "identity rc=$?" | tee -a "$OUT/summary.txt"; tail -n 6 "$OUT/identity.log"
timeout -k 10 "${DECODE_LIMIT_S:-330}" $PY -m lab.micro.bench_pp70b "${SMOKE_FLAG[@]}" --part decode --out "$OUT/decode.json" \
  >"$OUT/decode.log" 2>&1
echo "decode rc=$?" | tee -a "$OUT/summary.txt"; tail -n 16 "$OUT/decode.log"
