#!/usr/bin/env bash
# Build, validate and run the SGLang server command for the sglang-k26-ddtree service.
#
# Usage: launch.sh [--env-file FILE] [--print]
#   --env-file FILE  environment file to read (default: $KDTREE_ENV_FILE, else /etc/default/sglang-k26-ddtree)
#   --print          validate and print the command line instead of running it; this also runs the checks
#                    of install.sh's preflight that need the service's Python (version, SGLang pin, the plugin
#                    resolves, the server's own flag checks; about half a minute), so it refuses what an
#                    install refuses. The check lines go to stderr, the command line to stdout.
#
# Every KEY=VALUE of the file is exported to the server (so CUDA_VISIBLE_DEVICES, HF_HUB_OFFLINE, SGLANG_*
# such as SGLANG_KDTREE_MOE can be set there); the KDTREE_* keys build the command line, see
# sglang-k26-ddtree.env.example. Without KDTREE_BUDGET no --speculative-num-draft-tokens is passed, and the
# plugin chooses its verify width each round. A file with problems is refused with all of them listed, one
# "error:" line each, and exit status 1.
# The server is exec'ed, so under systemd its PID is the unit's main PID and receives SIGTERM directly.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source-path=SCRIPTDIR source=kdtree-env.sh
. "$here/kdtree-env.sh"

