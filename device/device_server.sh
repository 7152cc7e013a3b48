#!/usr/bin/env bash
# On the H200 in one call: real CUDA SGLang servers with our plugin, plain vs KDTREE, token for token
# (tests/gpu/test_server_cuda.py), through the test-only sgl_kernel stand-in (tests/e2e/sgl_kernel_cuda).
# $OUT gets steps.txt, table.txt, summary.json, logs.tar.gz (every step and server log, round logs) and
# jitcache-server.tar.gz; a short table prints last.
#
# The call, from the repo root, after `python device/device_carry.py` (which packs .whl / .whl-server from
# ../shared/device/fetch-sglang-wheels.sh, slimmed, with the prebuilt Marlin JIT modules of .jitcache/sm90a,
# .jitcache-server's tarball and .tiny_models into one 51 MiB folder):
#   run(command="KIMI=1 bash device/device_server.sh", carry=[".dev-carry"], timeout_s=600,
#       kind="nvidia-h200-x2")
# Without .dev-carry it falls back to carrying .whl and .whl-server (57.5 MiB; then no room for the Marlin JIT
# modules: the Kimi-shaped servers compile them for minutes) and builds the tiny models here (about a minute).
# A full run (unit tests, every server kind of the probe, and the bench):
#   PARALLEL=1 UNIT=1 KIMI=1 BENCH=1 BENCH_KINDS="plain dflash kdtree kdtree-log" \
#   PROBE="--models llama,dsv3,kimi,kimi-marlin --modes graph,eager" DEADLINE=390 bash device/device_server.sh
# Knobs: JIT_SEED_WHICH (prebuild_jit.py --which for the seed; default plain,glue,kdtree: a module the seed lacks is
#   compiled, minutes each; repack,kdtree for a seed made by JIT_EXPORT's default), BENCH_VARIANT (bench_server.py --variant, default kimi; kimi-marlin runs every server's MoE through
#   SGLANG_KDTREE_MOE=marlin), BENCH_ARGS (more bench_server.py options, e.g. "--widths 16,32,48,64"),
#   DEADLINE (s, default 575: the table prints before it), TESTS (pytest node ids / -k, default the
#   whole file; none: no tests or probe), PROBE (if set, e.g. "--models llama,dsv3 --modes graph --dtypes float32,bfloat16", runs
#   tests/e2e/cuda_servers.py's CLI instead of pytest), KIMI=1 (build the Kimi-shaped target into
#   $KDTREE_KIMI_MODELS, default .kimi_models, seed .jitcache/sm90a if carried, and add the kimi /
#   kimi-marlin variants; SGLang's Marlin MoE JIT compiles for minutes when not seeded), UNIT=1 (first the GPU
#   unit tests, -m "gpu and not slow"; UNIT_TESTS=<paths> narrows them), ALL_GPUS=1 (the tests / probe see every
#   GPU: TP 2), UNIT_CAP (s, default 260: the unit step's cap), BENCH_AFTER=1 (the bench after the tests, alone
#   on GPU 0; BENCH_AFTER_S seconds of the deadline are kept for it), PARALLEL=1
#   (with 2 GPUs: UNIT then BENCH on GPU 1 while the tests / probe run on GPU 0; with one: UNIT beside the tests /
#   probe, BENCH after them; PARTS and KIMI_ROUND last), BENCH_KINDS (bench_server.py
#   --kinds, e.g. "plain dflash kdtree kdtree-log"), PARTS=1 (benchmarks/round_parts.py after the unit tests;
#   AB_COMMIT=<commit> also times that commit's kernels from a git worktree, same call; AB_DIR=<folder> from a
#   `git archive <commit> sglang_kdtree kernels tests/e2e/sgl_kernel_cuda` export instead; PARTS_ARGS=--trace adds
#   each step graph's kernels and the gaps between them), SHORT_STARTUP_OK=1 (run the tests / probe even when
#   the servers would get under 120 s to start, which they need here; otherwise those are skipped), KIMI_ROUND=1
#   (python -m benchmarks.kimi_round on GPU 0 after the tests / probe, within what is left of the deadline).
set -uo pipefail
DEADLINE=${DEADLINE:-575}
LOGS=/tmp/device_server_logs
# shellcheck source=device/steps.sh
source "$(dirname "$0")/steps.sh"

