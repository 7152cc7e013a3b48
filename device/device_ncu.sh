#!/usr/bin/env bash
# Kernel-by-kernel profile of one top-K + lse call on the H200 (benchmarks/profile_topk.py under ncu):
# duration, DRAM and SM throughput, achieved occupancy, and the top stall reasons per kernel. Skips the two
# warm-up calls (their NVRTC loads and first touches). Knobs: BS (32), K (64), IMPL (histogram).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD:${PYTHONPATH:-}
BS=${BS:-32}; K=${K:-64}; IMPL=${IMPL:-histogram}
per_call=2  # kernels per top-K call: hist_pass + hist_select, or topk_chunk + topk_merge
timeout 240 ncu --kernel-name "regex:^(hist_|topk_)" --launch-skip $((2 * per_call)) --launch-count "$per_call" \
  --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \
  python3 benchmarks/profile_topk.py --bs "$BS" --k "$K" --impl "$IMPL" > "$OUT/ncu_${IMPL}_${BS}_${K}.txt" 2>&1
echo "ncu rc=$?"
grep -E "^  [a-z_0-9]+.*\(|Duration|DRAM Throughput|Compute \(SM\) Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Block Limit|Stall|Grid Size" \
  "$OUT/ncu_${IMPL}_${BS}_${K}.txt" | head -80
