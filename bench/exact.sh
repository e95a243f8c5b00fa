#!/usr/bin/env bash
# Exactly N at the limit across two instances: two services on one Redis,
# each driven by its own throttlegate-load at the same time, every request
# on one hot key limited to LIMIT per day. Prints, per system, what each
# instance allowed and the total, which must be LIMIT.
#
#   bench/exact.sh [ROUNDS]          # default 1
#
# Systems: throttlegate with the sliding log and the fixed window, and,
# with LIMITADOR, limitador on its Redis storage (the same limit,
# `max_value: LIMIT`, `seconds: 86400`). Redis is flushed before each run.
#
# Environment:
#   BIN        directory of the release binaries
#              (default ${CARGO_TARGET_DIR:-target}/release;
#              `cargo build --release --bins`)
#   LIMITADOR  path to limitador-server (optional)
#   LIMIT      the limit (default 50000)
#   REQUESTS   requests per instance (default 100000)
#   LOAD       CONNECTIONSxSTREAMS per instance (default 50x10)
#
# Exits 1 when a throttlegate run allowed other than LIMIT in all or
# answered an error.
set -euo pipefail

ROUNDS=${1:-1}
HERE=$(cd "$(dirname "$0")" && pwd)
BIN=${BIN:-${CARGO_TARGET_DIR:-$HERE/../target}/release}
LIMIT=${LIMIT:-50000}
REQUESTS=${REQUESTS:-100000}
LOAD=${LOAD:-50x10}
source "$HERE/common.sh"
require_tools redis-server redis-cli python3 "$BIN/throttlegate" "$BIN/throttlegate-load"
[[ -z ${LIMITADOR:-} || -x $LIMITADOR ]] || {
    echo "LIMITADOR must name an executable limitador-server" >&2
    exit 1
}

free_port REDIS_PORT
start_redis "$REDIS_PORT"

config() { # the throttlegate config for algorithm $1
    cat >"$WORK/config.yaml" <<EOF
domain: bench
descriptors:
  - key: user
    rate_limit: {unit: day, requests_per_unit: $LIMIT, algorithm: $1}
EOF
}
cat >"$WORK/limits.yaml" <<EOF
- namespace: bench
  max_value: $LIMIT
  seconds: 86400
  conditions: []
  variables: ["descriptors[0].user"]
EOF

# Starts system $1 on gRPC port $2, HTTP port $3; prints its pid.
start_one() {
    local system=$1 grpc=$2 http=$3
    if [[ $system == limitador ]]; then
        RUST_LOG=warn "$LIMITADOR" --rls-ip 127.0.0.1 --rls-port "$grpc" --http-ip 127.0.0.1 \
            --http-port "$http" "$WORK/limits.yaml" redis "redis://127.0.0.1:$REDIS_PORT" \
            >>"$WORK/service.log" 2>&1 &
    else
        RUST_LOG=warn "$BIN/throttlegate" serve --config "$WORK/config.yaml" --watch-config off \
            --grpc-addr "127.0.0.1:$grpc" --http-addr "127.0.0.1:$http" \
            --redis-url "redis://127.0.0.1:$REDIS_PORT" --max-log-entries "$LIMIT" \
            >>"$WORK/service.log" 2>&1 &
    fi
    echo $!
}

failed=0
run() { # system $1 (throttlegate algorithm or limitador), round $2
    local system=$1 round=$2 g1 h1 g2 h2 p1 p2
    [[ $system != limitador ]] && config "$system"
    redis-cli -p "$REDIS_PORT" flushall >/dev/null
    free_port g1
    free_port h1
    free_port g2
    free_port h2
    p1=$(start_one "$system" "$g1" "$h1")
    PIDS+=("$p1")
    p2=$(start_one "$system" "$g2" "$h2")
    PIDS+=("$p2")
    wait_port "$g1" "$p1"
    wait_port "$g2" "$p2"
    local load=(--domain bench --key user --keys 1 --connections "${LOAD%x*}"
        --streams "${LOAD#*x}" --requests "$REQUESTS")
    "$BIN/throttlegate-load" --addr "http://127.0.0.1:$g1" "${load[@]}" >"$WORK/one.out" &
    local l1=$!
    "$BIN/throttlegate-load" --addr "http://127.0.0.1:$g2" "${load[@]}" >"$WORK/two.out"
    wait "$l1"
    stop "$p1"
    stop "$p2"
    python3 - "$system" "$round" "$LIMIT" "$WORK/one.out" "$WORK/two.out" <<'EOF' || failed=1
import json, sys
system, round_, limit, one, two = sys.argv[1:]
def summary(path):
    for line in open(path):
        if line.startswith('summary '):
            return json.loads(line[len('summary '):])
    sys.exit(f'{path}: no summary line')
a, b = summary(one), summary(two)
total = a['ok'] + b['ok']
errors = a['errors'] + b['errors']
exact = total == int(limit) and errors == 0
print(f'| {system} | {round_} | {a["ok"]:,} | {b["ok"]:,} | {total:,} | {errors} |'
      + ('' if exact else ' (not exact)'))
sys.exit(0 if exact or system == 'limitador' else 1)
EOF
}

echo "two instances on one Redis, $LOAD each, $REQUESTS requests each, one key, limit $LIMIT a day"
echo "| system | round | allowed by instance 1 | by instance 2 | allowed in all | errors |"
echo "|---|---|---|---|---|---|"
systems="sliding_window_log fixed_window${LIMITADOR:+ limitador}"
for round in $(seq "$ROUNDS"); do
    for system in $systems; do run "$system" "$round"; done
done
exit "$failed"
