#!/usr/bin/env bash
# Decisions per second on one Redis server and on a 3-primary Redis Cluster.
#
#   bench/cluster.sh [ROUNDS]          # default 2
#
# Starts a standalone redis-server and three cluster primaries (joined by
# `redis-cli --cluster create`) on free ports, then, for each round, runs
# every case in turn: a fresh `throttlegate serve` on bench/cluster.yaml,
# one throttlegate-load run against it, the service stopped. Every Redis is
# flushed before each case, so each run starts from empty counters. Prints
# one line per run and stops every process it started on exit.
#
# Environment:
#   BIN        directory of the release binaries
#              (default ${CARGO_TARGET_DIR:-target}/release; build them with
#              `cargo build --release --bins`)
#   REQUESTS   requests per run (default 100000)
#   CONNECTIONS, STREAMS   load generator settings: connections, and
#              requests in flight on each (default 4, 16)
#   CASES      space-separated cases, each BACKEND:DESCRIPTORS[:HASH_TAG]
#              (default "standalone:1 cluster:1:none standalone:4
#              cluster:4:none cluster:4:domain")
#
# Columns: decisions/s and latency (p50, p99) as the load generator reports
# them; CPU per decision in µs, `utime + stime` from /proc/PID/stat over the
# run divided by the requests sent, for the service, for every redis-server
# of the case together, and for the load generator; the answers; and the
# script calls per request, in all and on each node (INFO commandstats).
set -euo pipefail

ROUNDS=${1:-2}
HERE=$(cd "$(dirname "$0")" && pwd)
BIN=${BIN:-${CARGO_TARGET_DIR:-$HERE/../target}/release}
REQUESTS=${REQUESTS:-100000}
CONNECTIONS=${CONNECTIONS:-4}
STREAMS=${STREAMS:-16}
CASES=${CASES:-"standalone:1 cluster:1:none standalone:4 cluster:4:none cluster:4:domain"}
CONFIG=$HERE/cluster.yaml
TICKS=$(getconf CLK_TCK)

for tool in redis-server redis-cli curl "$BIN/throttlegate" "$BIN/throttlegate-load"; do
    command -v "$tool" >/dev/null || {
        echo "missing $tool (redis: apt-get install redis-server; binaries: cargo build --release --bins)" >&2
        exit 1
    }
done

# shellcheck source=bench/common.sh
source "$HERE/common.sh"

per_decision_us() { # ticks, decisions
    awk -v t="$1" -v n="$2" -v hz="$TICKS" 'BEGIN { printf "%.1f", t / hz * 1e6 / n }'
}

free_port STANDALONE_PORT
start_redis "$STANDALONE_PORT"
STANDALONE_PIDS=("${PIDS[-1]}")

CLUSTER_PORTS=()
CLUSTER_PIDS=()
for _ in 1 2 3; do
    free_port port
    start_redis "$port" --cluster-enabled yes --cluster-config-file "$WORK/nodes-$port.conf" \
        --cluster-node-timeout 5000
    CLUSTER_PORTS+=("$port")
    CLUSTER_PIDS+=("${PIDS[-1]}")
done
redis-cli --cluster create $(printf '127.0.0.1:%s ' "${CLUSTER_PORTS[@]}") \
    --cluster-replicas 0 --cluster-yes >"$WORK/create.log"
for port in "${CLUSTER_PORTS[@]}"; do
    until redis-cli -p "$port" cluster info | grep -q cluster_state:ok; do sleep 0.1; done
done
SEEDS=$(printf '127.0.0.1:%s,' "${CLUSTER_PORTS[@]}")
SEEDS=${SEEDS%,}
echo "standalone redis on $STANDALONE_PORT; cluster primaries on ${CLUSTER_PORTS[*]}"
echo "load: $REQUESTS requests, $STREAMS in flight on each of $CONNECTIONS connections, 100000 values"