usage() { sed -n '2,17s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"; }

env_file=${KDTREE_ENV_FILE:-$KDTREE_ENV_PATH}
print_only=0
while (($#)); do
    case $1 in
        --env-file) (($# >= 2)) || kdtree_die "--env-file needs a path"; env_file=$2; shift 2 ;;
        --print) print_only=1; shift ;;
        -h | --help) usage; exit 0 ;;
        *) kdtree_die "unknown option '$1' (see --help)" ;;
    esac
done

kdtree_load_env_file "$env_file"

# Every check below records what is wrong (kdtree_problem) and goes on, so one run lists all the problems of the
# file; kdtree_report_problems then refuses it, one error line each, before anything runs.

# Flags the env file controls through KDTREE_* keys; repeating them in KDTREE_EXTRA_ARGS would make the
# effective value depend on argparse's last-one-wins rule, so it is refused.
managed_flags=(--model-path --model --tp --tp-size --tensor-parallel-size --speculative-algorithm
    --speculative-draft-model-path --speculative-num-draft-tokens --speculative-dflash-block-size
    --attention-backend --page-size --host --port --api-key)

# require KEY WHAT: true when KEY has a value. Otherwise a problem, unless the parser refused KEY's line already
# (that line is the problem to fix).
require() {
    [[ -n ${!1:-} ]] && return 0
    [[ " ${kdtree_refused_keys[*]} " == *" $1 "* ]] || kdtree_problem "$env_file: $1 is not set ($2)"
    return 1
}

# checkpoint KEY WHAT: true when KEY names a directory with a config.json.
checkpoint() {
    require "$1" "$2" || return 1
    local path=${!1}
    if [[ ! -d $path ]]; then
        kdtree_problem "$1 '$path' is not a directory"
    elif [[ ! -f $path/config.json ]]; then
        kdtree_problem "$1 '$path' has no config.json; point it at the checkpoint directory"
    else
        return 0
    fi
    return 1
}

python=""
if require KDTREE_PYTHON "the Python interpreter of the SGLang environment, e.g. /opt/sglang-kdtree/venv/bin/python"; then
    python=$KDTREE_PYTHON
    if [[ $python != */* ]] && ! python=$(command -v "$python"); then
        kdtree_problem "KDTREE_PYTHON '$KDTREE_PYTHON' is not on PATH"
    elif [[ ! -f $python || ! -x $python ]]; then
        kdtree_problem "KDTREE_PYTHON '$python' is not an executable file"
    fi
fi

# The target's attention type decides which backends can verify a tree: unknown ("") while its config.json
# cannot be read, and then the backend is not judged by it.
is_mla=""
if checkpoint KDTREE_MODEL_PATH "the target model directory"; then
    is_mla=0
    grep -Eq '"kv_lora_rank"[[:space:]]*:[[:space:]]*[0-9]' "$KDTREE_MODEL_PATH/config.json" && is_mla=1
fi
checkpoint KDTREE_DRAFT_MODEL_PATH "the DFlash drafter directory" || true

if require KDTREE_TP_SIZE "tensor-parallel size, e.g. 8"; then
    if ! kdtree_is_uint "$KDTREE_TP_SIZE" 1024; then
        kdtree_problem "KDTREE_TP_SIZE '$KDTREE_TP_SIZE' is not a positive integer"
    elif kdtree_count_visible_gpus && ((KDTREE_TP_SIZE > kdtree_visible_gpus)); then
        counted_by="nvidia-smi -L"
        [[ -n ${GPU_COUNT_CMD:-} ]] && counted_by="GPU_COUNT_CMD '$GPU_COUNT_CMD'"
        [[ -n ${CUDA_VISIBLE_DEVICES+set} ]] && counted_by+=", narrowed by CUDA_VISIBLE_DEVICES='$CUDA_VISIBLE_DEVICES'"
        kdtree_problem "KDTREE_TP_SIZE=$KDTREE_TP_SIZE but only $kdtree_visible_gpus GPU(s) are visible ($counted_by); lower KDTREE_TP_SIZE or free GPUs"
    fi
fi

# Without a budget no width is pinned: the plugin then verifies one of its automatic widths each round
# (SGLANG_KDTREE_VERIFY_WIDTHS), the recommended launch. A budget pins one width; it counts tree nodes below the
# root, and SGLang's verify width also holds the root (the bonus token).
num_draft_tokens=""
budget=${KDTREE_BUDGET:-}
if [[ -n $budget ]]; then
    if kdtree_is_uint "$budget" 1024; then
        num_draft_tokens=$((budget + 1))
    else
        kdtree_problem "KDTREE_BUDGET '$budget' must be an integer in 1..1024 (or unset for the automatic verify widths)"
    fi
fi

block_size=${KDTREE_DFLASH_BLOCK_SIZE:-}
if [[ -n $block_size ]]; then
    # The plugin accepts 2..32 (draft depth = block size - 1 <= 31).
    if ! kdtree_is_uint "$block_size" 32 || ((block_size < 2)); then
        kdtree_problem "KDTREE_DFLASH_BLOCK_SIZE '$block_size' must be an integer in 2..32 (or empty for the drafter's own block size)"
    fi
fi

backend=""
if require KDTREE_ATTENTION_BACKEND "triton, fa3 (Hopper) or flashinfer (MHA models)"; then
    backend=$KDTREE_ATTENTION_BACKEND
    case $backend in
        triton) ;;
        fa3)
            # SGLang's fa3 backend asserts (major == 8 and not MLA) or major == 9 only once the weights are loaded
            # (srt/layers/attention/attention_registry.py): judged here from the GPUs' compute capability.
            refused_caps=()
            if kdtree_read_compute_caps; then
                for cap in $kdtree_compute_caps; do
                    major=${cap%%.*}
                    if ((major == 9)) || { ((major == 8)) && [[ $is_mla != 1 ]]; }; then
                        continue
                    fi
                    refused_caps+=("$cap")
                done
            fi
            if ((${#refused_caps[@]})); then
                why="(SGLang's fa3 backend runs on compute capability 9.x, and on 8.x for MHA targets)"
                if [[ $is_mla == 1 ]]; then
                    why="with an MLA target ('$KDTREE_MODEL_PATH' has kv_lora_rank; SGLang's fa3 backend serves MLA on compute capability 9.x only)"
                fi
                caps_list=$(IFS=,; printf '%s' "${refused_caps[*]}")
                kdtree_problem "KDTREE_ATTENTION_BACKEND=fa3 (--attention-backend fa3) is not supported on compute capability ${caps_list//,/, } $why; use KDTREE_ATTENTION_BACKEND=triton"
            fi
            ;;
        flashinfer)
            # FlashInfer's MLA path plans causal attention and ignores the tree mask, so only MHA models may use it.
            if [[ $is_mla == 1 ]]; then
                kdtree_problem "KDTREE_ATTENTION_BACKEND=flashinfer does not apply the tree mask for MLA models like '$KDTREE_MODEL_PATH'; use triton (or fa3 on Hopper)"
            fi
            ;;
        *) kdtree_problem "KDTREE_ATTENTION_BACKEND '$backend' cannot verify a tree; use triton (MLA or MHA), fa3 (Hopper) or flashinfer (MHA only)" ;;
    esac
fi

require KDTREE_HOST "bind address, e.g. 0.0.0.0" || true
if require KDTREE_PORT "HTTP port, e.g. 30000" && ! kdtree_is_uint "$KDTREE_PORT" 65535; then
    kdtree_problem "KDTREE_PORT '$KDTREE_PORT' must be an integer in 1..65535"
fi

extra_args=()
if [[ -n ${KDTREE_EXTRA_ARGS:-} ]]; then
    # Split on whitespace only; the env file has no quoting inside a value.
    read -ra extra_args <<<"$KDTREE_EXTRA_ARGS"
fi
for arg in "${extra_args[@]}"; do
    for flag in "${managed_flags[@]}"; do
        if [[ $arg == "$flag" || $arg == "$flag="* ]]; then
            kdtree_problem "KDTREE_EXTRA_ARGS repeats '$flag', which the env file already sets through its KDTREE_* key; remove it from KDTREE_EXTRA_ARGS"
        fi
    done
done

kdtree_report_problems

cmd=("$python" -m sglang.launch_server
    --model-path "$KDTREE_MODEL_PATH"
    --tp "$KDTREE_TP_SIZE"
    --speculative-algorithm kdtree
    --speculative-draft-model-path "$KDTREE_DRAFT_MODEL_PATH")
[[ -n $num_draft_tokens ]] && cmd+=(--speculative-num-draft-tokens "$num_draft_tokens")
[[ -n $block_size ]] && cmd+=(--speculative-dflash-block-size "$block_size")
# Tree verify writes one KV slot per tree node at arbitrary positions, which needs page size 1.
cmd+=(--attention-backend "$backend" --page-size 1)
cmd+=("${extra_args[@]}")
cmd+=(--host "$KDTREE_HOST" --port "$KDTREE_PORT")
[[ -n ${KDTREE_API_KEY:-} ]] && cmd+=(--api-key "$KDTREE_API_KEY")

if ((print_only)); then
    if [[ -n ${KDTREE_API_KEY:-} ]]; then
        cmd[${#cmd[@]} - 1]="<KDTREE_API_KEY>"
    fi
    shown=$(printf '%q' "${cmd[0]}" && printf ' %q' "${cmd[@]:1}")
    # The same checks install.sh's preflight runs (it runs this script), so a file that --print accepts is one
    # an install accepts. The API key is masked here too: the parser does not look at its value.
    if ! checks=$(kdtree_service_checks "$python" "$shown"); then
        printf '%s\n' "$checks" >&2
        kdtree_die "the service's Python refuses this setup (the FAIL lines above)"
    fi
    printf '%s\n' "$checks" >&2
    printf '%s\n' "$shown"
    exit 0
fi

exec "${cmd[@]}"