# .dev-carry (device/device_carry.py: slimmed wheels + prebuilt JIT + tiny models in one carry) wins when carried
[ -d .dev-carry/tiny_models ] && export KDTREE_TINY_MODELS=${KDTREE_TINY_MODELS:-$PWD/.dev-carry/tiny_models}
install_carry

# JIT_EXPORT=1: build SGLang's JIT modules of JIT_WHICH (prebuild_jit.py --which; default repack,kdtree: what
# SGLANG_KDTREE_MOE=marlin servers and kimi_round's Marlin piece load; one Marlin module is about 6 minutes of nvcc)
# for sm_90a in the background, into the servers' JIT cache, and bring them back as $OUT/jit-sm90a.tar.gz (unpack
# into .jitcache/sm90a: device/device_carry.py packs it)
if [ -n "${JIT_EXPORT:-}" ]; then
  ( step jit_export 560 env CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}" PYTHONPATH="$PWD/tests/e2e/sgl_kernel_cuda:$PYTHONPATH" \
      python3 tests/e2e/prebuild_jit.py --which "${JIT_WHICH:-repack,kdtree}" --export /tmp/jit-sm90a \
    && tar -czf "$OUT/jit-sm90a.tar.gz" -C /tmp/jit-sm90a . ) &
  JIT_PID=$!
fi

# the committed build (tests/e2e/tiny_models); rebuilt here only if it no longer matches its generator
export KDTREE_TINY_MODELS=${KDTREE_TINY_MODELS:-$PWD/tests/e2e/tiny_models}
step models 200 python3 -c "
import sys; from pathlib import Path; sys.path.insert(0, 'tests/e2e')
import make_tiny_models as m; print(m.ensure_built(Path('$KDTREE_TINY_MODELS'), log=print))"

if [ -n "${KIMI:-}" ]; then
  # the Kimi-shaped W4A16 target (tests/e2e/make_kimi_model.py, built here: its vocab-163,840 embedding is too
  # big to carry) and, if carried, the prebuilt Marlin JIT modules (.jitcache/sm90a, tests/e2e/prebuild_jit.py)
  export KDTREE_KIMI_MODELS=${KDTREE_KIMI_MODELS:-$PWD/.kimi_models}
  [ -d "$JIT_SEED" ] && step seed_jit 120 env PYTHONPATH="$PWD/tests/e2e/sgl_kernel_cuda:$PYTHONPATH" \
    python3 tests/e2e/prebuild_jit.py --seed "$JIT_SEED" --which "${JIT_SEED_WHICH:-plain,glue,kdtree}" --no-build
  step kimi_models 240 python3 -c "
