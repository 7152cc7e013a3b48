# shellcheck shell=bash
# Sourced by device_server.sh and device_pair.sh after they set DEADLINE (seconds from now) and LOGS (a folder
# for the step logs): one deadline for the whole call, and timed steps recorded in $OUT/steps.txt.
START=$(date +%s)
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
rm -rf "$LOGS"; mkdir -p "$LOGS"   # tarred into $OUT by the caller (8 files come back)
: > "$OUT/steps.txt"
left() { echo $(( DEADLINE - ($(date +%s) - START) )); }
# step NAME CAP_SECONDS CMD...: run CMD with at most CAP seconds (and never past the deadline), log to $LOGS/NAME.log
step() {
  local name=$1 cap=$2; shift 2
  local budget; budget=$(left); [ "$cap" -gt "$budget" ] && cap=$budget
  [ "$cap" -le 0 ] && { echo "$name SKIPPED (no time left)" >> "$OUT/steps.txt"; return 124; }
  local t0; t0=$(date +%s)
  # a stopped step's servers get 10 s to exit before they are killed
  timeout --kill-after=10 "$cap" "$@" > "$LOGS/$name.log" 2>&1; local rc=$?
  echo "$name rc=$rc $(( $(date +%s) - t0 ))s (cap ${cap}s)" >> "$OUT/steps.txt"
  return $rc
}
