#!/usr/bin/env bash
# The first requests a fresh service answers: Envoy's filter gives up
# after 20 ms by default, so a slow first call is a request let through.
#
#   bench/first-requests.sh [STARTS]          # default 3
#
# For each start and case: Redis emptied and its scripts and functions
# flushed, a new service, then the first REQUESTS requests over CONNECTIONS
# new connections (one stream each, no warm-up), values drawn from
# 100,000. Prints p50, p99 and the slowest request of each start.
#
# Cases: memory, redis, and redis with --grpc-threads 2.
#
# Environment:
#   BIN          directory of the release binaries
#                (default ${CARGO_TARGET_DIR:-target}/release)
#   REQUESTS     requests per start (default 300)
#   CONNECTIONS  (default 10)
#
# Exits 1 when a request was not answered with a decision.
set -euo pipefail

STARTS=${1:-3}
HERE=$(cd "$(dirname "$0")" && pwd)
BIN=${BIN:-${CARGO_TARGET_DIR:-$HERE/../target}/release}
REQUESTS=${REQUESTS:-300}
CONNECTIONS=${CONNECTIONS:-10}
source "$HERE/common.sh"
require_tools redis-server redis-cli python3 "$BIN/throttlegate" "$BIN/throttlegate-load"

free_port REDIS_PORT
start_redis "$REDIS_PORT"
cat >"$WORK/config.yaml" <<'EOF'
domain: bench
descriptors:
  - key: method
    value: GET
    descriptors:
      - key: user
        rate_limit: {unit: minute, requests_per_unit: 1000000000}
EOF

failed=0
run() { # case $1, start $2
    local case=$1 start=$2 flags=() grpc http
    case $case in
    redis) flags=(--redis-url "redis://127.0.0.1:$REDIS_PORT") ;;
    redis-threads) flags=(--redis-url "redis://127.0.0.1:$REDIS_PORT" --grpc-threads 2) ;;
    esac
    redis-cli -p "$REDIS_PORT" flushall >/dev/null
    redis-cli -p "$REDIS_PORT" script flush >/dev/null
    redis-cli -p "$REDIS_PORT" function flush >/dev/null
    free_port grpc
    free_port http
    RUST_LOG=warn "$BIN/throttlegate" serve --config "$WORK/config.yaml" --watch-config off \
        --grpc-addr "127.0.0.1:$grpc" --http-addr "127.0.0.1:$http" ${flags[@]+"${flags[@]}"} \
        >>"$WORK/service.log" 2>&1 &
    local service=$!
    PIDS+=("$service")
    wait_port "$grpc" "$service"
    "$BIN/throttlegate-load" --addr "http://127.0.0.1:$grpc" --domain bench --key user \
        --prefix-entry method=GET --keys 100000 --connections "$CONNECTIONS" --streams 1 \
        --requests "$REQUESTS" >"$WORK/load.out"
    stop "$service"
    python3 - "$case" "$start" "$WORK/load.out" <<'EOF' || failed=1
import json, sys
case, start, path = sys.argv[1:]
line = next(l for l in open(path) if l.startswith('summary '))
s = json.loads(line[len('summary '):])
print(f'| {case} | {start} | {s["p50_us"]:,} | {s["p99_us"]:,} | {s["max_us"]:,} | {s["errors"]} |')
sys.exit(1 if s['errors'] else 0)
EOF
}

echo "first $REQUESTS requests of a fresh service over $CONNECTIONS new connections"
echo "| case | start | p50 µs | p99 µs | slowest µs | errors |"
echo "|---|---|---|---|---|---|"
for start in $(seq "$STARTS"); do
    for case in memory redis redis-threads; do run "$case" "$start"; done
done
exit "$failed"
