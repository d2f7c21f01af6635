#!/usr/bin/env bash
# Sample the scheduler's and the gateway's Python stacks with py-spy while a suite runs, to see where their
# CPU goes (how the gateway's quadratic stream log and its GIL-holding tokenizer were found: docs/benchmarks.md,
# "Where co-located TTFT went under load"). py-spy comes from the carried wheels (py_spy-*.whl in .whl/).
#
#   SPY_OUT=$OUT/spy bash loadtest/micro/spy_services.sh & SPY=$!
#   OUT=$OUT bash loadtest/micro/layouts_suite.sh ...; kill $SPY
#   python -m loadtest.experiments.spy_top $OUT/spy/gateway-*.txt     # where the samples fall
#
# Every scheduler or gateway process that starts while this runs (one per layout) gets its own
# `record --nonblocking` (the target is never paused) at SPY_RATE Hz (default 100), written as raw collapsed
# stacks to SPY_OUT/<scheduler|gateway>-<pid>.txt when the process exits. Stops after SPY_WATCH_S (default 600 s).
set -u
SPY_OUT=${SPY_OUT:-$PWD/spy}
PY_SPY=${PY_SPY:-/tmp/baton-site/bin/py-spy}
mkdir -p "$SPY_OUT"
if [ ! -x "$PY_SPY" ]; then echo "spy_services: no py-spy at $PY_SPY (carry its wheel in .whl/)" >&2; exit 2; fi
seen=" "
end=$((SECONDS + ${SPY_WATCH_S:-600}))
while [ $SECONDS -lt $end ]; do
  for kind in scheduler gateway; do
    module=$([ $kind = scheduler ] && echo scheduler.adapters || echo services.gateway)
    for pid in $(pgrep -f "python.* -m $module" || true); do
      case "$seen" in *" $pid "*) continue ;; esac
      seen="$seen$pid "
      timeout "${SPY_WATCH_S:-600}" "$PY_SPY" record -p "$pid" -r "${SPY_RATE:-100}" --nonblocking -f raw \
        -o "$SPY_OUT/$kind-$pid.txt" >"$SPY_OUT/$kind-$pid.log" 2>&1 &
    done
  done
  sleep 1
done
wait
