#!/usr/bin/env bash
# On the GPU machine in one call: the testbed pair (testbed/README.md) built from the checkout and checked against
# benchmarks/results/pair_metadata.json (steps.sh's ensure_pair, testbed/pair_check.py), nothing else; it needs
# torch, tokenizers and safetensors from the image and no carry. About 3 minutes on an H200.
#   run(command="bash device/device_pair_build.sh", timeout_s=600, kind="nvidia-h200")
# $OUT gets steps.txt, commit.txt, gpu.txt, logs.tar.gz (the build's and the check's logs), pair_metadata.json (the
# pair's metadata.json, with recipe_digest and outputs_sha256 added: copy it over the reference when the recipe
# changes on purpose) and the pair itself as pair.tar.part-* (15 MiB each, a returned file may hold 16 MiB); keep
# it here with `mkdir -p .pair && cat pair.tar.part-* | tar -xf - -C .pair` and carry .pair to device_pair.sh.
# The exit status is ensure_pair's: 0 only for a pair of the reference's recipe, settings and corpus.
# Knobs: PAIR (default /tmp/pair: an empty folder, so that the pair is built here; give a carried one to only check
#   it), DEADLINE (s, default 560), PAIR_REFERENCE (default benchmarks/results/pair_metadata.json).
set -uo pipefail
DEADLINE=${DEADLINE:-560}
LOGS=/tmp/device_pair_build_logs
# shellcheck source=device/steps.sh
source "$(dirname "$0")/steps.sh"

PAIR=${PAIR:-/tmp/pair}
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
bash device/commit_stamp.sh > "$OUT/commit.txt"
rc=0
ensure_pair "$PAIR" || rc=$?
if [ -f "$PAIR/metadata.json" ]; then
  tar -C "$PAIR" -cf - . | split -b 15M - "$OUT/pair.tar.part-"
fi
tar -czf "$OUT/logs.tar.gz" -C "$LOGS" . 2>/dev/null

echo "== gpu"; cat "$OUT/gpu.txt"
echo "== steps"; cat "$OUT/steps.txt"
echo "== commit"; cat "$OUT/commit.txt"
exit "$rc"
