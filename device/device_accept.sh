#!/usr/bin/env bash
# Accept, compaction and gather on the H200 in one call: install, exactness tests (accept, compaction, gather), benchmarks
# (accept vs SGLang's verify_tree_greedy, MLA compaction vs SGLang's per-layer copy and the HBM floor).
# Run from the repo root through the device tool with carry [".whl"]; logs land in $OUT, tables last.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > "$OUT/install.log" 2>&1
export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-}
pip install -q --no-deps --no-build-isolation -e . >> "$OUT/install.log" 2>&1 || echo "editable install failed" >> "$OUT/install.log"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
bash device/commit_stamp.sh > "$OUT/commit.txt"
timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider -rfEs ${TESTS:-tests/gpu/test_accept_gpu.py \
  tests/gpu/test_accept_sampled_gpu.py tests/gpu/test_accept_sampled_distribution_gpu.py tests/gpu/test_compact_gpu.py \
  tests/test_accept_boundary.py} \
  > "$OUT/tests.log" 2>&1; echo "tests rc=$?" | tee -a "$OUT/tests.log"
grep -E "passed|failed|error" "$OUT/tests.log" | tail -3
grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -20
timeout ${BENCH_TIMEOUT:-150} python3 benchmarks/bench_accept.py ${ACCEPT_ARGS:-} --json "$OUT/accept.json" > "$OUT/bench_accept.log" 2>&1
echo "bench_accept rc=$?"
timeout ${BENCH_TIMEOUT:-150} python3 benchmarks/bench_compact.py ${COMPACT_ARGS:-} --json "$OUT/compact.json" > "$OUT/bench_compact.log" 2>&1
echo "bench_compact rc=$?"
timeout 60 python3 -m pytest -q -p no:cacheprovider benchmarks/bench_accept.py benchmarks/bench_compact.py \
  --benchmark-columns=min,median,max > "$OUT/bench_pytest.log" 2>&1; echo "pytest-benchmark rc=$?"
grep -E "test_bench|passed|failed" "$OUT/bench_pytest.log" | tail -4
grep -E "^(device|\|)" "$OUT/bench_accept.log" || tail -20 "$OUT/bench_accept.log"
grep -E "^(device|\|)" "$OUT/bench_compact.log" || tail -20 "$OUT/bench_compact.log"
