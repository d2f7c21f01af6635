#!/usr/bin/env bash
# The 70B tensor-parallel issue in one 4-GPU call (H200s: 70B at TP=2 needs ~106 GiB per rank):
#   1. the disaggregated split vs co-located on the same 4 GPUs (distserve.py --model-shape 70b --tp 2:
#      prefill TP=2 on GPUs 0,1 + decode TP=2 on GPUs 2,3, KV handed over rank by rank, vs two `both`
#      TP=2 workers), random ISL 2048 / OSL 128 only unless SPLIT_ARGS says otherwise;
#   2. the TP=2 GPU tests (logits and greedy tokens equal TP=1, decode through captured graphs);
#   3. bench_tp70b: 70B TP=4 decode step at batch 1/32/128 vs the per-GPU floor, with CUDA graphs.
#   OUT=/dir bash lab/suites/tp70b_suite.sh
#   SMOKE=1 PYTHON=.venv/bin/python OUT=/dir bash lab/suites/tp70b_suite.sh   # CPU: step 3 in --smoke mode
# $OUT (6 files): split_summary.json, split.tar.gz (the experiment's own outputs), split.log,
# tp_tests.log, tp70b.json, tp70b.log. Each step has its own time limit; SPLIT_DEADLINE_S bounds step 1.
# SMOKE=1 (CI) runs only step 3, on a tiny model over CPU ranks (2 files: tp70b.json, tp70b.log): step 1 is
# distserve_suite.sh at the 70B shape (distserve --smoke refuses --tp and --model-shape; that suite's own
# SMOKE mode is the CPU run of the same code), step 2 is GPU tests.
cd "$(dirname "$0")/../.." || exit 2
: "${OUT:?set OUT}"
PY=${PYTHON:-python3}
TP70B_ARGS=(--tp 4)
if [ "${SMOKE:-0}" = 1 ]; then TP70B_ARGS=(--smoke); fi
if [ "${SMOKE:-0}" != 1 ]; then
  SPLIT="$(mktemp -d)"
  OUT="$SPLIT" DEADLINE_S=${SPLIT_DEADLINE_S:-330} SUITE_TIMEOUT_S=$(( ${SPLIT_DEADLINE_S:-330} + 40 )) \
    bash lab/suites/distserve_suite.sh --model-shape 70b --tp 2 ${SPLIT_ARGS:---random-rates 1 2 4 --sharegpt-rates} \
    >"$OUT/split.log" 2>&1
  echo "split rc=$?"; tail -n 25 "$OUT/split.log"
  cp "$SPLIT/summary.json" "$OUT/split_summary.json" 2>/dev/null
  tar -czf "$OUT/split.tar.gz" -C "$SPLIT" . 2>/dev/null
  export PYTHONPATH=/tmp/baton-site NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
  timeout -k 5 ${TESTS_LIMIT_S:-100} python3 -m pytest -m gpu tests/gpu/test_engine_gpu.py -q -rs -k tp2 -p no:cacheprovider \
    >"$OUT/tp_tests.log" 2>&1
  echo "tp tests rc=$?"; tail -n 5 "$OUT/tp_tests.log"
fi
timeout -k 5 ${TP70B_LIMIT_S:-150} $PY -m lab.micro.bench_tp70b "${TP70B_ARGS[@]}" --out "$OUT/tp70b.json" >"$OUT/tp70b.log" 2>&1
echo "tp70b rc=$?"; tail -n 12 "$OUT/tp70b.log"
