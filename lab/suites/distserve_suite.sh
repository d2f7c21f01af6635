#!/usr/bin/env bash
cd "$(dirname "$0")/../.." && ls .whl/*.whl >/dev/null && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/baton-site .whl/*.whl && export PYTHONPATH=/tmp/baton-site${PYTHONPATH:+:$PYTHONPATH}
# The DistServe experiment on 2 GPUs in one call (lab/experiments/distserve.py): 1 prefill + 1
# decode worker vs 2 co-located `both` workers, Llama-3.1-8B shape (dummy weights), random ISL 2048 /
# OSL 128 and ShareGPT, request-rate sweep, goodput under TTFT <= 500 ms / TPOT <= 50 ms.
# The line above installs the wheels carried in .whl/ (nixl, grpc, protobuf, gguf, and the gateway's
# and bench's pure-Python/cp312 dependencies, mypy-extensions for the scheduler among them) into
# /tmp/baton-site. Needs .data/distserve/ (carried; `python -m lab.experiments.distserve_assets`
# writes it).
#
#   OUT=/some/dir bash lab/suites/distserve_suite.sh      # OUT defaults to ./distserve-out
#   bash lab/suites/distserve_suite.sh --tp 2 ...          # extra arguments go to the experiment
#                                                              # (tp70b_suite.sh: --model-shape 70b --tp 2)
#   SMOKE=1 PYTHON=python3.12 bash lab/suites/distserve_suite.sh   # CPU, tiny model, ~1-2 min (the
#   carried wheels are cp312; on the 3.11 CI machine run `.venv/bin/python -m lab.experiments.distserve --smoke`)
#
# $OUT: distserve.log (environment, package check, the whole run), summary.json, results.tar.gz
# (per-run bench JSONs + every process log), goodput_{random,sharegpt}.png, attainment_*.png: 7 files.
# Time: the experiment's own deadline is DEADLINE_S (default 480 s) + a 20 s hard alarm; `timeout`
# here is the last resort. Without matplotlib on the box the PNGs are skipped: rerun
# `python -m lab.experiments.distserve --replot OUT` where matplotlib is installed.
set -u -o pipefail
OUT=${OUT:-$PWD/distserve-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
LOG="$OUT/distserve.log"
ARGS=(--out "$OUT" --deadline-s "${DEADLINE_S:-480}" "$@")
if [ "${SMOKE:-0}" = 1 ]; then ARGS=(--smoke --out "$OUT" "$@"); fi
# NVLink multicast stays off: on shared hosts it has taken every GPU of the node out of service.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
{
  date -u
  nvidia-smi --query-gpu=index,name,memory.total,memory.used,driver_version --format=csv,noheader 2>/dev/null \
    || echo "no nvidia-smi"
  $PY -c 'import torch; print("torch", torch.__version__, "gpus", torch.cuda.device_count())'
  $PY -c 'import triton; print("triton", triton.__version__)' 2>/dev/null || echo "no triton"
  echo "experiment arguments: ${ARGS[*]}"
  git rev-parse --short HEAD 2>/dev/null && git status --porcelain 2>/dev/null | wc -l | xargs echo "uncommitted files:"
  ls -la .data/distserve 2>&1
  # What the gateway, the scheduler, the workers and the bench import, and where each comes from.
  $PY -c '
import importlib
mods = ("fastapi starlette uvicorn h11 click pydantic pydantic_core pydantic_settings dotenv annotated_types "
        "typing_inspection annotated_doc anyio sniffio opentelemetry.sdk.trace prometheus_client aiohttp multidict "
        "yarl frozenlist propcache aiosignal aiohappyeyeballs attr idna numpy tqdm tokenizers jinja2 grpc "
        "grpc_health.v1.health google.protobuf gguf nixl._api matplotlib").split()
missing, carried = [], []
for m in mods:
    try:
        f = getattr(importlib.import_module(m), "__file__", "") or ""
        (carried if f.startswith("/tmp/baton-site") else []).append(m)
    except Exception as e:
        missing.append(f"{m} ({type(e).__name__})")
print("imports from the carried wheels:", " ".join(carried) or "none")
print("MISSING:", ", ".join(missing) or "none", "(matplotlib missing = no PNGs here; --replot later)")
try:
    import services.gateway.__main__, scheduler.adapters.main, loadtest.cli, loadtest.client  # noqa
    import rpcgen.baton.v1.worker_pb2_grpc  # noqa
    print("gateway/scheduler/bench imports: ok")
except Exception as e:
    print(f"gateway/scheduler/bench imports: FAIL ({type(e).__name__}: {e})")
'
} >"$LOG" 2>&1
cat "$LOG"
start=$SECONDS
timeout --kill-after=10 "${SUITE_TIMEOUT_S:-530}" $PY -m lab.experiments.distserve "${ARGS[@]}" 2>&1 | tee -a "$LOG"
rc=${PIPESTATUS[0]}
echo "distserve rc=$rc $((SECONDS - start))s" | tee -a "$LOG"
ls -la "$OUT" | tee -a "$LOG"
exit "$rc"
