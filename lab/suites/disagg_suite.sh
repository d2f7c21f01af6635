#!/usr/bin/env bash
cd "$(dirname "$0")/../.." && ls .whl/*.whl && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/baton-site .whl/*.whl && export PYTHONPATH=/tmp/baton-site${PYTHONPATH:+:$PYTHONPATH}
# Disaggregation on 2 GPUs in one call: the 3-worker identity + TTFT benchmark, the GPU tests
# (`pytest -m gpu tests/gpu`, one process per test file under pytest-xdist so that a hung test is one
# failure: pytest-timeout's thread method kills the hung worker and xdist replaces it), and the NIXL KV
# WRITE benchmark (GPU0 -> GPU1, VRAM, with and without checksums), each under its own time limit.
# The line above installs the wheels carried in .whl/ (nixl, nixl_cu13, gguf) into /tmp/baton-site.
#
#   OUT=/some/dir bash lab/suites/disagg_suite.sh          # from anywhere; OUT defaults to ./disagg-out
#   SMOKE=1 PYTHON=.venv/bin/python bash lab/suites/disagg_suite.sh   # CPU: both scripts in --smoke mode
#
# $OUT gets summary.txt (machine, versions, one line per step with exit code and time), and a .log and
# a .json per benchmark, plus disagg-logs/ with the three workers' logs. The tables are printed last.
set -u -o pipefail
OUT=${OUT:-$PWD/disagg-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
SMOKE_FLAG=()
if [ "${SMOKE:-0}" = 1 ]; then SMOKE_FLAG=(--smoke); fi
# NVLink multicast stays off: on shared hosts it has taken every GPU of the node out of service.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
SUMMARY="$OUT/summary.txt"
{
  date -u
  nvidia-smi --query-gpu=index,name,memory.total,memory.used,driver_version --format=csv,noheader 2>/dev/null \
    || echo "no nvidia-smi"
  nvidia-smi topo -m 2>/dev/null | head -n 4
  $PY -c 'import torch; print("torch", torch.__version__, "gpus", torch.cuda.device_count())'
  $PY -c 'import triton; print("triton", triton.__version__)' 2>/dev/null || echo "no triton"
  $PY -c 'import nixl._api, importlib.metadata as m; print("nixl", m.version("nixl"), "usable")' 2>&1 | tail -n 1
  git rev-parse --short HEAD 2>/dev/null && git status --porcelain 2>/dev/null | wc -l | xargs echo "uncommitted files:"
  # The workers import grpc_health (grpcio-health-checking), protobuf >= 7.35.1 and grpcio >= 1.85.1 (the
  # generated stubs check both), prometheus_client and gguf: say what is there before anything runs.
  $PY -c '
import importlib.metadata as md
def v(d):
    try:
        return md.version(d)
    except md.PackageNotFoundError:
        return "MISSING"
print("packages:", ", ".join(f"{d} {v(d)}" for d in ("grpcio", "grpcio-health-checking", "protobuf",
      "prometheus-client", "gguf", "nixl", "nixl-cu13")))
try:
    import gguf, grpc_health.v1.health, prometheus_client, rpcgen.baton.v1.worker_pb2_grpc
    print("worker imports: ok")
except Exception as e:
    print(f"worker imports: FAIL ({type(e).__name__}: {e}): the disagg step will fail; carry the wheels")
'
} >"$SUMMARY" 2>&1
cat "$SUMMARY"

step() {  # step NAME LIMIT_S CMD...: run under a time limit into $OUT/NAME.log; one summary line
  local name=$1 limit=$2 start=$SECONDS rc
  shift 2
  echo "--- $name (limit ${limit}s)"
  timeout --kill-after=5 "$limit" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  echo "$name rc=$rc $((SECONDS - start))s (limit ${limit}s)" | tee -a "$SUMMARY"
}

step disagg 200 $PY -m lab.micro.bench_disagg_gpu "${SMOKE_FLAG[@]}" --timeout-s 190 \
  --log-dir "$OUT/disagg-logs" --out "$OUT/disagg.json"
if [ "${SMOKE:-0}" != 1 ]; then
  step gpu_tests "${GPU_TESTS_LIMIT_S:-280}" $PY -m pytest -m gpu tests/gpu -p no:cacheprovider -n 1 \
    --timeout 240 --timeout-method thread -rA
fi
step kv_transfer 100 $PY -m lab.micro.bench_kv_transfer "${SMOKE_FLAG[@]}" --timeout-s 90 \
  --out "$OUT/kv_transfer.json"

table() {  # table NAME FIRST_LINE_REGEX: the log from the table on, else its last 40 lines
  echo
  echo "=== $1"
  if grep -q "$2" "$OUT/$1.log" 2>/dev/null; then
    sed -n "/$2/,\$p" "$OUT/$1.log"
  else
    tail -n 40 "$OUT/$1.log" 2>/dev/null || echo "(no log)"
  fi
}
table disagg '^Disaggregated serving'
table gpu_tests 'short test summary'
table kv_transfer '^NIXL KV WRITE'
echo
echo "=== summary"
cat "$SUMMARY"
