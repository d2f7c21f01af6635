#!/usr/bin/env bash
# The CUDA engine on a GPU in one call: `pytest -m gpu tests/gpu`, then the decode, prefill and
# transformers-peer benchmarks, each under its own time limit (480 s in all at worst).
#
#   OUT=/some/dir bash lab/suites/gpu_suite.sh      # from anywhere; OUT defaults to ./gpu-out
#   SMOKE=1 PYTHON=.venv/bin/python bash lab/suites/gpu_suite.sh   # CPU: the benchmarks in --smoke mode
#
# $OUT gets exactly 8 files: summary.txt (machine, versions, one line per step with its exit code and
# time), tests.log, and a .log and a .json per benchmark. On one GPU the TP=2 parts skip themselves.
# SMOKE=1 (CI) leaves out the GPU tests (7 files) and runs each benchmark on its tiny CPU model.
set -u -o pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
SMOKE_FLAG=()
if [ "${SMOKE:-0}" = 1 ]; then SMOKE_FLAG=(--smoke); fi
# NVLink multicast stays off: on shared hosts it has taken every GPU of the node out of service.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
SUMMARY="$OUT/summary.txt"
{
  date -u
  nvidia-smi --query-gpu=index,name,memory.total,memory.used,driver_version --format=csv,noheader
  $PY -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__,
"transformers", transformers.__version__, "gpus", torch.cuda.device_count())'
  git rev-parse --short HEAD 2>/dev/null && git status --porcelain | wc -l | xargs echo "uncommitted files:"
} >"$SUMMARY" 2>&1

# The GPU image lacks the pure-Python `gguf` package that engine/loader imports: install the wheel the
# caller carried in .whl/ (see docs/operations.md) into a private target dir.
if ! $PY -c 'import gguf' 2>/dev/null && ls .whl/gguf-*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --target /tmp/baton-site .whl/gguf-*.whl
  export PYTHONPATH="/tmp/baton-site${PYTHONPATH:+:$PYTHONPATH}"
fi

step() {  # step NAME LIMIT_S CMD...: run under a time limit into $OUT/NAME.log; one summary line
  local name=$1 limit=$2 start=$SECONDS rc
  shift 2
  timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  echo "$name rc=$rc $((SECONDS - start))s (limit ${limit}s)" | tee -a "$SUMMARY"
  tail -n 25 "$OUT/$name.log"
}

HF_PEER_ARGS=()
if [ "${SMOKE:-0}" = 1 ]; then
  HF_PEER_ARGS=(--batches 1 2 --new-tokens 8)  # the CPU peer at batch 32 x 128 tokens takes minutes
else
  step tests 300 $PY -m pytest -m gpu tests/gpu -x -q -rs -p no:cacheprovider
fi
step bench_decode 240 $PY -m lab.micro.bench_decode "${SMOKE_FLAG[@]}" --tp 2 --out "$OUT/bench_decode.json"
step bench_prefill 60 $PY -m lab.micro.bench_prefill "${SMOKE_FLAG[@]}" --out "$OUT/bench_prefill.json"
step bench_hf_peer 90 $PY -m lab.micro.bench_hf_peer "${SMOKE_FLAG[@]}" "${HF_PEER_ARGS[@]}" \
  --out "$OUT/bench_hf_peer.json"
echo "--- summary"
cat "$SUMMARY"
