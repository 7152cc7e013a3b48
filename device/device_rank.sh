#!/usr/bin/env bash
# On one GPU in one call: one Kimi K2.6 rank (a TP 8 GPU's share: MLA with 8 heads, 384 experts of intermediate 256
# in INT4 W4A16 group 32 through our Marlin MoE, the whole 163,840 vocabulary, a DFlash drafter of kimi_model's
# assumed shape per GPU) with random weights (testbed/kimi_rank.py writes the configs, SGLang's --load-format dummy
# fills them), served one server at a time by benchmarks/bench_rank.py: decode round time at batch 1 / 8 / 32 and
# context 4k (the scheduler loop's period, SGLang's decode log, each request's decode rate; the device split by phase
# and verify width from the round log of the -log kinds), startup time and memory from each server's log.
# $OUT gets steps.txt, commit.txt, gpu.txt, rank.json (bench_rank's report, rewritten after each batch size),
# table.txt, RANK_MANIFEST.json (the shapes and the memory estimate) and logs.tar.gz (step and server logs, round
# logs); the table prints last.
#
# The call, from the repo root, after `python device/device_carry.py` (slimmed wheels + prebuilt Marlin JIT modules):
#   run(command="bash device/device_rank.sh", carry=[".dev-carry"], timeout_s=600)
# Knobs: LAYERS (default: the most, up to Kimi's 61, that kimi_rank's memory estimate fits in the card less
#   RANK_SPARE_GIB (default 15) with KV for the largest batch at CONTEXT and the WIDTHS tiers: 52 on an H200 at
#   batch 64, 12 on an H100 at batch 64, 27 at batch 32; the report gives per-layer figures either way; `python -m
#   testbed.kimi_rank --estimate --gpu-gib G --max-batch B` prints the table),
#   RANK_KINDS (bench_rank.py --kinds, default "plain kdtree-cycle-log kdtree-auto-log": one server at a time,
#   each skipped when the deadline cannot hold its startup; "kdtree-auto-overlap kdtree-auto" with BATCHES="1 32"
#   REPEATS=3 for overlap on against off; "plain kdtree-15-overlap kdtree-31-overlap kdtree-63-overlap" for pinned
#   widths' wall time),
#   WIDTHS (tiers of the automatic and cycle kinds, default 16,32,64), BATCHES (default "1 8 32 64"), CONTEXT (prompt
#   tokens, default 4096), NEW_TOKENS (default 64), REPEATS (timed batches per size, default 2), MEM_FRACTION
#   (--mem-fraction-static, default 0.85), PROFILE_BATCH (profile each server's decode steps at this batch size
#   and split them by kernel class: bench_rank.py --profile-batch), RANK_ARGS (more bench_rank.py options, e.g.
#   --stated-tau-json none), KDTREE_DEVICE_PROFILE=sm_120 (every KDTREE launch held to sm_120's limits; the report checks each KDTREE
#   server's limits line and holds every server's greedy tokens to plain's),
#   JIT_SEED_WHICH (prebuild_jit.py --which for the seed, default repack,kdtree: the Marlin modules SGLANG_KDTREE_MOE=marlin loads; a module the seed
#   lacks compiles for about 6 minutes), DEADLINE (s, default 575: the table prints before it), COMMIT (the commit
#   the carried tree is, for commit.txt).
set -uo pipefail
DEADLINE=${DEADLINE:-575}
LOGS=/tmp/device_rank_logs
# shellcheck source=device/steps.sh
source "$(dirname "$0")/steps.sh"

install_carry
if [ -d "$JIT_SEED" ]; then
  step seed_jit 120 env PYTHONPATH="$PWD/tests/e2e/sgl_kernel_cuda:$PYTHONPATH" \
    python3 tests/e2e/prebuild_jit.py --seed "$JIT_SEED" --which "${JIT_SEED_WHICH:-repack,kdtree}" --no-build
else
  echo "WARNING: no prebuilt JIT modules ($JIT_SEED): each server compiles Marlin for minutes" >> "$OUT/steps.txt"
fi

# as many of Kimi's 61 layers as the card holds by the estimate, RANK_SPARE_GIB left free
GPU_MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
BATCHES=${BATCHES:-1 8 32 64}
MAX_BS=$(echo "$BATCHES" | tr ' ' '\n' | sort -n | tail -1)
RANK=/tmp/kimi_rank
step rank_build 120 python3 -m testbed.kimi_rank --out "$RANK" --layers "${LAYERS:-auto}" \
  --gpu-gib "$(( ${GPU_MIB:-81920} / 1024 ))" --spare-gib "${RANK_SPARE_GIB:-15}" --max-batch "$MAX_BS" \
  --tiers "${WIDTHS:-16,32,64}"
cp "$RANK/RANK_MANIFEST.json" "$OUT/" 2>/dev/null
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
bash device/commit_stamp.sh > "$OUT/commit.txt"

# bench_rank stops starting servers (and timing batch sizes) when its own deadline cannot hold them, and writes
# rank.json as it goes; the step's cap leaves ~40 s for stopping a server, the copies and the table
CAP=$(( $(left) - 40 ))
# shellcheck disable=SC2086
step bench "$CAP" python3 benchmarks/bench_rank.py --rank "$RANK" --out "$LOGS/rank" \
  --kinds ${RANK_KINDS:-plain kdtree-cycle-log kdtree-auto-log} --widths "${WIDTHS:-16,32,64}" \
  ${PROFILE_BATCH:+--profile-batch "$PROFILE_BATCH"} --batches $BATCHES --context "${CONTEXT:-4096}" \
  --new-tokens "${NEW_TOKENS:-64}" \
  --repeats "${REPEATS:-2}" --mem-fraction "${MEM_FRACTION:-0.85}" --deadline $(( CAP - 20 )) ${RANK_ARGS:-}

cp "$LOGS/rank/rank.json" "$LOGS/rank/table.txt" "$OUT/" 2>/dev/null
tar -czf "$OUT/logs.tar.gz" -C "$LOGS" . 2>/dev/null

echo "== steps"; cat "$OUT/steps.txt"
cat "$OUT/gpu.txt" "$OUT/commit.txt"
tail -n2 "$LOGS"/plugin*.log "$LOGS/seed_jit.log" "$LOGS/rank_build.log" 2>/dev/null
for f in "$LOGS"/rank/*.log; do
  [ -f "$f" ] || continue
  # each server's first error line, and its memory and startup lines
  e=$(grep -m1 -E "Error|error:|Traceback|out of memory" "$f" | cut -c1-200)
  [ -n "$e" ] && echo "$(basename "$f"): $e"
  grep -E "Load weight end|KV Cache is allocated|Capture .* end|KDTREE verify widths|KDTREE round pre-warm" \
    "$f" | sed "s|^|$(basename "$f" .log): |" | cut -c1-220
done
grep -E "Traceback|Error" "$LOGS/bench.log" | head -5
echo "== table"
if [ -f "$OUT/table.txt" ]; then cat "$OUT/table.txt"; else tail -30 "$LOGS/bench.log"; fi
true
