# shellcheck shell=bash
# Sourced by device_server.sh, device_pair.sh, device_pair_build.sh and device_rank.sh after they set DEADLINE
# (seconds from now) and LOGS (a folder for the step logs): one deadline for the whole call, timed steps recorded in
# $OUT/steps.txt, install_carry for the scripts that serve, and ensure_pair for the scripts that need the testbed pair.
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

# ensure_pair DIR: the testbed pair in DIR, the reference's recipe (testbed/pair_check.py: recipe, settings and
# corpus equal to $PAIR_REFERENCE's; the weights are only compared, since GPU training is not bit-reproducible).
# A pair missing there, or another one, is rebuilt in DIR first with the reference's preset and seed: about
# 3 minutes of GPU time out of the call's deadline. Non-zero when no matching pair results; the check's report
# (both values of every difference) prints either way, and $OUT/pair_metadata.json gets the pair's metadata.
# PAIR_BUILD_CAP (s, default 420) caps the build; PAIR_DEVICE (default cuda) is cpu in the CPU tests.
PAIR_REFERENCE=${PAIR_REFERENCE:-benchmarks/results/pair_metadata.json}
ensure_pair() {
  local dir=$1 build_args rc=0
  if [ -f "$dir/metadata.json" ]; then
    if step pair_check_found 60 python3 -m testbed.pair_check "$dir" --against "$PAIR_REFERENCE"; then
      echo "testbed pair: $dir is the reference's recipe ($PAIR_REFERENCE)"
      grep -E "^  (recipe|weights) " "$LOGS/pair_check_found.log"
      cp "$dir/metadata.json" "$OUT/pair_metadata.json"
      return 0
    fi
    echo "testbed pair: $dir is not the reference's recipe, so it is rebuilt:"
    grep -E "FAIL|Error" "$LOGS/pair_check_found.log" | cut -c1-300
  fi
  build_args=$(python3 -m testbed.pair_check --build-args --against "$PAIR_REFERENCE") || return 1
  # only build_pair's own outputs go: DIR is whatever the caller named
  rm -rf "$dir/target" "$dir/drafter" "$dir/tokenizer" "$dir/heldout_prompts.jsonl" "$dir/metadata.json"
  echo "building the testbed pair (about 3 min) into $dir" | tee -a "$OUT/steps.txt"
  # shellcheck disable=SC2086  # build_args is build_pair's option list
  step build_pair "${PAIR_BUILD_CAP:-420}" python3 -m testbed.build_pair --out "$dir" \
    --device "${PAIR_DEVICE:-cuda}" $build_args || rc=$?
  if [ "$rc" -ne 0 ]; then
    echo "testbed pair: the build failed (rc=$rc); the end of build_pair.log:"
    tail -15 "$LOGS/build_pair.log"
    return 1
  fi
  # --record adds recipe_digest and outputs_sha256, so that this metadata can become the reference
  step pair_check 60 python3 -m testbed.pair_check "$dir" --against "$PAIR_REFERENCE" --record || rc=$?
  cp "$dir/metadata.json" "$OUT/pair_metadata.json"
  cat "$LOGS/pair_check.log"
  [ "$rc" -eq 0 ] || echo "testbed pair: the fresh build in $dir is NOT the reference's recipe (FAIL lines above)"
  return "$rc"
}

# install_carry: SGLang's wheels (.dev-carry/whl when carried, else .whl and .whl-server) into /tmp/site with this
# checkout installed beside them, the plugin's entry point checked (SGLang finds the plugin only through an installed
# package's entry point: PYTHONPATH alone is not enough), and SGLang's server JIT cache restored when carried (without
# it servers started side by side miss their start timeout). Exports PYTHONPATH and SGLANG_JIT_CACHE_DIR; sets
# JIT_SEED, the folder of prebuilt Marlin JIT modules a caller seeds from.
install_carry() {
  local wheels jit_server check stamp
  # shellcheck disable=SC2034  # JIT_SEED is for the callers
  if [ -d .dev-carry/whl ]; then
    wheels=(.dev-carry/whl/*.whl); JIT_SEED=.dev-carry/jit; jit_server=.dev-carry
  else
    wheels=(.whl/*.whl .whl-server/*.whl); JIT_SEED=.jitcache/sm90a; jit_server=.jitcache-server
  fi
  # a warm machine (a call right after another) keeps /tmp/site: the same wheels are not installed twice
  stamp=$(stat -c "%n %s %Y" "${wheels[@]}" 2>/dev/null | md5sum | cut -c1-16)
  if [ -f /tmp/site/.carry-stamp ] && [ "$(cat /tmp/site/.carry-stamp)" = "$stamp" ]; then
    echo "install kept: /tmp/site holds these wheels (warm machine)" >> "$OUT/steps.txt"
  else
    step install 120 python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "${wheels[@]}" \
      && echo "$stamp" > /tmp/site/.carry-stamp
  fi
  export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
  step editable 90 python3 -m pip install --no-deps --no-build-isolation -e .
  check="
from importlib.metadata import entry_points
eps = [(e.name, e.value, str(getattr(e.dist, '_path', ''))) for e in entry_points(group='sglang.srt.plugins')]
print(eps); assert any(n == 'kdtree' for n, _, _ in eps), 'kdtree plugin entry point not visible'"
  if ! step plugin 30 python3 -c "$check"; then
    # the editable install did not register it for this python: install a regular copy next to the wheels
    step install_regular 90 python3 -m pip install --no-deps --no-build-isolation --target /tmp/site .
    step plugin_regular 30 python3 -c "$check"
  fi
  export SGLANG_JIT_CACHE_DIR=/tmp/jitcache-server
  mkdir -p "$SGLANG_JIT_CACHE_DIR"
  if [ -f "$jit_server/jitcache-server.tar.gz" ]; then
    tar -xzf "$jit_server/jitcache-server.tar.gz" -C "$SGLANG_JIT_CACHE_DIR"
  elif [ "$jit_server" = .jitcache-server ] && [ -d .jitcache-server ]; then
    cp -a .jitcache-server/. "$SGLANG_JIT_CACHE_DIR"/
  fi
}
