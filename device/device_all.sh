#!/usr/bin/env bash
# Whole-project GPU check on the H200 (device tool, carry [".whl"]): install, doctor, every GPU test except
# Marlin MoE (device/device_marlin.sh: its first compile takes minutes), and the bench CLI's GPU table on a
# small grid. Full logs under $OUT; a short summary last.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > "$OUT/install.log" 2>&1
export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
pip install -q --no-deps --no-build-isolation -e . >> "$OUT/install.log" 2>&1 || echo "editable install failed"
python3 -m sglang_kdtree doctor > "$OUT/doctor.log" 2>&1; echo "doctor rc=$?" >> "$OUT/summary.txt"
timeout 420 python3 -m pytest -q -p no:cacheprovider -ra tests/gpu tests/test_tree_gpu_boundary.py \
  tests/test_accept_boundary.py --ignore=tests/gpu/test_marlin_moe_gpu.py > "$OUT/tests.log" 2>&1
echo "gpu tests rc=$? :: $(tail -1 "$OUT/tests.log")" >> "$OUT/summary.txt"
timeout 120 python3 -m sglang_kdtree bench --batches 1 32 --budgets 16 64 > "$OUT/bench_cli.log" 2>&1
echo "bench cli rc=$?" >> "$OUT/summary.txt"
grep -E "FAILED|ERROR" "$OUT/tests.log" | head -20
cat "$OUT/doctor.log"
tail -8 "$OUT/bench_cli.log"
cat "$OUT/summary.txt"
