#!/usr/bin/env bash
# Top-K + lse pipelines on the H200: exactness tests (tree construction file + boundary) and the round at
# budget 64 with the CPU path for each pipeline (SGLANG_KDTREE_TOPK_IMPL). Logs land in $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
bash device/commit_stamp.sh > "$OUT/commit.txt"
timeout "${TEST_TIMEOUT:-85}" python3 -m pytest -q -p no:cacheprovider tests/gpu/test_topk_gpu.py \
  tests/gpu/test_topk_histogram_gpu.py tests/gpu/test_tree_gpu.py tests/gpu/test_tree_verify_gpu.py \
  tests/test_tree_gpu_boundary.py > "$OUT/tests.log" 2>&1; echo "tests rc=$?" | tee -a "$OUT/tests.log"
grep -E "passed|failed|Error|error|assert" "$OUT/tests.log" | tail -25
for impl in histogram cut; do
  SGLANG_KDTREE_TOPK_IMPL=$impl timeout "${BENCH_TIMEOUT:-22}" python3 -m sglang_kdtree.cli.bench_gpu --batches 32 \
    --budgets 64 --json "$OUT/bench_$impl.json" > "$OUT/bench_$impl.log" 2>&1
  echo "bench_gpu $impl rc=$?"; grep -v '^{' "$OUT/bench_$impl.log" | tail -4
done
