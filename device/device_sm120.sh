#!/usr/bin/env bash
# The sm_120 kernels on an H100/H200 in one call: the MLA, tree, limits and commit GPU tests on the device's own
# limits, the same under KDTREE_DEVICE_PROFILE=sm_120 (the variants and launch configurations an sm_120 card picks,
# every launch checked against its 101,376 B per block), then the sm_120 MLA kernel's grid against SGLang's Triton
# verify, mma and wgmma (benchmarks/bench_mla_attention.py --sm120). Logs and bench_mla_sm120.json land in $OUT.
#   run(command="bash device/device_sm120.sh", carry=[".whl"], timeout_s=600)
# Knobs: TESTS (pytest paths, default below), TEST_CAP / BENCH_CAP (s), BENCH=0 skips the bench.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
t0=$(date +%s)
if [ -d .dev-carry/whl ]; then WHEELS=(.dev-carry/whl/*.whl); else WHEELS=(.whl/*.whl); fi
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "${WHEELS[@]}" > "$OUT/install.log" 2>&1
export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
bash device/commit_stamp.sh > "$OUT/commit.txt"
echo "install done after $(( $(date +%s) - t0 )) s"
TESTS=${TESTS:-"tests/gpu/test_limits_gpu.py tests/gpu/test_mla_attention_gpu.py tests/gpu/test_mla_precision_gpu.py tests/gpu/test_tree_gpu.py tests/gpu/test_compact_gpu.py"}
# shellcheck disable=SC2086  # TESTS is a list of paths
timeout "${TEST_CAP:-200}" python3 -m pytest -q -p no:cacheprovider -x $TESTS > "$OUT/tests_device.log" 2>&1
echo "tests (device limits) rc=$? after $(( $(date +%s) - t0 )) s"; tail -4 "$OUT/tests_device.log"
# shellcheck disable=SC2086
KDTREE_DEVICE_PROFILE=sm_120 timeout "${TEST_CAP:-200}" python3 -m pytest -q -p no:cacheprovider $TESTS \
  > "$OUT/tests_sm120.log" 2>&1
echo "tests (sm_120 profile) rc=$? after $(( $(date +%s) - t0 )) s"; tail -4 "$OUT/tests_sm120.log"
grep -E "^(FAILED|ERROR)" "$OUT/tests_device.log" "$OUT/tests_sm120.log" | head -20
if [ "${BENCH:-1}" = 1 ]; then
  timeout "${BENCH_CAP:-200}" python3 benchmarks/bench_mla_attention.py --sm120 --json "$OUT/bench_mla_sm120.json" \
    > "$OUT/bench_mla_sm120.log" 2>&1
  echo "bench rc=$? after $(( $(date +%s) - t0 )) s"
  grep -v Warning "$OUT/bench_mla_sm120.log" | tail -24
fi
