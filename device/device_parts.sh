#!/usr/bin/env bash
# The GPU round's bookkeeping part by part on the H200 (benchmarks/round_parts.py). Carry .dev-carry
# (device/device_carry.py) for SGLang's wheels:
#   run(command="bash device/device_parts.sh", carry=[".dev-carry"])
# Knobs: BATCHES ("1 8 32"), UNIT_TESTS (pytest args run first, e.g.
# "tests/gpu/test_tree_gpu.py"), AB (extra round_parts runs, e.g. "SGLANG_KDTREE_TOPK_IMPL=cut"), AB_COMMIT (a
# commit whose kernels and launchers round_parts also times, from a git worktree, in the same call).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .dev-carry/whl/*.whl > "$OUT/install.log" 2>&1
export PYTHONPATH=/tmp/site:$PWD:$PWD/tests/e2e/sgl_kernel_cuda:${PYTHONPATH:-} PYTHONUNBUFFERED=1
bash device/commit_stamp.sh > "$OUT/commit.txt"
if [ -n "${UNIT_TESTS:-}" ]; then
  # shellcheck disable=SC2086
  timeout 300 python3 -m pytest -q -p no:cacheprovider -ra $UNIT_TESTS > "$OUT/unit.log" 2>&1
  echo "== unit"; grep -E "^(FAILED|ERROR)" "$OUT/unit.log" | head -20; tail -1 "$OUT/unit.log"
fi
# shellcheck disable=SC2086
timeout 240 python3 benchmarks/round_parts.py --batches ${BATCHES:-1 8 32} --json "$OUT/parts.json" > "$OUT/parts.log" 2>&1
if [ -n "${AB_COMMIT:-}" ]; then
  # the same parts from an older commit's kernels and launchers, in the same call (ratios)
  rm -rf /tmp/ab_old && git worktree add -f /tmp/ab_old "$AB_COMMIT" > "$OUT/ab_worktree.log" 2>&1
  # a commit with the kernels at the top level reaches them through the link sglang_kdtree/_kernels
  ( cd /tmp/ab_old && { [ ! -d kernels ] || ln -sfn ../kernels sglang_kdtree/_kernels; }
    # shellcheck disable=SC2086
    PYTHONPATH=/tmp/site:/tmp/ab_old:/tmp/ab_old/tests/e2e/sgl_kernel_cuda timeout 240 python3 \
      "$OLDPWD/benchmarks/round_parts.py" --batches ${BATCHES:-1 8 32} > "$OUT/parts_old_$AB_COMMIT.log" 2>&1 )
fi
for ab in ${AB:-}; do
  # shellcheck disable=SC2086
  timeout 240 env "$ab" python3 benchmarks/round_parts.py --batches ${BATCHES:-1 8 32} > "$OUT/parts_${ab//[^A-Za-z0-9]/_}.log" 2>&1
done
for f in "$OUT"/parts*.log; do echo "== $f"; tail -8 "$f"; done
