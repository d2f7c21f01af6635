#!/usr/bin/env bash
# Sample the scheduler's and the gateway's Python stacks with py-spy while a suite runs, to see where their
# CPU goes (how the gateway's quadratic stream log and its GIL-holding tokenizer were found: docs/benchmarks.md,
# "Where co-located TTFT went under load"). py-spy comes from the carried wheels (py_spy-*.whl in .whl/).
#
#   SPY_OUT=$OUT/spy bash lab/suites/spy_services.sh & SPY=$!
#   OUT=$OUT bash lab/suites/layouts_suite.sh ...; kill $SPY
#   python -m lab.experiments.spy_top $OUT/spy/gateway-*.txt     # where the samples fall
#
# Every scheduler or gateway process that starts while this runs (one per layout) gets its own
# `record --nonblocking` (the target is never paused) at SPY_RATE Hz (default 100), written as raw collapsed
# stacks to SPY_OUT/<scheduler|gateway>-<pid>.txt when the process exits. Stops after SPY_WATCH_S (default 600 s).
# SPY_KINDS (default "scheduler gateway") may add `worker` (files worker-<role>-<pid>.txt); SPY_FLAGS adds py-spy
# flags, e.g. "--threads --idle" to see where a worker's engine thread spends its wall time, waits included.
set -u
SPY_OUT=${SPY_OUT:-$PWD/spy}
PY_SPY=${PY_SPY:-/tmp/baton-site/bin/py-spy}
mkdir -p "$SPY_OUT"
if [ ! -x "$PY_SPY" ]; then echo "spy_services: no py-spy at $PY_SPY (carry its wheel in .whl/)" >&2; exit 2; fi
seen=" "
end=$((SECONDS + ${SPY_WATCH_S:-600}))
while [ $SECONDS -lt $end ]; do
  for kind in ${SPY_KINDS:-scheduler gateway}; do
    case $kind in scheduler) module=scheduler.adapters ;; gateway) module=services.gateway ;; *) module=services.$kind ;; esac
    for pid in $(pgrep -f "python.* -m $module" || true); do
      case "$seen" in *" $pid "*) continue ;; esac
      seen="$seen$pid "
      role=$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | sed -n 's/.*--role \([a-z]*\).*/\1-/p')
      # shellcheck disable=SC2086  # SPY_FLAGS is a list of flags
      timeout "${SPY_WATCH_S:-600}" "$PY_SPY" record -p "$pid" -r "${SPY_RATE:-100}" --nonblocking -f raw ${SPY_FLAGS:-} \
        -o "$SPY_OUT/$kind-$role$pid.txt" >"$SPY_OUT/$kind-$role$pid.log" 2>&1 &
    done
  done
  sleep 1
done
wait
