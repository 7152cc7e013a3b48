#!/usr/bin/env bash
# Undo the last install.sh: restore the unit, env file and scripts byte for byte (with their modes) from
# the newest backup, reload systemd and bring the previous service back.
#
# Usage: rollback.sh [--root DIR] [--dry-run] [--no-restart] [--list]
#   --root DIR     the same root prefix install.sh was given (default /)
#   --dry-run      print what would be restored and run, change nothing
#   --no-restart   restore the files and reload systemd, but leave the service alone
#   --list         list the backups, newest last, and exit
#
# Files that did not exist before the install are removed. The service is stopped first (under the unit
# that is installed now), then started again from the restored unit if it was running before the install;
# start is queued (--no-block) because the old server may take as long to load as the new one.
# Each rollback consumes the newest backup (moved to backups/restored/), so repeated rollbacks walk back
# through earlier installs. SYSTEMCTL replaces the systemctl command (tests).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source-path=SCRIPTDIR source=kdtree-env.sh
. "$here/kdtree-env.sh"

usage() { sed -n '2,16s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"; }

root="/" dry_run=0 restart=1 list=0
while (($#)); do
    case $1 in
        --root) (($# >= 2)) || kdtree_die "--root needs a directory"; root=$2; shift 2 ;;
        --dry-run) dry_run=1; shift ;;
        --no-restart) restart=0; shift ;;
        --list) list=1; shift ;;
        -h | --help) usage; exit 0 ;;
        *) kdtree_die "unknown option '$1' (see --help)" ;;
    esac
done
kdtree_target_root

backups_dir=$prefix$KDTREE_STATE_DIR/backups
complete_backups() {
    [[ -d $backups_dir ]] || return 0
    # Names start with a zero-padded sequence number, so a plain sort is chronological.
    find "$backups_dir" -mindepth 2 -maxdepth 2 -name manifest -printf '%h\n' | sort
}
if ((list)); then
    complete_backups
    exit 0
fi

backup=$(complete_backups | tail -n 1)
[[ -n $backup ]] || kdtree_die "no backup to restore under $backups_dir (was install.sh run with --root $root?)"
manifest=$backup/manifest
service_before=$(awk -F'\t' '$1 == "service" { print $2 }' "$manifest")

echo "restoring the state saved in $backup (service was: ${service_before:-unknown})"
entries=() created_dirs=()
while IFS=$'\t' read -r kind path; do
    case $kind in
        present | absent) ;;
        createddir)
            created_dirs+=("$path")
            continue
            ;;
        service | "" | \#*) continue ;;
        *) kdtree_die "$manifest: unknown entry '$kind'" ;;
    esac
    [[ $path == /* && $path != *..* ]] || kdtree_die "$manifest: refusing path '$path'"
    if [[ $kind == present ]]; then
        [[ -f $backup/files$path ]] || kdtree_die "$manifest lists $path but $backup/files$path is missing"
        echo "  restore $prefix$path"
    else
        echo "  remove  $prefix$path (it did not exist before the install)"
    fi
    entries+=("$kind" "$path")
done <"$manifest"

start_again=0
if ((restart)) && [[ $service_before == active || $service_before == activating || $service_before == reloading ]]; then
    start_again=1
fi
if ((use_systemctl)); then
    ((restart)) && echo "  run: ${systemctl_cmd[*]} stop $KDTREE_UNIT_NAME"
    echo "  run: ${systemctl_cmd[*]} daemon-reload"
    ((start_again)) && echo "  run: ${systemctl_cmd[*]} start --no-block $KDTREE_UNIT_NAME"
fi
if ((dry_run)); then
    echo "dry run: nothing was changed"
    exit 0
fi

kdtree_take_lock "$prefix$KDTREE_STATE_DIR"

if ((use_systemctl && restart)); then
    # Stop under the unit that is loaded now: its stop settings match the processes that are running.
    timeout 600 "${systemctl_cmd[@]}" stop "$KDTREE_UNIT_NAME" ||
        kdtree_note "systemctl stop $KDTREE_UNIT_NAME failed; restoring the files anyway"
fi

for ((i = 0; i < ${#entries[@]}; i += 2)); do
    kind=${entries[i]} path=${entries[i + 1]}
    dest=$prefix$path
    if [[ $kind == present ]]; then
        mkdir -p "$(dirname "$dest")"
        # Copy beside the destination (keeping mode and times) and rename: atomic, and a script that is
        # running from the old file keeps reading its own copy.
        tmp=$(mktemp "$dest.kdtree-restore.XXXXXX")
        cp -p "$backup/files$path" "$tmp"
        mv -f "$tmp" "$dest"
    else
        rm -f "$dest"
    fi
done
# Directories the install created go too (deepest first, only when empty), so the tree matches the one
# before the install.
for ((i = ${#created_dirs[@]} - 1; i >= 0; i--)); do
    rmdir --ignore-fail-on-non-empty "$prefix${created_dirs[i]}"
done

mkdir -p "$backups_dir/restored"
mv "$backup" "$backups_dir/restored/"
echo "restored; the backup moved to $backups_dir/restored/${backup##*/}"

if ((use_systemctl)); then
    timeout 120 "${systemctl_cmd[@]}" daemon-reload || kdtree_die "systemctl daemon-reload failed after restoring the files"
    if ((start_again)); then
        timeout 120 "${systemctl_cmd[@]}" start --no-block "$KDTREE_UNIT_NAME" ||
            kdtree_die "the files were restored but 'systemctl start $KDTREE_UNIT_NAME' failed (journalctl -u $KDTREE_UNIT_NAME)"
        echo "started the previous $KDTREE_UNIT_NAME; follow it with: journalctl -fu $KDTREE_UNIT_NAME"
    elif ((restart)); then
        echo "the service was not running before the install; it stays stopped"
    fi
fi
