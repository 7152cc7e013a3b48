#!/usr/bin/env bash
# MLA tree-verify attention on the H200: install, correctness tests (both kernels), benchmark grid (ours = the wgmma
# kernel, the mma.sync kernel, SGLang Triton, torch, roofline). Run from the repo root through the device tool with
# carry [".dev-carry"] (or [".whl"]); logs land in $OUT.
# BENCH_ARGS (e.g. "--quick", "--deadline 120"), TEST_SEL (pytest -k expression), TEST_CAP / BENCH_CAP (s) tune it.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
t0=$(date +%s)
if [ -d .dev-carry/whl ]; then WHEELS=(.dev-carry/whl/*.whl); else WHEELS=(.whl/*.whl); fi
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "${WHEELS[@]}" > "$OUT/install.log" 2>&1
export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-}
pip install -q --no-deps --no-build-isolation -e . >> "$OUT/install.log" 2>&1 || echo "editable install failed" | tee -a "$OUT/install.log"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
bash device/commit_stamp.sh > "$OUT/commit.txt"
echo "install done after $(( $(date +%s) - t0 )) s"
timeout ${TEST_CAP:-150} python3 -m pytest -q -p no:cacheprovider tests/gpu/test_mla_attention_gpu.py ${TEST_SEL:+-k "$TEST_SEL"} \
  > "$OUT/tests.log" 2>&1; echo "tests rc=$?" | tee -a "$OUT/tests.log"
tail -25 "$OUT/tests.log"
echo "tests done after $(( $(date +%s) - t0 )) s"
timeout ${BENCH_CAP:-150} python3 benchmarks/bench_mla_attention.py ${BENCH_ARGS:-} --json "$OUT/bench_mla.json" > "$OUT/bench_mla.log" 2>&1
echo "bench rc=$? after $(( $(date +%s) - t0 )) s"
cat "$OUT/bench_mla.log" | grep -v Warning | tail -60
