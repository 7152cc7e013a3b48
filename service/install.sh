#!/usr/bin/env bash
# Install (or upgrade to) the sglang-kdtree version of the sglang-k26-ddtree service, reversibly.
#
# Usage: install.sh --env-file FILE [--root DIR] [--dry-run] [--no-restart]
#   --env-file FILE  the site settings to install as /etc/default/sglang-k26-ddtree
#                    (start from service/sglang-k26-ddtree.env.example)
#   --root DIR       treat DIR as / for every file written or backed up (tests, image builds); without
#                    SYSTEMCTL set, systemctl is then not called and nothing is restarted
#   --dry-run        run the preflight and print every change (file diffs, commands) without making any
#   --no-restart     install the files and reload systemd, but leave the running service alone
#
# Steps: preflight (Python and SGLang versions, kdtree resolves after load_plugins(), the command line passes
# SGLang's argument parser and KDTREE's startup checks, GPU count >= TP, model paths exist, no drop-in
# overrides ExecStart); back up the unit, env file and scripts about to change
# (under /var/lib/sglang-kdtree/backups); install; systemctl daemon-reload and restart; healthcheck.sh.
# If the restart or the healthcheck fails, rollback.sh restores the backup and restarts the old service.
# Running it again with the same inputs changes nothing. Nothing is changed when the preflight fails.
#
# Overrides for tests and unusual hosts: SYSTEMCTL (systemctl command), GPU_COUNT_CMD (prints the GPU count,
# instead of nvidia-smi), GPU_COMPUTE_CAP_CMD (prints the GPUs' compute capabilities, instead of nvidia-smi), CURL;
# the Python checked and run is KDTREE_PYTHON from the env file.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source-path=SCRIPTDIR source=kdtree-env.sh
. "$here/kdtree-env.sh"

usage() { sed -n '2,20s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"; }

env_src="" root="/" dry_run=0 restart=1
while (($#)); do
    case $1 in
        --env-file) (($# >= 2)) || kdtree_die "--env-file needs a path"; env_src=$2; shift 2 ;;
        --root) (($# >= 2)) || kdtree_die "--root needs a directory"; root=$2; shift 2 ;;
        --dry-run) dry_run=1; shift ;;
        --no-restart) restart=0; shift ;;
        -h | --help) usage; exit 0 ;;
        *) kdtree_die "unknown option '$1' (see --help)" ;;
    esac
done
[[ -n $env_src ]] || kdtree_die "--env-file is required (start from $here/sglang-k26-ddtree.env.example)"
kdtree_target_root
env_src=$(cd "$(dirname "$env_src")" && pwd)/$(basename "$env_src")

# Managed files: source, destination (as seen by the running system), mode. The env file is 0640 because it
# may hold an API key.
sources=("$here/sglang-k26-ddtree.service" "$env_src" "$here/launch.sh" "$here/healthcheck.sh"
    "$here/rollback.sh" "$here/kdtree-env.sh" "$here/README.md")
targets=("$KDTREE_UNIT_PATH" "$KDTREE_ENV_PATH" "$KDTREE_LIBEXEC_DIR/launch.sh" "$KDTREE_LIBEXEC_DIR/healthcheck.sh"
    "$KDTREE_LIBEXEC_DIR/rollback.sh" "$KDTREE_LIBEXEC_DIR/kdtree-env.sh" "$KDTREE_LIBEXEC_DIR/README.md")
modes=(0644 0640 0755 0755 0755 0644 0644)

# ---------------------------------------------------------------------------------------------- preflight
preflight_failed=0
check_fail() {
    printf '  FAIL %s\n' "$*" >&2
    preflight_failed=1
}
check_ok() { printf '  ok   %s\n' "$*"; }

echo "preflight:"
for src in "${sources[@]}"; do
    [[ -f $src ]] || kdtree_die "missing source file '$src'"
done

# launch.sh --print checks the env file (paths, TP against visible GPUs, budget, backend against the GPUs' compute
# capability, extra flags: the code the unit runs at every start) and then, with the service's Python,
# kdtree_service_checks (Python and SGLang versions, the plugin resolves, the server's own flag checks). One
# implementation, so `launch.sh --print` run by hand refuses what this preflight refuses. Its check lines come
# first, the command line last.
command_line=""
if launch_output=$(KDTREE_ENV_FILE="" "$here/launch.sh" --env-file "$env_src" --print 2>&1); then
    command_line=${launch_output##*$'\n'}
    launch_output=${launch_output%"$command_line"}
else
    preflight_failed=1
fi
while IFS= read -r line; do
    case $line in
        "") ;;
        "  ok   "*) printf '%s\n' "$line" ;;
        "  FAIL "*) printf '%s\n' "$line" >&2 ;;
        *) check_fail "${line#launch.sh: error: }" ;;
    esac
