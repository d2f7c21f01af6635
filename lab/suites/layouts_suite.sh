#!/usr/bin/env bash
# The 4-GPU layout experiment in one call: a `baton profile` of the Llama-3.1-8B shape on GPU 0 (the
# scheduler's cost-model seed and the planner's input), then the DistServe experiment over the given
# layouts with the goodput policy seeded by that profile (distserve_suite.sh does the install and the run).
#
#   OUT=/some/dir bash lab/suites/layouts_suite.sh --configs c4 1p3d --random-rates 8 16 24 32 ...
#   PROFILE=.data/profile-8b.json bash lab/suites/layouts_suite.sh --configs 2p2d 3p1d ...  # reuse one
#   SMOKE=1 PYTHON=.venv/bin/python bash lab/suites/layouts_suite.sh --configs c1 ...   # CPU, tiny model
#
# SMOKE=1: distserve_suite.sh in its SMOKE mode, seeded by PROFILE when given; the profile step is left out
# (the 8B shape on cuda:0; `baton profile --quick` has its own CPU test).
# Offline afterwards: `python -m lab.experiments.layout_check OUT...` compares `baton plan`'s choice,
# from that profile, with the measured ranking. $OUT: profile-8b.json + distserve_suite.sh's 7 files (8: what the device tool returns).
set -u -o pipefail
cd "$(dirname "$0")/../.."
export OUT=${OUT:-$PWD/layouts-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
PROFILE=${PROFILE:-}
if [ -z "$PROFILE" ] && [ "${SMOKE:-0}" != 1 ]; then
  ls .whl/*.whl >/dev/null && $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/baton-site .whl/*.whl
  export PYTHONPATH=/tmp/baton-site${PYTHONPATH:+:$PYTHONPATH}
  MODEL=/tmp/layouts-model-8b
  $PY -c "from pathlib import Path; from lab.experiments import distserve_assets as a
a.build_model_dir(Path('$MODEL'), a.SHAPES['8b'][1])"
  # The workers' engine flags (distserve_plan.GPU_ENGINE, 40 GiB of KV); the hand-off's fixed cost is
  # the measured 2xH100 overhead (docs/benchmarks.md), which a single-GPU profile cannot time.
  start=$SECONDS
  CUDA_VISIBLE_DEVICES=0 timeout --kill-after=10 "${PROFILE_TIMEOUT_S:-240}" $PY -m services.profiler \
    --model "$MODEL" --load-format dummy --seed 0 --device cuda:0 --dtype bfloat16 --attention-backend triton \
    --num-blocks 20480 --max-num-seqs 128 --max-model-len 4096 --no-prefix-caching \
    --transfer-fixed-s 0.011 --model-name Llama-3.1-8B-dummy --out "$OUT/profile-8b.json" 2>&1 | tail -n 25
  echo "profile rc=${PIPESTATUS[0]} $((SECONDS - start))s"
  PROFILE=$OUT/profile-8b.json
fi
if [ -s "$PROFILE" ]; then
  exec bash lab/suites/distserve_suite.sh --policy goodput --scheduler-profile "$PROFILE" "$@"
fi
echo "no profile: the goodput policy would start from pessimistic defaults; running least_loaded instead"
exec bash lab/suites/distserve_suite.sh --policy least_loaded "$@"
