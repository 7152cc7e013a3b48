#!/usr/bin/env bash
# Check that an SGLang server is up and generates: wait (bounded) for GET /health to answer 200, then send
# one short greedy POST /generate and require at least one completion token.
#
# Usage: healthcheck.sh [--env-file FILE | --url URL] [--timeout SECONDS] [--unit NAME]
#                       [--prompt TEXT] [--max-new-tokens N] [--generate-timeout SECONDS]
#   --env-file FILE   take host, port, API key and timeout from the service env file
#                     (default: $KDTREE_ENV_FILE, else /etc/default/sglang-k26-ddtree)
#   --url URL         check this server instead, e.g. http://127.0.0.1:30000 (no env file is read)
#   --timeout S       how long to wait for /health (default: KDTREE_HEALTH_TIMEOUT_S, else 2400)
#   --unit NAME       give up early when this systemd unit fails or restarts while we wait
#   --prompt TEXT     prompt of the generate request (default: "The capital of France is")
#   --max-new-tokens N        tokens to generate (default: 8)
#   --generate-timeout S      limit for the generate request (default: 300)
# Exit status: 0 healthy; 1 unhealthy, with the reason on stderr; 2 bad usage.
# SYSTEMCTL replaces the systemctl command (tests); CURL replaces curl.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source-path=SCRIPTDIR source=kdtree-env.sh
. "$here/kdtree-env.sh"

usage() { sed -n '2,16s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"; }
bad_usage() { printf '%s: %s (see --help)\n' "${0##*/}" "$*" >&2; exit 2; }

env_file=${KDTREE_ENV_FILE:-$KDTREE_ENV_PATH}
url="" timeout_s="" unit="" prompt="The capital of France is" max_new_tokens=8 generate_timeout_s=300
while (($#)); do
    (($# >= 2)) || [[ $1 == -h || $1 == --help ]] || bad_usage "option '$1' needs a value"
    case $1 in
        --env-file) env_file=$2 ;;
        --url) url=${2%/} ;;
        --timeout) timeout_s=$2 ;;
        --unit) unit=$2 ;;
        --prompt) prompt=$2 ;;
        --max-new-tokens) max_new_tokens=$2 ;;
        --generate-timeout) generate_timeout_s=$2 ;;
        -h | --help) usage; exit 0 ;;
        *) bad_usage "unknown option '$1'" ;;
    esac
    shift 2
done

if [[ -z $url ]]; then
    kdtree_load_env_file "$env_file"
    kdtree_report_problems
    url=$(kdtree_health_base_url)
    timeout_s=${timeout_s:-${KDTREE_HEALTH_TIMEOUT_S:-}}
fi
timeout_s=${timeout_s:-2400}
kdtree_is_uint "$timeout_s" 86400 || bad_usage "timeout '$timeout_s' must be a positive integer of seconds"
kdtree_is_uint "$max_new_tokens" 4096 || bad_usage "max-new-tokens '$max_new_tokens' must be a positive integer"
kdtree_is_uint "$generate_timeout_s" 86400 || bad_usage "generate-timeout '$generate_timeout_s' must be a positive integer"
[[ $prompt =~ [[:cntrl:]] ]] && bad_usage "the prompt must be a single line without control characters"

read -ra curl_cmd <<<"${CURL:-curl}"
read -ra systemctl_cmd <<<"${SYSTEMCTL:-systemctl}"
command -v "${curl_cmd[0]}" >/dev/null 2>&1 || { printf 'unhealthy: %s not found (install curl)\n' "${curl_cmd[0]}" >&2; exit 1; }
auth=()
[[ -n ${KDTREE_API_KEY:-} ]] && auth=(-H "Authorization: Bearer $KDTREE_API_KEY")

fail() {
    printf 'unhealthy: %s\n' "$*" >&2
    exit 1
}

unit_restarts() {
    timeout 30 "${systemctl_cmd[@]}" show -p NRestarts --value "$unit" 2>/dev/null || true
}

# Phase 1: bounded wait for /health. The loop ends at the deadline and also after a fixed number of
# attempts, whichever comes first, so a clock jump cannot make it spin forever.
deadline=$((SECONDS + timeout_s))
max_attempts=$((timeout_s + 1))
attempt=0 last="" restarts0=""
[[ -n $unit ]] && restarts0=$(unit_restarts)
while :; do
    attempt=$((attempt + 1))
    code=$("${curl_cmd[@]}" -s -o /dev/null -w '%{http_code}' --connect-timeout 3 --max-time 10 "${auth[@]}" \
        "$url/health" 2>/dev/null) || true
    [[ $code == 200 ]] && break
    if [[ $code == 000 || -z $code ]]; then last="no connection to $url"; else last="GET /health answered HTTP $code"; fi
    if [[ -n $unit ]]; then
        state=$(timeout 30 "${systemctl_cmd[@]}" is-active "$unit" 2>/dev/null) || true
        case $state in
            failed | inactive) fail "unit $unit is $state while waiting for $url/health (journalctl -u $unit)" ;;
        esac
        restarts=$(unit_restarts)
        if [[ -n $restarts0 && -n $restarts && $restarts != "$restarts0" ]]; then
            fail "unit $unit restarted (NRestarts $restarts0 -> $restarts) while waiting for $url/health: the server crashed (journalctl -u $unit)"
        fi
    fi
    if ((SECONDS >= deadline || attempt >= max_attempts)); then
        fail "$url/health not ready after ${timeout_s}s ($attempt attempts); last: $last"
    fi
    sleep 1
done

# Phase 2: one short greedy request through the whole stack (tokenizer, scheduler, draft, tree verify).
escaped=${prompt//\\/\\\\}
escaped=${escaped//\"/\\\"}
payload=$(printf '{"text": "%s", "sampling_params": {"temperature": 0, "max_new_tokens": %d}}' "$escaped" "$max_new_tokens")
body_file=$(mktemp)
trap 'rm -f "$body_file"' EXIT
started=$SECONDS
code=$("${curl_cmd[@]}" -s -o "$body_file" -w '%{http_code}' --connect-timeout 3 --max-time "$generate_timeout_s" \
    "${auth[@]}" -H 'Content-Type: application/json' --data-binary "$payload" "$url/generate" 2>/dev/null) || true
body=$(head -c 2000 "$body_file")
if [[ $code == 000 || -z $code ]]; then
    fail "POST $url/generate got no answer within ${generate_timeout_s}s"
fi
[[ $code == 200 ]] || fail "POST $url/generate answered HTTP $code: $body"
if [[ ! $body =~ \"completion_tokens\"[[:space:]]*:[[:space:]]*([0-9]+) ]] || ((BASH_REMATCH[1] < 1)); then
    fail "POST $url/generate answered without completion tokens: $body"
fi
printf 'healthy: %s (/health ready after %d attempt(s); generated %s token(s) in %ds)\n' \
    "$url" "$attempt" "${BASH_REMATCH[1]}" "$((SECONDS - started))"
