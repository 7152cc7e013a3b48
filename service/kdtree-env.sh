# shellcheck shell=bash
# Shared helpers for the sglang-k26-ddtree service scripts; sourced, never run.
#
# One parser for the environment file is used by launch.sh, install.sh and healthcheck.sh, so the command
# that `launch.sh --print` shows is exactly the one the unit runs; one set of checks with the service's Python
# (kdtree_service_checks) is run by `launch.sh --print` and by install.sh's preflight, so both refuse the same
# files.

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

# Problems of an env file are collected, not fatal one by one, so that one run reports all of them (as the
# plugin's startup refusals do) and the operator fixes the file in one pass. kdtree_problem records one (one
# line, no newline); kdtree_report_problems prints each as an error line and exits 1 if there is any.
kdtree_problems=()
kdtree_problem() {
    kdtree_problems+=("${*//$'\n'/ | }")
}
kdtree_report_problems() {
    local problem
    if ((${#kdtree_problems[@]})); then
        for problem in "${kdtree_problems[@]}"; do
            printf '%s: error: %s\n' "${0##*/}" "$problem" >&2
        done
        exit 1
    fi
}

# kdtree_load_env_file FILE: export every KEY=VALUE line of FILE.
# The syntax is the subset that systemd's EnvironmentFile= and a POSIX shell read alike: blank lines and
# lines starting with '#' or ';' are skipped, one layer of matching single or double quotes around the value
# is removed, nothing is expanded (no $VAR, no backslash escapes). Anything else is a problem (kdtree_problem)
# naming its line number, because a silently misread line would start the server with the wrong model or
# budget; the caller reports them (kdtree_report_problems). A refused line's key, where one can be read, goes to
# kdtree_refused_keys, so that the caller's checks do not report it a second time as unset.
kdtree_refused_keys=()
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
        if [[ $line =~ ^export[[:space:]]+([A-Za-z_][A-Za-z0-9_]*)= ]]; then
            kdtree_refused_keys+=("${BASH_REMATCH[1]}")
            kdtree_problem "$file:$lineno: drop the 'export' keyword (systemd does not accept it)"
            continue
        fi
        if [[ ! $line =~ ^([A-Za-z_][A-Za-z0-9_]*)=(.*)$ ]]; then
            kdtree_problem "$file:$lineno: expected KEY=VALUE, got '$line'"
            continue
        fi
        key=${BASH_REMATCH[1]}
        value=${BASH_REMATCH[2]}
        if [[ ${#value} -ge 2 && ( ( $value == \"*\" ) || ( $value == \'*\' ) ) ]]; then
            value=${value:1:${#value}-2}
        fi
        if [[ $value == *\$* || $value == *\\* ]]; then
            kdtree_refused_keys+=("$key")
            kdtree_problem "$file:$lineno: '$key' contains '\$' or '\\'; systemd and the shell would read it differently, use a literal value"
            continue
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

# kdtree_count_visible_gpus: set kdtree_visible_gpus to how many GPUs the server would see, or record a problem
# (kdtree_problem) and return 1 when they cannot be counted.
# GPU_COUNT_CMD (a shell command printing one integer) replaces nvidia-smi, for tests and for hosts where
# nvidia-smi is elsewhere. CUDA_VISIBLE_DEVICES, when set (also to an empty string), narrows the count.
kdtree_visible_gpus=""
kdtree_count_visible_gpus() {
    local physical out
    kdtree_visible_gpus=""
    if [[ -n ${GPU_COUNT_CMD:-} ]]; then
        if ! out=$(timeout 60 bash -c "$GPU_COUNT_CMD"); then
            kdtree_problem "GPU_COUNT_CMD '$GPU_COUNT_CMD' failed"
            return 1
        fi
        out=${out//[[:space:]]/}
        if [[ ! $out =~ ^[0-9]+$ ]]; then
            kdtree_problem "GPU_COUNT_CMD '$GPU_COUNT_CMD' printed '$out', expected one integer"
            return 1
        fi
        physical=$out
    else
        if ! command -v nvidia-smi >/dev/null 2>&1; then
            kdtree_problem "cannot count GPUs: nvidia-smi is not on PATH (set GPU_COUNT_CMD to a command that prints the GPU count)"
            return 1
        fi
        if ! out=$(timeout 60 nvidia-smi -L); then
            kdtree_problem "'nvidia-smi -L' failed; is the NVIDIA driver loaded?"
            return 1
        fi
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
    kdtree_visible_gpus=$physical
}

# kdtree_read_compute_caps: set kdtree_compute_caps to the distinct compute capabilities of the GPUs ("12.0",
# "9.0"), one per line, or to nothing when they cannot be read here (then the caller does not judge the backend
# by them). GPU_COMPUTE_CAP_CMD (a shell command printing one capability per line) replaces nvidia-smi's query;
# when it fails, a problem is recorded (kdtree_problem) and the function returns 1.
kdtree_compute_caps=""
kdtree_read_compute_caps() {
    local out
    kdtree_compute_caps=""
    if [[ -n ${GPU_COMPUTE_CAP_CMD:-} ]]; then
        if ! out=$(timeout 60 bash -c "$GPU_COMPUTE_CAP_CMD"); then
            kdtree_problem "GPU_COMPUTE_CAP_CMD '$GPU_COMPUTE_CAP_CMD' failed"
            return 1
        fi
    elif command -v nvidia-smi >/dev/null 2>&1; then
        out=$(timeout 60 nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null) || return 0
    else
        return 0
    fi
    kdtree_compute_caps=$(sed -nE 's/^[[:space:]]*([0-9]+\.[0-9]+).*/\1/p' <<<"$out" | sort -u)
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

# The Python side of kdtree_service_checks, run by the service's interpreter: one "key value" line per finding.
read -r -d '' _KDTREE_CHECKS_PY <<'EOF' || true
import os
import sys
import warnings
from importlib import metadata

warnings.simplefilter("ignore")  # SGLang's import warnings are not findings; the lines below are the report
print("python", ".".join(map(str, sys.version_info[:3])))
for dist in ("sglang", "sglang-kdtree"):
    try:
        print(dist, metadata.version(dist))
    except metadata.PackageNotFoundError:
        print(dist, "missing")
pins = []
try:
    pins = [r.split(";")[0].replace(" ", "") for r in metadata.requires("sglang-kdtree") or []]
except metadata.PackageNotFoundError:
    pass
print("sglang-pin", next((r.split("==", 1)[1] for r in pins if r.startswith("sglang==")), "none"))
try:
    from sglang.srt.plugins import load_plugins
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    load_plugins()
    print("kdtree resolves", type(SpeculativeAlgorithm.from_string("kdtree")).__name__)
except Exception as exc:  # report any failure as a finding, not a traceback
    print("kdtree error", f"{type(exc).__name__}: {exc}".replace("\n", " "))

command = os.environ.get("KDTREE_PREFLIGHT_COMMAND", "")
try:
    from sglang_kdtree.cli.doctor_launch import launch_args_problem, server_argv

    problem = launch_args_problem(server_argv(command))
    print("flags ok" if problem is None else "flags error " + problem.replace("\n", " "))
except Exception as exc:
    print("flags error", f"{type(exc).__name__}: {exc}".replace("\n", " "))
EOF

# Helpers of kdtree_service_checks; they read its locals report and failed (bash scoping is dynamic).
_kdtree_field() { awk -v k="$1" '$1 == k { $1 = ""; sub(/^ /, ""); print; exit }' <<<"$report"; }
_kdtree_ok() { printf '  ok   %s\n' "$*"; }
_kdtree_fail() {
    # One line per finding: a multi-line Python report is joined, so callers can read the lines as findings.
    printf '  FAIL %s\n' "${*//$'\n'/ | }"
    failed=1
}

# kdtree_service_checks PYTHON COMMAND: the checks that need the service's own Python, with the environment the
# server gets (the caller has exported the env file):
#   - Python is 3.11 or newer;
#   - SGLang and sglang-kdtree are installed, SGLang at the version sglang-kdtree pins;
#   - `--speculative-algorithm kdtree` resolves after SGLang's load_plugins();
#   - COMMAND, the unit's command line, passes SGLang's argument parser and KDTREE's startup checks
#     (sglang_kdtree.cli.doctor_launch: what the server refuses before it loads anything).
# Prints one "  ok   <what>" or "  FAIL <why>" line per check on stdout and returns 1 when any failed. It runs
# from / as the unit does, so a checkout in the current directory (its sglang_kdtree/ or the *.egg-info that
# `pip install .` leaves there) cannot stand in for an installed plugin. Takes about half a minute: it imports
# SGLang and runs its plugin loader.
kdtree_service_checks() {
    local python=$1 command=$2 report failed=0 py_version py_major py_minor sglang_version kdtree_version pin line
    [[ $python == /* ]] || python=$PWD/$python
    report=$(cd / && KDTREE_PREFLIGHT_COMMAND=$command timeout 600 "$python" - 2>&1 <<<"$_KDTREE_CHECKS_PY" ||
        echo "python-exit $?")
    py_version=$(_kdtree_field python)
    if [[ -z $py_version ]]; then
        _kdtree_fail "could not run the service's Python (KDTREE_PYTHON '$python'): ${report:-no output}"
        return 1
    fi
    IFS=. read -r py_major py_minor _ <<<"$py_version"
    if ((py_major > 3 || (py_major == 3 && py_minor >= 11))); then
        _kdtree_ok "Python $py_version"
    else
        _kdtree_fail "Python $py_version is too old; sglang-kdtree needs Python >= 3.11"
    fi
    sglang_version=$(_kdtree_field sglang)
    kdtree_version=$(_kdtree_field sglang-kdtree)
    pin=$(_kdtree_field sglang-pin)
    if [[ $sglang_version == missing ]]; then
        _kdtree_fail "SGLang is not installed in the environment of KDTREE_PYTHON '$python'"
    elif [[ $kdtree_version == missing ]]; then
        _kdtree_fail "sglang-kdtree is not installed in the environment of KDTREE_PYTHON '$python' (install it from a checkout or a wheel: step 1 of service/README.md)"
    elif [[ $pin != none && $sglang_version != "$pin" ]]; then
        _kdtree_fail "SGLang $sglang_version is installed but sglang-kdtree $kdtree_version needs sglang==$pin"
    else
        _kdtree_ok "SGLang $sglang_version, sglang-kdtree $kdtree_version"
    fi
    line=$(_kdtree_field kdtree)
    if [[ $line == resolves* ]]; then
        _kdtree_ok "--speculative-algorithm kdtree resolves after load_plugins()"
    else
        _kdtree_fail "--speculative-algorithm kdtree does not resolve after sglang.srt.plugins.load_plugins(): ${line#error } (run: $python -m sglang_kdtree doctor; check SGLANG_PLUGINS)"
    fi
    line=$(_kdtree_field flags)
    if [[ $line == ok ]]; then
        _kdtree_ok "the command line passes SGLang's argument parser and KDTREE's startup checks"
    elif [[ -n $line ]]; then
        _kdtree_fail "the command line would not start: ${line#error }"
    else
        _kdtree_fail "the command line was not checked (the Python check gave no result): $report"
    fi
    line=$(_kdtree_field python-exit)
    [[ -z $line ]] || _kdtree_fail "the Python check exited with status $line: $report"
    return "$failed"
}
