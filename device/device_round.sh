#!/usr/bin/env bash
# The round's kernel-side checks on the H200 in one call (no wheels needed): the worker's reserved GpuBackend
# round against the reference, the MLA kernel (incl. its launch counter under graph replay), accept and
# commit kernels whose launchers changed. Logs under $OUT, summary last.
#   run(command="bash device/device_round.sh", timeout_s=420)
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
bash device/commit_stamp.sh > "$OUT/commit.txt"
timeout 360 python3 -m pytest -q -p no:cacheprovider -ra tests/gpu/test_pipeline_gpu.py tests/gpu/test_mla_attention_gpu.py \
  tests/gpu/test_accept_gpu.py tests/gpu/test_accept_sampled_gpu.py tests/gpu/test_accept_sampled_distribution_gpu.py \
  tests/gpu/test_compact_gpu.py tests/test_accept_boundary.py > "$OUT/tests.log" 2>&1
echo "rc=$?"
grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -20
tail -3 "$OUT/tests.log"