import sys; from pathlib import Path; sys.path.insert(0, 'tests/e2e')
import make_kimi_model as m; print(m.ensure_built(Path('$KDTREE_KIMI_MODELS'), log=print))"
fi

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$LOGS/gpu.txt" 2>&1
bash device/commit_stamp.sh > "$LOGS/commit.txt"
export KDTREE_SERVER_LOGS="$LOGS/servers"
mkdir -p "$KDTREE_SERVER_LOGS"
# leave ~25 s for copying logs and printing the table (and BENCH_AFTER's share for the bench)
TEST_CAP=$(( $(left) - 25 - ${BENCH_AFTER_S:-0} ))
STARTUP_GIVEN=${KDTREE_CUDA_STARTUP_TIMEOUT:-}
export KDTREE_CUDA_STARTUP_TIMEOUT=${KDTREE_CUDA_STARTUP_TIMEOUT:-$(( TEST_CAP > 200 ? TEST_CAP - 120 : TEST_CAP / 2 ))}
# CUDA servers here took 50-140 s to become healthy (70 s for the tiny Llama with 8 starting at once, 123-142 s with
# 16); a shorter startup timeout stops them all while they still capture graphs, and the whole probe is lost (a
# DEADLINE of 270 left them 78 s): say so up front. Below 120 s the tests / probe are skipped,
# not run to certain failure, unless SHORT_STARTUP_OK=1; the unit tests and the bench still run.
SERVERS_OK=1
if [ "$KDTREE_CUDA_STARTUP_TIMEOUT" -lt 120 ]; then
  if [ -n "${SHORT_STARTUP_OK:-}" ]; then
    echo "WARNING: servers get only ${KDTREE_CUDA_STARTUP_TIMEOUT}s to start (KDTREE_CUDA_STARTUP_TIMEOUT, from" \
         "DEADLINE and BENCH_AFTER_S); they need 50-140 s here" >> "$OUT/steps.txt"
  else
    SERVERS_OK=
    echo "tests/probe SKIPPED: servers would get only ${KDTREE_CUDA_STARTUP_TIMEOUT}s to start (they need 50-140 s" \
         "here); raise DEADLINE by $(( 120 - KDTREE_CUDA_STARTUP_TIMEOUT + 10 ))s or more, or set SHORT_STARTUP_OK=1" \
         >> "$OUT/steps.txt"
  fi
fi
NGPU=$(nvidia-smi -L 2>/dev/null | wc -l)
run_bench() {  # plain vs DFLASH vs KDTREE (+ the MLA A/B) on the Kimi-shaped target
  # its servers' startup timeout comes from the bench's own cap, not the tests' (unless one was given); a
  # Kimi-shaped KDTREE server took 130-140 s to start here (SGLang's graph capture, then its own rehearsal), and
  # the timed batches and idle traces about 100 s more: below that the KDTREE servers are stopped while they start
  local cap=$(( $(left) - 30 ))
  [ "$cap" -lt 250 ] && [ -z "$STARTUP_GIVEN" ] && echo "WARNING: the bench has ${cap}s; Kimi-shaped KDTREE servers" \
    "need about 140 s to start and the timed batches about 100 s more (raise DEADLINE)" >> "$OUT/steps.txt"
  # shellcheck disable=SC2086
  CUDA_VISIBLE_DEVICES=$1 KDTREE_CUDA_STARTUP_TIMEOUT=${STARTUP_GIVEN:-$(( cap > 250 ? cap - 100 : cap * 3 / 5 ))} \
    step bench "$cap" python3 benchmarks/bench_server.py \
    --variant "${BENCH_VARIANT:-kimi}" --batches 1 8 32 --budget 64 --new-tokens 64 \
    --repeats "${BENCH_REPEATS:-2}" --out "$LOGS/bench" ${BENCH_KINDS:+--kinds $BENCH_KINDS} ${BENCH_ARGS:-}
}
run_parts() {  # the round's bookkeeping kernel by kernel (benchmarks/round_parts.py), and AB_COMMIT's beside it
  # (the stand-in on the path: round_parts builds an SGLang MLA pool, whose package imports sgl_kernel)
  CUDA_VISIBLE_DEVICES=$1 PYTHONPATH="$PWD/tests/e2e/sgl_kernel_cuda:$PYTHONPATH" \
    step parts 120 python3 benchmarks/round_parts.py --batches 1 8 32 --json "$LOGS/parts.json" ${PARTS_ARGS:-}
  if [ -n "${AB_COMMIT:-}${AB_DIR:-}" ]; then
    rm -rf /tmp/ab_old
    if [ -n "${AB_DIR:-}" ]; then  # an export of the older code (git archive: sglang_kdtree tests/e2e; also kernels for
      # a commit that keeps them at the top level)
      cp -a "$AB_DIR" /tmp/ab_old
    else
      git worktree add -f /tmp/ab_old "$AB_COMMIT" > "$LOGS/ab_worktree.log" 2>&1
    fi
    # a commit with the kernels at the top level reaches them through the link sglang_kdtree/_kernels (an
    # AB_DIR copy may have lost it)
    [ ! -d /tmp/ab_old/kernels ] || ln -sfn ../kernels /tmp/ab_old/sglang_kdtree/_kernels
    CUDA_VISIBLE_DEVICES=$1 PYTHONPATH="/tmp/site:/tmp/ab_old:/tmp/ab_old/tests/e2e/sgl_kernel_cuda" \
      step parts_old 120 python3 benchmarks/round_parts.py --batches 1 8 32 ${PARTS_ARGS:-}
  fi
}
run_unit() {  # the GPU unit tests (kernels vs their twins, the reserved GpuBackend, the round's graphs)
  # (the stand-in on the path: the Marlin tests import SGLang's quantization package, which imports sgl_kernel)
  CUDA_VISIBLE_DEVICES=$1 step unit "${UNIT_CAP:-260}" env PYTHONPATH="$PWD/tests/e2e/sgl_kernel_cuda:$PYTHONPATH" \
    python3 -m pytest -q -p no:cacheprovider -ra --durations=15 -m "gpu and not slow" ${UNIT_TESTS:-tests/gpu}
}
if [ -n "${PARALLEL:-}" ] && [ "$NGPU" -ge 2 ]; then
  # PARALLEL=1: the unit tests and then the bench on GPU 1 while the tests / probe use GPU 0
  ( [ -n "${UNIT:-}" ] && run_unit 1; [ -n "${BENCH:-}" ] && run_bench 1 ) &
  BENCH_PID=$!
  UNIT=; BENCH_AFTER=; BENCH=; PARTS_AFTER=${PARTS:-}; PARTS=
