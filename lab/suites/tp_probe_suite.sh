#!/usr/bin/env bash
# Device call for TP decode under CUDA graphs (2 GPUs): minimal NCCL capture, where a TP step spends its
# time (graphs and eager), bench_decode TP=2 graphs vs eager vs TP=1, the TP GPU tests. OUT must be set.
cd "$(dirname "$0")/../.." || exit 1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/baton-site .whl/gguf*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/baton-site
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
run() {  # run NAME LIMIT CMD...: on timeout, dump every python's stacks (SIGABRT + faulthandler)
  local name=$1 limit=$2; shift 2
  "$@" >"$OUT/$name.log" 2>&1 & local pid=$! start=$SECONDS
  while kill -0 $pid 2>/dev/null && (( SECONDS - start < limit )); do sleep 1; done
  if kill -0 $pid 2>/dev/null; then
    echo "$name TIMED OUT after ${limit}s: dumping stacks"; pkill -ABRT -f multiprocessing.spawn; pkill -ABRT -f "python3 -m"; sleep 3
    pkill -9 -f multiprocessing.spawn; kill -9 $pid
  fi
  wait $pid; echo "$name rc=$? $((SECONDS - start))s"; tail -n 60 "$OUT/$name.log"
}
run probe_tp_step 150 python3 -m lab.micro.probe_tp_step --tp 2 --batch 32
run probe_tp_eager 120 python3 -m lab.micro.probe_tp_step --tp 2 --batch 32 --eager
run bench_decode 200 python3 -m lab.micro.bench_decode --tp 2 --tp-modes graphs eager --batches 1 32 64 --contexts 1024 --iters 20 --out "$OUT/bench_decode.json"
run gpu_tests 150 python3 -m pytest -m gpu tests/gpu/test_engine_gpu.py -q -x -k "parallel or tp" -p no:cacheprovider
