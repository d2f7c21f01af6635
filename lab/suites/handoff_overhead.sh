#!/usr/bin/env bash
cd "$(dirname "$0")/../.." && { ls .whl/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/baton-site .whl/*.whl && export PYTHONPATH=/tmp/baton-site${PYTHONPATH:+:$PYTHONPATH}; true; }
# What disaggregation adds to TTFT on ONE GPU (issue 50: 1k prompt, 8B shape, p50 <= 3 ms): the prefill,
# decode and co-located (both) workers are three processes on GPU0, so the figure is the host-side
# overhead of the hand-off (RPCs, thread hops, step-boundary waits, WRITE over cuda_ipc, notice, commit).
# Runs bench_disagg_gpu twice, KV streaming per chunk off then on (a 1k prompt is two 512-token chunks),
# and prints for each: TTFT p50/p90 co-located vs disaggregated, the p50 added, and every hand-off phase
# (prefill: queue_wait, prefill_compute, write_after_prefill, prefill_job; decode: reserve, notice_wait,
# notice_to_commit, handoff, overhead; `write` = the last WRITE posted -> done).
#
#   OUT=/some/dir bash lab/suites/handoff_overhead.sh     # ~2 x 4 min on an H200 (worker start-up included)
#   SMOKE=1 PYTHON=.venv/bin/python bash lab/suites/handoff_overhead.sh   # CPU, tiny model
#   OVERLAP_RESERVE=off ...   # decode worker reserves before the Prefill RPC (no PrefillDestination call)
#   TIMELINE=1 ...   # also per-request timestamps of every hop (lab/experiments/handoff_timeline.py): the
#                    # benchmark runs from a marked copy of the tree; timeline-<stream>.txt in OUT
set -u -o pipefail
OUT=${OUT:-$PWD/overhead-out}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)  # the benchmark may run from a copy of the tree (TIMELINE)
PY=${PYTHON:-python3}
case "$PY" in */*) PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")" ;; esac  # usable from the copy below
SRC=$PWD
if [ "${TIMELINE:-0}" = 1 ]; then
  SRC=$(mktemp -d /tmp/baton-timeline.XXXXXX)
  tar --exclude=./.git --exclude=./.venv --exclude=./overhead-out -cf - . | tar -xf - -C "$SRC"
  "$PY" -m lab.experiments.handoff_timeline mark "$SRC" || exit 1
fi
ARGS=(--shape 8b --prefill-gpu 0 --decode-gpu 0 --both-gpu 0)
if [ "${SMOKE:-0}" = 1 ]; then ARGS=(--smoke); fi
if [ -n "${OVERLAP_RESERVE:-}" ]; then ARGS+=(--overlap-reserve "$OVERLAP_RESERVE"); fi
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
for STREAM in off on; do
  (cd "$SRC" && timeout -k 10 "${STEP_TIMEOUT_S:-285}" "$PY" -m lab.micro.bench_disagg_gpu "${ARGS[@]}" \
    --kv-stream "$STREAM" --kv-stream-min-prompt-tokens "${MIN_STREAM_TOKENS:-256}" \
    --ttft-prompt "${PROMPT_TOKENS:-1024}" --ttft-requests "${REQUESTS:-30}" --identity-requests 4 \
    --target-added-ms 3 --timeout-s "$(( ${STEP_TIMEOUT_S:-285} - 10 ))" --log-dir "$OUT/logs-$STREAM" \
    --out "$OUT/overhead-stream-$STREAM.json" > "$OUT/overhead-stream-$STREAM.log" 2>&1)
  echo "== KV streaming $STREAM: exit $?"
  grep -E "^(Disaggregated|both \(|disagg \(|p50 added|p50 of each pair|KV hand-off|hand-off phase|ERROR|RESULT)" \
    "$OUT/overhead-stream-$STREAM.log"
  if [ "$SRC" != "$PWD" ]; then
    "$PY" -m lab.experiments.handoff_timeline read "$OUT/logs-$STREAM" "$OUT/overhead-stream-$STREAM.log" \
      --skip 11 | tee "$OUT/timeline-$STREAM.txt"  # per path: 4 warm-up, 4 identity, 3 TTFT warm-up requests
  fi
done
if [ "$SRC" != "$PWD" ]; then rm -rf "$SRC"; fi
