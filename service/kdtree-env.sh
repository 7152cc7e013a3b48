# shellcheck shell=bash
# Shared helpers for the sglang-k26-ddtree service scripts; sourced, never run.
#
# One parser for the environment file is used by launch.sh, install.sh and healthcheck.sh, so the command
# that `launch.sh --print` shows is exactly the one the unit runs.

# Paths as seen by the running system. install.sh and rollback.sh prefix them with --root.
# shellcheck disable=SC2034  # used by the scripts that source this file
KDTREE_UNIT_NAME="sglang-k26-ddtree"
KDTREE_UNIT_PATH="/etc/systemd/system/${KDTREE_UNIT_NAME}.service"
KDTREE_ENV_PATH="/etc/default/${KDTREE_UNIT_NAME}"
KDTREE_LIBEXEC_DIR="/usr/local/lib/sglang-kdtree"
KDTREE_STATE_DIR="/var/lib/sglang-kdtree"

kdtree_die() {
    printf '%s: error: %s\n' "${0##*/}" "$*" >&2
    exit 1
}

kdtree_note() {
    printf '%s: %s\n' "${0##*/}" "$*" >&2
}

# kdtree_load_env_file FILE: export every KEY=VALUE line of FILE.
# The syntax is the subset that systemd's EnvironmentFile= and a POSIX shell read alike: blank lines and
# lines starting with '#' or ';' are skipped, one layer of matching single or double quotes around the value
# is removed, nothing is expanded (no $VAR, no backslash escapes). Anything else is refused with its line
# number, because a silently misread line would start the server with the wrong model or budget.
kdtree_load_env_file() {
    local file=$1 line key value lineno=0
    [[ -f $file ]] || kdtree_die "environment file '$file' does not exist (copy service/sglang-k26-ddtree.env.example and edit it)"
    [[ -r $file ]] || kdtree_die "environment file '$file' is not readable by $(id -un)"
    while IFS= read -r line || [[ -n $line ]]; do
        lineno=$((lineno + 1))
        line=${line%$'\r'}
        # Trim surrounding whitespace.
        line=${line#"${line%%[![:space:]]*}"}
        line=${line%"${line##*[![:space:]]}"}
        [[ -z $line || $line == \#* || $line == \;* ]] && continue
        [[ $line == export\ * ]] && kdtree_die "$file:$lineno: drop the 'export' keyword (systemd does not accept it)"
        if [[ ! $line =~ ^([A-Za-z_][A-Za-z0-9_]*)=(.*)$ ]]; then
            kdtree_die "$file:$lineno: expected KEY=VALUE, got '$line'"
        fi
        key=${BASH_REMATCH[1]}
        value=${BASH_REMATCH[2]}
        if [[ ${#value} -ge 2 && ( ( $value == \"*\" ) || ( $value == \'*\' ) ) ]]; then
            value=${value:1:${#value}-2}
        fi
        if [[ $value == *\$* || $value == *\\* ]]; then
            kdtree_die "$file:$lineno: '$key' contains '\$' or '\\'; systemd and the shell would read it differently, use a literal value"
        fi
        export "$key=$value"
    done <"$file"
}

# Serialise install.sh and rollback.sh: take an exclusive lock on fd 9 in state dir $1, held until exit.
kdtree_take_lock() {
    mkdir -p "$1"
    exec 9>"$1/lock"
    flock -n 9 || kdtree_die "another install.sh or rollback.sh holds $1/lock"
}

# --root handling shared by install.sh and rollback.sh. Reads root and restart; sets root (absolute), prefix
# (root without a trailing slash, put in front of every system path), use_systemctl and restart (systemd is
# driven only for the real root, or when SYSTEMCTL names a stand-in command) and systemctl_cmd.
kdtree_target_root() {
    [[ -d $root ]] || kdtree_die "--root '$root' is not a directory"
    root=$(cd "$root" && pwd)
    prefix=${root%/}
    use_systemctl=1
    if [[ -z ${SYSTEMCTL:-} && $root != / ]]; then
        use_systemctl=0
        restart=0
        kdtree_note "--root $root without SYSTEMCTL: systemd is not called and nothing is restarted"
    fi
    read -ra systemctl_cmd <<<"${SYSTEMCTL:-systemctl}"
}

# kdtree_is_uint VALUE MAX: true when VALUE is a decimal integer in 1..MAX (no leading zeros, which bash
# arithmetic would read as octal).
kdtree_is_uint() {
    [[ $1 =~ ^[1-9][0-9]{0,6}$ ]] && (($1 <= $2))
}

# kdtree_visible_gpus: print how many GPUs the server would see.
# GPU_COUNT_CMD (a shell command printing one integer) replaces nvidia-smi, for tests and for hosts where
# nvidia-smi is elsewhere. CUDA_VISIBLE_DEVICES, when set (also to an empty string), narrows the count.
kdtree_visible_gpus() {
    local physical out
    if [[ -n ${GPU_COUNT_CMD:-} ]]; then
        out=$(timeout 60 bash -c "$GPU_COUNT_CMD") || kdtree_die "GPU_COUNT_CMD '$GPU_COUNT_CMD' failed"
        out=${out//[[:space:]]/}
        [[ $out =~ ^[0-9]+$ ]] || kdtree_die "GPU_COUNT_CMD '$GPU_COUNT_CMD' printed '$out', expected one integer"
        physical=$out
    else
        command -v nvidia-smi >/dev/null 2>&1 ||
            kdtree_die "cannot count GPUs: nvidia-smi is not on PATH (set GPU_COUNT_CMD to a command that prints the GPU count)"
        out=$(timeout 60 nvidia-smi -L) || kdtree_die "'nvidia-smi -L' failed; is the NVIDIA driver loaded?"
        physical=$(grep -c '^GPU ' <<<"$out" || true)
    fi
    if [[ -n ${CUDA_VISIBLE_DEVICES+set} ]]; then
        local listed=0 entry
        local -a entries
        IFS=',' read -ra entries <<<"$CUDA_VISIBLE_DEVICES"
        for entry in "${entries[@]}"; do
            [[ -n ${entry//[[:space:]]/} ]] && listed=$((listed + 1))
        done
        ((listed < physical)) && physical=$listed
    fi
    printf '%s\n' "$physical"
}

# kdtree_health_base_url: the URL a local client uses to reach KDTREE_HOST:KDTREE_PORT. A wildcard bind
# address is reached through loopback.
kdtree_health_base_url() {
    local host=${KDTREE_HOST:-127.0.0.1} port=${KDTREE_PORT:-30000}
    case $host in
        0.0.0.0 | "") host=127.0.0.1 ;;
        :: | "[::]") host="[::1]" ;;
        \[*) ;;
        *:*) host="[$host]" ;;
    esac
    printf 'http://%s:%s\n' "$host" "$port"
}