elif [ -n "${PARALLEL:-}" ]; then
  # one GPU: the unit tests (correctness only) beside the tests / probe, whose servers take 0.3 of its memory;
  # the bench, then PARTS, after them, alone on the GPU (give the bench BENCH_AFTER_S of the deadline)
  ( [ -n "${UNIT:-}" ] && run_unit 0 ) &
  UNIT_PID=$!
  UNIT=; BENCH_AFTER=${BENCH:+1}; PARTS_AFTER=${PARTS:-}; PARTS=
fi
if [ -n "${UNIT:-}" ]; then
  run_unit "${CUDA_VISIBLE_DEVICES:-0}"  # first, alone
fi
[ -n "${PARTS:-}" ] && run_parts "${CUDA_VISIBLE_DEVICES:-0}"
if [ -n "${BENCH:-}" ] && [ -z "${BENCH_AFTER:-}" ]; then
  # beside the tests: on the second GPU when there is one (the tests' servers stay on the first), else on the
  # same GPU (timings then share it)
  BENCH_GPU=0; [ "$NGPU" -ge 2 ] && BENCH_GPU=1
  ( run_bench $BENCH_GPU ) &
  BENCH_PID=$!
fi
# ALL_GPUS=1 leaves every GPU to the tests / probe (TP 2: PROBE="--models kimi --tp 2 ...")
[ "$NGPU" -ge 2 ] && [ -z "${ALL_GPUS:-}" ] && export CUDA_VISIBLE_DEVICES=0
if [ -z "$SERVERS_OK" ]; then
  :  # skipped above (steps.txt says why)
elif [ "${TESTS:-}" = none ]; then
  :  # TESTS=none: no tests / probe (a bench-only call)
elif [ -n "${PROBE:-}" ]; then
  # shellcheck disable=SC2086
  step probe "$TEST_CAP" python3 tests/e2e/cuda_servers.py $PROBE --out "$KDTREE_SERVER_LOGS"
else
  # shellcheck disable=SC2086
  step tests "$TEST_CAP" python3 -m pytest -q -p no:cacheprovider -rfEs -m "gpu and slow" \
    ${TESTS:-tests/gpu/test_server_cuda.py}
