#!/usr/bin/env bash
# GPU tree construction on the H200: install, exactness tests, pytest-benchmark cases, stage table.
# Run from the repo root through the device tool with carry [".whl"]; logs land in $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > "$OUT/install.log" 2>&1
export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-}
pip install -q --no-deps --no-build-isolation -e . >> "$OUT/install.log" 2>&1 || echo "editable install failed" | tee -a "$OUT/install.log"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
bash device/commit_stamp.sh > "$OUT/commit.txt"
timeout 190 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_topk_gpu.py tests/gpu/test_topk_histogram_gpu.py \
  tests/gpu/test_tree_gpu.py tests/gpu/test_tree_verify_gpu.py tests/test_tree_gpu_boundary.py \
  > "$OUT/tests.log" 2>&1; echo "tests rc=$?" | tee -a "$OUT/tests.log"
tail -30 "$OUT/tests.log"
timeout 50 python3 -m pytest -q -p no:cacheprovider benchmarks/bench_tree.py --benchmark-columns=min,median,max \
  > "$OUT/bench_pytest.log" 2>&1; echo "bench_tree rc=$?"; tail -12 "$OUT/bench_pytest.log"
timeout 200 python3 -m sglang_kdtree.cli.bench_gpu ${BENCH_ARGS:-} --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1
echo "bench_gpu rc=$?"; tail -30 "$OUT/bench.log"
