#!/usr/bin/env bash
# A/B of two schedulers on one GPU host in one call: this tree ("new") against this tree with an older
# scheduler/ laid over it ("old"), both tapped (distserve --tap-scheduler), run one after the other in
# the order given. Order matters (the side that ran second did 4-6% better on 1xH200, docs/benchmarks.md
# "Sliced local prefills, live"), so a verdict takes one call per order.
#
#   git archive <old commit> scheduler lab/experiments/scheduler_tap.py | tar x -C .dev/old   # here
#   OLD=.dev/old OUT=/some/dir bash lab/suites/scheduler_ab.sh newfirst|oldfirst                # there
#
# Env: PROFILE (the `baton profile` both sides seed from; required), CONFIGS (c1), TTFT_MS (500), TPOT_MS (20),
# RANDOM_RATES ("10 11 12 13"), SHAREGPT_RATES ("20 22 24 26"), DURATION_S (15), DEADLINE (250 s per side).
# Offline afterwards, per side: `python -m lab.experiments.tpot_forecast DIR` (measured / predicted
# TTFT and TPOT per run). $OUT/ab.tgz: each side's layouts_suite.sh output and stdout.
# SMOKE=1 PYTHON=.venv/bin/python: both sides on the CPU (layouts_suite.sh's SMOKE mode), by default one rate
# of 1 req/s for 2 s of random prompts per side, no ShareGPT (SHAREGPT_RATES="" leaves it out anywhere).
set -u -o pipefail
cd "$(dirname "$0")/../.."
ORDER=${1:?usage: scheduler_ab.sh newfirst|oldfirst}
case $ORDER in newfirst|oldfirst) ;; *) echo "order must be newfirst or oldfirst, got $ORDER" >&2; exit 2 ;; esac
OLD=${OLD:?OLD: a folder holding the old scheduler/ (and lab/experiments/scheduler_tap.py)}
PROFILE=${PROFILE:?PROFILE: a baton profile json, the same for both sides}
OUT=${OUT:-$PWD/scheduler-ab-out}
if [ "${SMOKE:-0}" = 1 ]; then
  RANDOM_RATES=${RANDOM_RATES:-1} SHAREGPT_RATES=${SHAREGPT_RATES-} DURATION_S=${DURATION_S:-2} TPOT_MS=${TPOT_MS:-1000} TTFT_MS=${TTFT_MS:-5000}
fi
DEADLINE=${DEADLINE:-250}
mkdir -p "$OUT"
OLD_TREE=$(mktemp -d /tmp/scheduler-ab-old.XXXXXX)
# the tree less earlier outputs, then the old scheduler over it
tar --exclude=./.git --exclude=./.venv --exclude=./results --exclude="./$(basename "$OUT")" -cf - . | tar -xf - -C "$OLD_TREE" && cp -a "$OLD/." "$OLD_TREE/"

suite() { # side tree
  mkdir -p "$OUT/$1"
  (cd "$2" && OUT=$OUT/$1 PROFILE=$PROFILE DEADLINE_S=$DEADLINE SUITE_TIMEOUT_S=$((DEADLINE + 15)) \
    timeout $((DEADLINE + 25)) bash lab/suites/layouts_suite.sh --configs ${CONFIGS:-c1} \
    --random-rates ${RANDOM_RATES:-10 11 12 13} --sharegpt-rates ${SHAREGPT_RATES-20 22 24 26} \
    --duration-s ${DURATION_S:-15} --slo-ttft-ms ${TTFT_MS:-500} --slo-tpot-ms ${TPOT_MS:-20} --gateway-processes 1 \
    --tap-scheduler > "$OUT/$1.stdout" 2>&1)
  echo "$1 rc=$?"
  grep -h "Goodput" "$OUT/$1"/distserve.log | tail -n 20
}

if [ "$ORDER" = newfirst ]; then suite new . ; suite old "$OLD_TREE"; else suite old "$OLD_TREE"; suite new .; fi
rm -rf "$OLD_TREE"
cd "$OUT" && tar czf ab.tgz new old new.stdout old.stdout && rm -rf new old new.stdout old.stdout
