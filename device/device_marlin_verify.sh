#!/usr/bin/env bash
# On the H200 in one call: Marlin MoE at tree-verify widths (130 / 520 / 2080 tokens = batch
# 2 / 8 / 32 x N 65), Kimi K2.6 shapes. benchmarks/bench_marlin_moe.py reports ours vs the INT4 weight floor and
# the bf16 tensor-core compute floor (whichever binds), the bf16 grouped-matmul model, and the stage split with
# the glue's share of the call. Carry .dev-carry (device/device_carry.py: slimmed SGLang wheels in whl/,
# the prebuilt Marlin JIT modules in jit/):
#   run(command="bash device/device_marlin_verify.sh", carry=[".dev-carry"], timeout_s=300,
#       kind="nvidia-h200")
# Logs and bench_marlin.json land in $OUT; the tables print last.
# Knobs: TOKENS (default 130,520,2080), SHAPES (tp8,tp1), BENCH_S (bench time limit, default 150; on SIGTERM the
# bench still prints and writes what it measured), ROTATE / REPEAT (default 8 / 4), CHECK (token counts also
# checked against the fp32 reference, default = TOKENS), ALLOW_COMPILE=1 (run even when the Marlin JIT modules
# were not seeded: a compile takes ~6 min, so raise BENCH_S and timeout_s to 600 with it).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
TOKENS=${TOKENS:-130,520,2080}
step() { echo "[$(printf '%4d' "$SECONDS") s] $*" | tee -a "$OUT/steps.log"; }

step "install the carried wheels"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .dev-carry/whl/*.whl \
  > "$OUT/install.log" 2>&1 || echo "wheel install rc=$? (see install.log)"
export PYTHONPATH=/tmp/site:$PWD:$PWD/tests/e2e/sgl_kernel_cuda:${PYTHONPATH:-} PYTHONUNBUFFERED=1
export SGLANG_JIT_CACHE_DIR=/tmp/sgl-jit-marlin
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
bash device/commit_stamp.sh > "$OUT/commit.txt"

# the Marlin repack + MoE modules this path uses, seeded from the prebuilt copies (digest-checked against this
# sglang / tvm-ffi; SGLang's own load_jit publishes them). No --warmup: a module that does not match would compile.
step "seed the Marlin JIT cache from .dev-carry/jit"
timeout 90 python3 -m sglang_kdtree.moe --seed .dev-carry/jit > "$OUT/seed.log" 2>&1
echo "seed rc=$?"; grep -E "JIT cache|seeded" "$OUT/seed.log" | tail -2
if ! python3 -c "import sys; from sglang_kdtree.moe import jit; sys.exit(0 if jit.marlin_kernels_cached() else 1)" \
     2>> "$OUT/seed.log" && [ -z "${ALLOW_COMPILE:-}" ]; then
  echo "Marlin JIT modules not seeded (see seed.log); a compile takes ~6 min. Rerun with ALLOW_COMPILE=1 BENCH_S=560."
  tail -20 "$OUT/seed.log"
  exit 3
fi

step "bench: shapes ${SHAPES:-tp8,tp1}, tokens $TOKENS, limit ${BENCH_S:-150} s"
timeout -k 20 "${BENCH_S:-150}" python3 benchmarks/bench_marlin_moe.py --shapes "${SHAPES:-tp8,tp1}" \
  --tokens "$TOKENS" --breakdown-tokens "$TOKENS" --check-tokens "${CHECK:-$TOKENS}" \
  --rotate "${ROTATE:-8}" --repeat "${REPEAT:-4}" --json "$OUT/bench_marlin.json" > "$OUT/bench_marlin.log" 2>&1
echo "bench rc=$?" | tee -a "$OUT/bench_marlin.log"
step "done"

echo "==== summary ===="
tail -1 "$OUT/gpu.txt" 2>/dev/null
grep -E "ready in|copy bandwidth|weights ready|graph capture failed|unavailable|interrupted|Error" \
  "$OUT/bench_marlin.log" | tail -12
grep -E "^  (tp8|tp1) M=|^    stages:" "$OUT/bench_marlin.log" | tail -12
# the tables (bench_marlin_moe.print_table): from the device line to the end
sed -n '/^device: /,$p' "$OUT/bench_marlin.log" | grep -v "^bench rc=" || tail -25 "$OUT/bench_marlin.log"
