#!/usr/bin/env bash
# Top-K + lse kernel on the H200: exactness tests (tree construction file + boundary), A/B timings of the
# top-K stage (new kernel, a register-bound variant, the previous kernel when sglang_kdtree/gpu/topk_old.py
# is present), and the stage table at budget 64 with the CPU path. Logs land in $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
git rev-parse HEAD > "$OUT/commit.txt" 2>/dev/null
timeout ${TEST_TIMEOUT:-105} python3 -m pytest -q -p no:cacheprovider tests/gpu/test_tree_gpu.py \
  tests/test_tree_gpu_boundary.py > "$OUT/tests.log" 2>&1; echo "tests rc=$?" | tee -a "$OUT/tests.log"
tail -15 "$OUT/tests.log"
timeout ${AB_TIMEOUT:-55} python3 benchmarks/topk_ab.py --old sglang_kdtree.gpu.topk_old \
  --variant=-DCHUNK_MIN_BLOCKS=2 --json "$OUT/topk_ab.json" > "$OUT/topk_ab.log" 2>&1
echo "topk_ab rc=$?"; grep -v '^{' "$OUT/topk_ab.log" | tail -20
timeout ${BENCH_TIMEOUT:-45} python3 -m sglang_kdtree.bench_gpu --batches 8 32 64 --budgets 64 --json "$OUT/bench.json" \
  > "$OUT/bench.log" 2>&1
echo "bench_gpu rc=$?"; grep -v '^{' "$OUT/bench.log" | tail -12
