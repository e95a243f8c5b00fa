#!/usr/bin/env bash
# Overload against one Redis: far more requests in flight than Redis can
# decide within --redis-timeout-ms, with --redis-batch off and on
# alternated. For each run it prints the decisions the clients got (the
# goodput) and the requests Redis ran whose callers got no decision (they
# consumed quota while their caller was answered through --failure-mode).
#
#   bench/overload.sh [ROUNDS]          # default 2
#
# How the second figure is counted: the rule set is one fixed-window rule
# per descriptor (a limit no run reaches, a window of an hour), so every
# request Redis runs adds 1 to each of its DESCRIPTORS counters. After the
# run (and a pause longer than the Redis timeout, so that every call
# written has finished), the sum of every counter in Redis divided by
# DESCRIPTORS is the number of requests Redis ran; less the decisions the
# load generator was answered with, it is the number that ran for nobody.
# Each run has a request budget (no warm-up), so every request sent is
# answered before the generator ends and none is cut off by its end. Redis
# is flushed before each run.
#
# Environment:
#   BIN          directory of the release binaries (default
#                ${CARGO_TARGET_DIR:-target}/release; `cargo build --release --bins`)
#   IN_FLIGHT    requests in flight, space-separated (default "1000 2000 4000"):
#                IN_FLIGHT/10 connections of 10 streams
#   DESCRIPTORS  descriptors per request (default 16)
#   KEYS         distinct values per descriptor, uniform (default 1000)
#   REQUESTS     requests per run (default 30000)
#   TIMEOUT_MS   --redis-timeout-ms (default 250)
#   POOL         --redis-pool-size (default 8)
#   RESULTS      the generator's summary lines, appended to (default
#                bench/overload.jsonl)
set -euo pipefail

ROUNDS=${1:-2}
HERE=$(cd "$(dirname "$0")" && pwd)
BIN=${BIN:-${CARGO_TARGET_DIR:-$HERE/../target}/release}
IN_FLIGHT=${IN_FLIGHT:-"1000 2000 4000"}
DESCRIPTORS=${DESCRIPTORS:-16}
KEYS=${KEYS:-1000}
REQUESTS=${REQUESTS:-30000}
TIMEOUT_MS=${TIMEOUT_MS:-250}
POOL=${POOL:-8}
RESULTS=${RESULTS:-$HERE/overload.jsonl}

# shellcheck source=bench/common.sh
source "$HERE/common.sh"
require_tools redis-server redis-cli curl python3 "$BIN/throttlegate" "$BIN/throttlegate-load"

free_port REDIS_PORT
start_redis "$REDIS_PORT"
REDIS_PID=$REDIS_STARTED

{
    echo "domain: bench"
    echo "descriptors:"
    echo "  - key: method"
    echo "    value: GET"
    echo "    descriptors:"
    for ((idx = 0; idx < DESCRIPTORS; idx++)); do
        echo "      - key: $(descriptor_key "$idx")"
        echo "        rate_limit: {unit: hour, requests_per_unit: 1000000000, algorithm: fixed_window}"
    done
} >"$WORK/config.yaml"

# The units counted in every fixed-window counter (state `start:count`).
SUM_LUA="local sum = 0
for _, key in ipairs(redis.call('KEYS', '*')) do
  local value = redis.call('GET', key)
  local count = value and string.match(value, ':(%d+)$')
  if count then sum = sum + tonumber(count) end
end
return sum"

# One run: $1 in flight, batching $2 (off or on), round $3.
run_one() {
    local in_flight=$1 batch=$2 round=$3 grpc http
    redis-cli -p "$REDIS_PORT" flushall >/dev/null
    redis-cli -p "$REDIS_PORT" config resetstat >/dev/null
    free_port grpc
    free_port http
    RUST_LOG=error "$BIN/throttlegate" serve --config "$WORK/config.yaml" --watch-config off \
        --grpc-addr "127.0.0.1:$grpc" --http-addr "127.0.0.1:$http" \
        --redis-url "redis://127.0.0.1:$REDIS_PORT" --redis-batch "$batch" \
        --redis-timeout-ms "$TIMEOUT_MS" --redis-pool-size "$POOL" 2>>"$WORK/service.log" &
    local service=$!
    PIDS+=("$service")
    wait_port "$grpc" "$service"
    "$BIN/throttlegate-load" --addr "http://127.0.0.1:$grpc" --domain bench \
        --prefix-entry method=GET --key user --descriptors "$DESCRIPTORS" --keys "$KEYS" \
        --connections $((in_flight / 10)) --streams 10 --requests "$REQUESTS" \
        --pid "service=$service" --pid "redis=$REDIS_PID" \
        --label "in_flight=$in_flight" --label "batch=$batch" --label "round=$round" \
        >"$WORK/load.out"
    # Every call written is answered or given up within the Redis timeout.
    sleep $((TIMEOUT_MS / 1000 + 2))
    local units
    units=$(redis-cli -p "$REDIS_PORT" eval "$SUM_LUA" 0)
    curl -s "http://127.0.0.1:$http/metrics" >"$WORK/metrics"
    kill "$service"
    wait "$service" || true
    grep '^summary ' "$WORK/load.out" | sed 's/^summary //' >>"$RESULTS"
    python3 - "$WORK/load.out" "$WORK/metrics" "$units" "$DESCRIPTORS" "$in_flight" "$batch" \
        "$round" <<'EOF'
import json, sys
out, metrics_file, units, descriptors, in_flight, batch, rnd = sys.argv[1:]
line = next(l for l in open(out) if l.startswith("summary "))
s = json.loads(line[len("summary "):])
metrics = open(metrics_file).read()
def series(prefix):
    return sum(float(l.rsplit(" ", 1)[1]) for l in metrics.splitlines() if l.startswith(prefix))
shed = series('throttlegate_backend_errors_total{backend="redis",kind="shed"}')
timeouts = series('throttlegate_backend_errors_total{backend="redis",kind="timeout"}')
ran = int(units) / int(descriptors)
decided = s["ok"] + s["over_limit"]
sent = decided + s["errors"]
late = ran - decided
print(f"{rnd:>5} {in_flight:>9} {batch:>5} {sent:>8} {decided:>8} {100 * decided / sent:>7.1f}%"
      f" {s['rate']:>10.0f} {ran:>9.0f} {late:>8.0f} {100 * late / max(ran, 1):>7.2f}%"
      f" {shed:>7.0f} {timeouts:>8.0f}"
      f"  {json.dumps(s['errors_by_code'])}")
EOF
}

echo "redis-server on $REDIS_PORT (pid $REDIS_PID); summaries appended to $RESULTS"
printf '%5s %9s %5s %8s %8s %8s %10s %9s %8s %8s %7s %8s  %s\n' round in_flight batch sent \
    decided share decisions/s redis_ran late late% shed timeout errors
for round in $(seq "$ROUNDS"); do
    for in_flight in $IN_FLIGHT; do
        for batch in off on; do run_one "$in_flight" "$batch" "$round"; done
    done
done