fi

[ -n "${BENCH_PID:-}" ] && wait "$BENCH_PID"
[ -n "${UNIT_PID:-}" ] && wait "$UNIT_PID"
[ -n "${JIT_PID:-}" ] && wait "$JIT_PID"
unset CUDA_VISIBLE_DEVICES
# BENCH_AFTER=1: the bench after the tests, alone on GPU 0 (when the tests need every GPU)
[ -n "${BENCH:-}" ] && [ -n "${BENCH_AFTER:-}" ] && run_bench 0
# with PARALLEL, PARTS runs on GPU 0 after the tests / probe and the bench
[ -n "${PARTS_AFTER:-}" ] && run_parts 0
# KIMI_ROUND=1: python -m benchmarks.kimi_round (the measured Kimi K2.6 round model) on GPU 0 after everything else
if [ -n "${KIMI_ROUND:-}" ]; then
  KR_S=$(( $(left) - 45 )); [ "$KR_S" -gt 200 ] && KR_S=200
  # (the stand-in on the path: the Marlin MoE piece and round_parts' bookkeeping import sgl_kernel; without it
  # both fail here and the MoE is timed on the bf16 fallback)
  [ "$KR_S" -gt 40 ] && CUDA_VISIBLE_DEVICES=0 PYTHONPATH="$PWD/tests/e2e/sgl_kernel_cuda:$PYTHONPATH" \
    step kimi_round $(( KR_S + 20 )) python3 -m benchmarks.kimi_round --deadline $(( KR_S - 15 )) \
    --json "$LOGS/kimi_round.json"
fi

# bring SGLang's JIT modules back (carry them as .jitcache-server next time) when they are small enough
tar -czf /tmp/jitcache-server.tar.gz -C "$SGLANG_JIT_CACHE_DIR" . 2>/dev/null
[ "$(du -m /tmp/jitcache-server.tar.gz | cut -f1)" -lt 15 ] && cp /tmp/jitcache-server.tar.gz "$OUT/"
cp "$KDTREE_SERVER_LOGS/table.txt" "$KDTREE_SERVER_LOGS/summary.json" "$OUT/" 2>/dev/null
tar -czf "$OUT/logs.tar.gz" -C "$LOGS" . 2>/dev/null

echo "== steps"; cat "$OUT/steps.txt"
tail -n2 "$LOGS"/plugin*.log
[ -f "$LOGS/tests.log" ] && { grep -E "^(FAILED|ERROR)" "$LOGS/tests.log" | head -12; tail -2 "$LOGS/tests.log"; }
for f in "$KDTREE_SERVER_LOGS"/*.log; do
  [ -f "$f" ] || continue
  # the first error line of each server that logged one
  e=$(grep -m1 -E "Error|error:|Traceback|NotImplementedError" "$f" | cut -c1-160)
  [ -n "$e" ] && echo "$(basename "$f"): $e"
done
[ -f "$LOGS/unit.log" ] && { echo "== unit"; grep -E "^(FAILED|ERROR)" "$LOGS/unit.log" | head; tail -1 "$LOGS/unit.log"; }
for f in "$LOGS"/parts*.log; do [ -f "$f" ] && { echo "== $(basename "$f")"; tail -5 "$f"; }; done
[ -f "$LOGS/kimi_round.log" ] && { echo "== kimi_round"; grep -E "^\||moonshot|FAILED|check" "$LOGS/kimi_round.log" | tail -40; }
[ -f "$LOGS/bench.log" ] && { echo "== bench"; grep -E "^\||verify logits|failed|per step" "$LOGS/bench.log" | head -60; }
echo "== table"
[ -f "$KDTREE_SERVER_LOGS/table.txt" ] && cat "$KDTREE_SERVER_LOGS/table.txt"
[ -f "$LOGS/probe.log" ] && [ ! -f "$KDTREE_SERVER_LOGS/table.txt" ] && tail -30 "$LOGS/probe.log"
true
