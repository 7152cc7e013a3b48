#!/usr/bin/env bash
# On the H200 in one call: the testbed pair (testbed/README.md) on real CUDA SGLang servers with CUDA graphs on,
# through python -m testbed.acceptance: plain, DFLASH and KDTREE at pinned budgets 15/31/63/127/255, every held-out
# prompt greedy and at T = 1. $OUT gets acceptance.json (tau per server, KDTREE's greedy identity with plain, the
# drafter's calibration per cut and per depth), outputs.json.gz, logs.tar.gz (install, server and round logs),
# steps.txt and commit.txt; a short table prints last. Plot it here with
# `python -m benchmarks.plot_acceptance acceptance.json DIR`.
#
# The call, from the repo root, with the pair in .pair (~22 MiB) and SGLang's slimmed wheels in .dev-carry/whl
# (python device/device_carry.py; ~34 MiB), about 60 MiB with the tree:
#   run(command="bash device/device_pair.sh", carry=[".dev-carry/whl", ".pair"], timeout_s=600, kind="nvidia-h200")
# Without .dev-carry/whl it installs .whl and .whl-server (57.5 MiB: no room for the pair beside them).
# The pair is checked against benchmarks/results/pair_metadata.json (steps.sh's ensure_pair); missing or another
# recipe, it is built first, about 3 minutes of the DEADLINE, which then leaves too little for the whole grid: get
# the pair once with device/device_pair_build.sh (it comes back as tar parts) and carry it as .pair. The pair's
# metadata comes back as pair_metadata.json.
# Knobs: PAIR (default .pair), DEADLINE (s, default 480: the table prints before it), PROMPTS (default all 256),
#   NEW_TOKENS (default 448: the prompt's 64 plus 448 is the length the drafter was trained on), BUDGETS (default
#   "15 31 63 127 255"), TEMPERATURES (default "0 1"), DTYPE (default float32: greedy identity then tests the round,
#   not bf16 near-ties), ACC_ARGS (more testbed.acceptance options), TRITON_F32_DEFAULT (default ieee: SGLang's
#   Triton attention otherwise multiplies float32 in TF32, and its verify (extend) and decode kernels then differ by
#   more than the near ties of this target's greedy text; with ieee the servers take about 3-4 minutes to start
#   here, so keep DEADLINE at 480 or more).
set -uo pipefail
DEADLINE=${DEADLINE:-480}
LOGS=/tmp/device_pair_logs
# shellcheck source=device/steps.sh
source "$(dirname "$0")/steps.sh"

PAIR=${PAIR:-.pair}
export TRITON_F32_DEFAULT=${TRITON_F32_DEFAULT:-ieee}
install_carry

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$LOGS/gpu.txt" 2>&1
bash device/commit_stamp.sh > "$OUT/commit.txt"
export COMMIT=${COMMIT:-$(head -c 300 "$OUT/commit.txt")}
if ! ensure_pair "$PAIR"; then
  echo "no testbed pair of the reference's recipe in $PAIR: acceptance not run" | tee -a "$OUT/steps.txt"
else
  # ~30 s kept for the table and the tarball; phases not begun 60 s before that are skipped and reported
  CAP=$(( $(left) - 30 )); STARTUP=$(( CAP > 150 ? CAP - 90 : 60 ))
  # shellcheck disable=SC2086
  step acceptance "$CAP" python3 -m testbed.acceptance --pair "$PAIR" --out "$LOGS/acceptance" --device cuda \
    --dtype "${DTYPE:-float32}" --new-tokens "${NEW_TOKENS:-448}" --budgets ${BUDGETS:-15 31 63 127 255} \
    --temperatures ${TEMPERATURES:-0 1} --deadline $(( CAP - 60 )) --startup-timeout "$STARTUP" \
    ${PROMPTS:+--prompts $PROMPTS} ${ACC_ARGS:-}
fi
cp "$LOGS/acceptance/acceptance.json" "$LOGS/acceptance/outputs.json.gz" "$OUT/" 2>/dev/null
tar -czf "$OUT/logs.tar.gz" -C "$LOGS" --exclude=outputs.json.gz . 2>/dev/null

echo "== steps"; cat "$OUT/steps.txt"
echo "== commit"; cat "$OUT/commit.txt"
for f in "$LOGS"/acceptance/logs/*.log; do
  [ -f "$f" ] || continue
  # the first error line of each server that logged one
  e=$(grep -m1 -E "Error|error:|Traceback" "$f" | cut -c1-160)
  [ -n "$e" ] && echo "$(basename "$f"): $e"
done
[ -f "$LOGS/acceptance.log" ] && { echo "== acceptance"; grep -vE "^\s*$" "$LOGS/acceptance.log" | tail -24; }
true