# One case: a fresh service, one load run, the service stopped; one line.
run_case() {
    local round=$1 backend descriptors tag
    IFS=: read -r backend descriptors tag <<<"$2"
    local redis_args redis_pids ports
    if [[ $backend == standalone ]]; then
        redis_args=(--redis-url "redis://127.0.0.1:$STANDALONE_PORT")
        redis_pids=("${STANDALONE_PIDS[@]}")
        ports=("$STANDALONE_PORT")
    else
        redis_args=(--redis-cluster-nodes "$SEEDS")
        redis_pids=("${CLUSTER_PIDS[@]}")
        ports=("${CLUSTER_PORTS[@]}")
    fi
    for port in "${ports[@]}"; do
        redis-cli -p "$port" flushall >/dev/null
        redis-cli -p "$port" config resetstat >/dev/null
    done
    local grpc http
    free_port grpc
    free_port http
    RUST_LOG=warn "$BIN/throttlegate" serve --config "$CONFIG" --watch-config off \
        --grpc-addr "127.0.0.1:$grpc" --http-addr "127.0.0.1:$http" \
        --redis-hash-tag "${tag:-none}" "${redis_args[@]}" 2>>"$WORK/service.log" &
    local service=$!
    PIDS+=("$service")
    until curl -fs "http://127.0.0.1:$http/healthcheck" >/dev/null; do
        kill -0 "$service" || { cat "$WORK/service.log" >&2; exit 1; }
        sleep 0.1
    done
    local service_before redis_before
    service_before=$(cpu_ticks "$service")
    redis_before=$(cpu_ticks "${redis_pids[@]}")
    /usr/bin/time -f '%U %S' -o "$WORK/load.time" "$BIN/throttlegate-load" \
        --addr "http://127.0.0.1:$grpc" --domain bench --key client \
        --descriptors "$descriptors" --keys 100000 --requests "$REQUESTS" \
        --connections "$CONNECTIONS" --streams "$STREAMS" >"$WORK/load.out"
    local service_ticks redis_ticks load_ticks
    service_ticks=$(($(cpu_ticks "$service") - service_before))
    redis_ticks=$(($(cpu_ticks "${redis_pids[@]}") - redis_before))
    load_ticks=$(awk -v hz="$TICKS" '{printf "%d", ($1 + $2) * hz + 0.5}' "$WORK/load.time")
    kill "$service"
    wait "$service" || true
    local sent rate p50 p99 answers
    read -r sent rate p50 p99 answers < <(sed -n 's/^summary //p' "$WORK/load.out" |
        python3 -c 'import json, sys; s = json.load(sys.stdin)
print(s["requests"], round(s["rate"]), s["p50_us"], s["p99_us"], s["ok"], s["over_limit"], s["errors"])')
    printf '%-5s %-18s %11s %8s %8s %8s %8s %8s  %-16s %s\n' "$round" "$2" "$rate" "$p50" "$p99" \
        "$(per_decision_us "$service_ticks" "$sent")" "$(per_decision_us "$redis_ticks" "$sent")" \
        "$(per_decision_us "$load_ticks" "$sent")" "$answers" "$(script_calls "$sent" "${ports[@]}")"
}

# Script calls (FCALL, EVALSHA, EVAL) per request, in all and on each node.
script_calls() {
    local sent=$1 port calls all=0 each=()
    shift
    for port in "$@"; do
        calls=$(redis-cli -p "$port" info commandstats |
            awk -F'[=,:]' '/^cmdstat_(evalsha|eval|fcall):/ {n += $3} END {print n + 0}')
        all=$((all + calls))
        each+=("$(awk -v c="$calls" -v n="$sent" 'BEGIN {printf "%.2f", c / n}')")
    done
    local IFS=/
    echo "$(awk -v c="$all" -v n="$sent" 'BEGIN {printf "%.2f", c / n}') (${each[*]})"
}

printf '%-5s %-18s %11s %8s %8s %8s %8s %8s  %-16s %s\n' round case decisions/s p50_µs p99_µs \
    service_µs redis_µs load_µs "ok over errors" "scripts/request (per node)"
for round in $(seq "$ROUNDS"); do
    for case in $CASES; do run_case "$round" "$case"; done
done