done <<<"$launch_output"
[[ -z $command_line ]] || check_ok "command line: $command_line"

# A drop-in that sets ExecStart= would keep running the old command under the new unit.
dropin_dir=$prefix$KDTREE_UNIT_PATH.d
if [[ -d $dropin_dir ]]; then
    for dropin in "$dropin_dir"/*.conf; do
        [[ -f $dropin ]] || continue
        if grep -Eq '^[[:space:]]*ExecStart[[:space:]]*=' "$dropin"; then
            check_fail "drop-in $dropin overrides ExecStart=; move it away first (rollback will not restore it)"
        else
            check_ok "drop-in $dropin kept (does not override ExecStart=)"
        fi
    done
fi
if ((use_systemctl)) && ! command -v "${systemctl_cmd[0]}" >/dev/null 2>&1; then
    check_fail "systemctl command '${systemctl_cmd[0]}' not found"
fi

((preflight_failed)) && kdtree_die "preflight failed; nothing was changed"

# ------------------------------------------------------------------------------------------------- plan
changed=()
for i in "${!sources[@]}"; do
    dest=$prefix${targets[i]}
    if [[ -f $dest ]] && cmp -s "${sources[i]}" "$dest" &&
        [[ $(stat -c '%a' "$dest") == "${modes[i]#0}" ]]; then
        continue
    fi
    changed+=("$i")
done

if ((${#changed[@]} == 0)); then
    echo "already installed: every file under $root matches; nothing to do"
    exit 0
fi

backups_dir=$prefix$KDTREE_STATE_DIR/backups
echo "changes:"
for i in "${changed[@]}"; do
    dest=$prefix${targets[i]}
    if [[ -e $dest ]]; then
        echo "  replace $dest (mode ${modes[i]})"
        diff -u --label "$dest (current)" --label "$dest (new)" "$dest" "${sources[i]}" |
            sed -e 's/^\([-+ ]KDTREE_API_KEY=\).\{1,\}/\1<hidden>/' -e 's/^/    /' || true
    else
        echo "  create  $dest (mode ${modes[i]}) from ${sources[i]}"
    fi
done
echo "  back up the current version of every file above under $backups_dir/"
if ((use_systemctl)); then
    echo "  run: ${systemctl_cmd[*]} daemon-reload"
    if ((restart)); then
        echo "  run: ${systemctl_cmd[*]} restart $KDTREE_UNIT_NAME"
        echo "  run: $here/healthcheck.sh --env-file $prefix$KDTREE_ENV_PATH --unit $KDTREE_UNIT_NAME; on failure $here/rollback.sh"
    fi
fi
if ((dry_run)); then
    echo "dry run: nothing was changed"
    exit 0
fi

# ----------------------------------------------------------------------------------------------- backup
mkdir -p "$backups_dir"
kdtree_take_lock "$prefix$KDTREE_STATE_DIR"

# Backups stack up: each install that changes something pushes one, each rollback pops the newest.
last=$(find "$backups_dir" -mindepth 1 -maxdepth 1 -type d -name '[0-9]*' -printf '%f\n' | sort -n | tail -n 1)
seq=1
[[ -n $last ]] && seq=$((10#${last%%-*} + 1))
backup=$backups_dir/$(printf '%04d' "$seq")-$(date -u +%Y%m%dT%H%M%SZ)
mkdir -p "$backup/files"
service_state=unknown
if ((use_systemctl)); then
    service_state=$(timeout 30 "${systemctl_cmd[@]}" is-active "$KDTREE_UNIT_NAME" 2>/dev/null) || true
fi
{
    echo "# sglang-kdtree install backup: the state before $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    printf 'service\t%s\n' "${service_state:-unknown}"
    # Directories the install will create, outermost first, so rollback can remove them again.
    declare -A seen_dirs=()
    for target in "${targets[@]}"; do
        missing=() dir=$(dirname "$target")
        while [[ $dir != / && ! -d $prefix$dir ]]; do
            missing=("$dir" "${missing[@]}")
            dir=$(dirname "$dir")
        done
        for dir in "${missing[@]}"; do
            [[ -n ${seen_dirs[$dir]:-} ]] && continue
            seen_dirs[$dir]=1
            printf 'createddir\t%s\n' "$dir"
        done
    done
    for i in "${!targets[@]}"; do
        dest=$prefix${targets[i]}
        if [[ -e $dest ]]; then
            mkdir -p "$backup/files$(dirname "${targets[i]}")"
            cp -p "$dest" "$backup/files${targets[i]}"
            printf 'present\t%s\n' "${targets[i]}"
        else
            printf 'absent\t%s\n' "${targets[i]}"
        fi
    done
} >"$backup/manifest.tmp"
# The manifest appears only once the copies are complete, so rollback never restores a partial backup.
mv "$backup/manifest.tmp" "$backup/manifest"
echo "backed up to $backup"

# ---------------------------------------------------------------------------------------------- install
for i in "${changed[@]}"; do
    dest=$prefix${targets[i]}
    mkdir -p "$(dirname "$dest")"
    # Write beside the destination and rename, so a running script or a reader never sees half a file.
    tmp=$(mktemp "$dest.kdtree-new.XXXXXX")
    cp "${sources[i]}" "$tmp"
    chmod "${modes[i]}" "$tmp"
    # Keep the owner and group of a file being replaced: a unit with User= reads the 0640 env file through
    # its group.
    if [[ -e $dest ]]; then
        chown --reference="$dest" "$tmp" 2>/dev/null || kdtree_note "could not keep the owner and group of $dest"
    fi
    mv -f "$tmp" "$dest"
    echo "installed $dest"
done

roll_back() {
    kdtree_note "$*; rolling back to $backup"
    flock -u 9
    if "$here/rollback.sh" --root "$root"; then
        kdtree_die "install failed ($*); the previous files were restored and the previous service restarted"
    fi
    kdtree_die "install failed ($*) and the rollback failed too; restore by hand from $backup"
}

if ((use_systemctl)); then
    timeout 120 "${systemctl_cmd[@]}" daemon-reload || roll_back "systemctl daemon-reload failed"
fi
if ((!restart)); then
    echo "installed; the service was not restarted"
    exit 0
fi
# A blocking restart returns once the old server is gone and the new one passed the unit's ExecStartPost
# healthcheck (bounded by TimeoutStartSec=45min), so the check below cannot be answered by the old server
# still holding the port.
echo "restarting $KDTREE_UNIT_NAME; loading the model takes a while (follow it: journalctl -fu $KDTREE_UNIT_NAME)"
timeout 3000 "${systemctl_cmd[@]}" restart "$KDTREE_UNIT_NAME" ||
    roll_back "systemctl restart $KDTREE_UNIT_NAME failed (the new server did not start or did not get healthy)"
if ! "$here/healthcheck.sh" --env-file "$prefix$KDTREE_ENV_PATH" --unit "$KDTREE_UNIT_NAME"; then
    roll_back "the healthcheck failed after the restart"
fi
echo "installed and healthy; undo with: $KDTREE_LIBEXEC_DIR/rollback.sh"
