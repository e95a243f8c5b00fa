#!/usr/bin/env bash
# Side-by-side runs of rate-limit services under one load generator, with
# CPU per decision, appended to a results file (JSON lines).
#
#   bench/compare.sh [ROUNDS]          # default 3
#
# Starts one redis-server (--save "" --appendonly no) on a free port, then
# for each round, case and load, runs every system in turn (A, B, A, B...:
# the machine's noise moves between rounds, so alternating keeps the
# comparison fair). Each run starts a fresh service on free ports (Redis
# flushed first), runs `throttlegate-load` against it with the service's
# and redis-server's PIDs (`--pid`), appends the generator's summary line
# (with labels system, backend, algorithm, load, case, round) to $RESULTS
# and stops the service. Everything started is stopped on exit.
#
# Environment:
#   BIN        directory of the release binaries
#              (default ${CARGO_TARGET_DIR:-target}/release;
#              `cargo build --release --bins`)
#   LIMITADOR  path to limitador-server: adds the systems
#              limitador-memory and limitador-redis
#   SYSTEMS    which systems to run, in order (default "memory redis", plus
#              "limitador-memory limitador-redis" with LIMITADOR; "redis" is
#              the Redis backend with --redis-batch off, one call per
#              request; "redis-batch" with --redis-batch on, the default)
#   LOADS      CONNECTIONSxSTREAMS per connection, space-separated
#              (default "50x10 10x1": throughput, like h2load -c50 -m10,
#              and latency, like -c10 -m1)
#   REQUESTS   requests per run (default 100000); DURATION (e.g. 10s)
#              instead, if set
#   WARMUP     not counted, before each run (default 1s)
#   ALGORITHM  the rule's algorithm in throttlegate (default fixed_window,
#              the only one limitador has)
#   KEYS, DISTRIBUTION, ZIPF_EXPONENT   the value of the varying entry
#              (default 100000 uniform; see throttlegate-load --help)
#   CASES      cost-growth cases, space-separated NAME:VALUE, each changing
#              one thing from the base (default "base"):
#                descriptors:N   N descriptors per request, a rule each
#                keys:N          N distinct values (1 = one hot key)
#                rules:N         N rules in the domain; the request matches
#                                one of them
#                connections:N   N connections (streams from the load)
#              e.g. CASES="descriptors:1 descriptors:4 descriptors:16
#                          keys:1 keys:10000 keys:1000000
#                          rules:1 rules:100 rules:10000
#                          connections:1 connections:8 connections:64"
#   RESULTS    the results file (default bench/results.jsonl), appended to
#
# The load: one descriptor (or N) of two entries, `method=GET` then
# `user=<value>`, domain `bench`, a limit of 10^9 per minute that no run
# reaches, so every answer is a decision that consumes. bench/table.py
# turns the results into markdown table rows, bench/plot.py into a plot.
set -euo pipefail

ROUNDS=${1:-3}
HERE=$(cd "$(dirname "$0")" && pwd)
BIN=${BIN:-${CARGO_TARGET_DIR:-$HERE/../target}/release}
DEFAULT_SYSTEMS="memory redis${LIMITADOR:+ limitador-memory limitador-redis}"
SYSTEMS=${SYSTEMS:-$DEFAULT_SYSTEMS}
LOADS=${LOADS:-"50x10 10x1"}
REQUESTS=${REQUESTS:-100000}
DURATION=${DURATION:-}
WARMUP=${WARMUP:-1s}
ALGORITHM=${ALGORITHM:-fixed_window}
KEYS=${KEYS:-100000}
DISTRIBUTION=${DISTRIBUTION:-uniform}
ZIPF_EXPONENT=${ZIPF_EXPONENT:-1.0}
CASES=${CASES:-base}
RESULTS=${RESULTS:-$HERE/results.jsonl}
LIMIT=1000000000

for tool in redis-server redis-cli "$BIN/throttlegate" "$BIN/throttlegate-load"; do
    command -v "$tool" >/dev/null || {
        echo "missing $tool (redis: apt-get install redis-server; binaries: cargo build --release --bins)" >&2
        exit 1
    }
done
if [[ $SYSTEMS == *limitador* ]]; then
    [[ -n ${LIMITADOR:-} && -x $LIMITADOR ]] || {
        echo "LIMITADOR must name an executable limitador-server for $SYSTEMS" >&2
        exit 1
    }
fi

# shellcheck source=bench/common.sh
source "$HERE/common.sh"

free_port REDIS_PORT
start_redis "$REDIS_PORT"
REDIS_PID=$REDIS_STARTED

# throttlegate's rules: under `method=GET`, one rule per descriptor key
# (`user`, `user_1`, ...), plus rules the request never matches until the
# domain holds $2 rules in all. Written to $WORK/config.yaml.
write_config() {
    local descriptors=$1 rules=$2 idx
    {
        echo "domain: bench"
        echo "default_algorithm: $ALGORITHM"
        echo "descriptors:"
        echo "  - key: method"
        echo "    value: GET"
        echo "    descriptors:"
        for ((idx = 0; idx < descriptors; idx++)); do
            echo "      - key: $(descriptor_key "$idx")"
            echo "        rate_limit: {unit: minute, requests_per_unit: $LIMIT}"
        done
        for ((idx = descriptors; idx < rules; idx++)); do
            echo "  - key: method"
            echo "    value: M$idx"
            echo "    descriptors:"
            echo "      - key: user"
            echo "        rate_limit: {unit: minute, requests_per_unit: $LIMIT}"
        done
    } >"$WORK/config.yaml"
}

# The same limits for limitador: one per descriptor, plus never-matching
# ones until $2. Written to $WORK/limits.yaml.
write_limits() {
    local descriptors=$1 rules=$2 idx
    {
        for ((idx = 0; idx < descriptors; idx++)); do
            echo "- namespace: bench"
            echo "  max_value: $LIMIT"
            echo "  seconds: 60"
            echo "  conditions: []"
            echo "  variables: [\"descriptors[$idx].$(descriptor_key "$idx")\"]"
        done
        for ((idx = descriptors; idx < rules; idx++)); do
            echo "- namespace: bench"
            echo "  max_value: $LIMIT"
            echo "  seconds: 60"
            echo "  conditions: [\"descriptors[0].method == 'M$idx'\"]"
            echo "  variables: [\"descriptors[0].user\"]"
        done
    } >"$WORK/limits.yaml"
}

# Starts system $1 on gRPC port $2 (HTTP on $3); sets SERVICE_PID.
start_system() {
    local system=$1 grpc=$2 http=$3
    case $system in
    memory | redis | redis-batch)
        local redis_args=()
        [[ $system == redis* ]] && redis_args=(--redis-url "redis://127.0.0.1:$REDIS_PORT")
        if [[ $system == redis-batch ]]; then
            redis_args+=(--redis-batch on)
        elif [[ $system == redis ]]; then
            redis_args+=(--redis-batch off)
        fi
        RUST_LOG=warn "$BIN/throttlegate" serve --config "$WORK/config.yaml" --watch-config off \
            --grpc-addr "127.0.0.1:$grpc" --http-addr "127.0.0.1:$http" "${redis_args[@]}" \
            2>>"$WORK/service.log" &
        ;;
    limitador-memory | limitador-redis)
        local storage=(memory)
        [[ $system == limitador-redis ]] && storage=(redis "redis://127.0.0.1:$REDIS_PORT")
        RUST_LOG=warn "$LIMITADOR" --rls-ip 127.0.0.1 --rls-port "$grpc" --http-ip 127.0.0.1 \
            --http-port "$http" "$WORK/limits.yaml" "${storage[@]}" >>"$WORK/service.log" 2>&1 &
        ;;
    *)
        echo "unknown system $system (memory, redis, redis-batch, limitador-memory, limitador-redis)" >&2
        exit 1
        ;;
    esac
    SERVICE_PID=$!
    PIDS+=("$SERVICE_PID")
    wait_port "$grpc" "$SERVICE_PID"
}

# One run: system $1, load $2 (CxM), case $3, round $4.
run_one() {
    local system=$1 load=$2 case=$3 round=$4
    local connections=${load%x*} streams=${load#*x} descriptors=1 keys=$KEYS
    case ${case%%:*} in
    descriptors) descriptors=${case#*:} ;;
    keys) keys=${case#*:} ;;
    connections) connections=${case#*:} ;;
    esac
    redis-cli -p "$REDIS_PORT" flushall >/dev/null
    redis-cli -p "$REDIS_PORT" config resetstat >/dev/null
    local grpc http
    free_port grpc
    free_port http
    start_system "$system" "$grpc" "$http"
    local backend=${system#limitador-} pids=(--pid "service=$SERVICE_PID")
    [[ $backend == redis* ]] && pids+=(--pid "redis=$REDIS_PID")
    local amount=(--requests "$REQUESTS")
    [[ -n $DURATION ]] && amount=(--duration "$DURATION")
    local product=throttlegate algorithm=$ALGORITHM
    [[ $system == limitador* ]] && product=limitador algorithm=fixed_window
    local labels=(--label "system=$product" --label "backend=$backend"
        --label "algorithm=$algorithm"
        --label "load=$load" --label "case=$case" --label "round=$round")
    "$BIN/throttlegate-load" --addr "http://127.0.0.1:$grpc" --domain bench \
        --prefix-entry method=GET --key user --descriptors "$descriptors" --keys "$keys" \
        --distribution "$DISTRIBUTION" --zipf-exponent "$ZIPF_EXPONENT" \
        --connections "$connections" --streams "$streams" --warmup "$WARMUP" \
        "${amount[@]}" "${pids[@]}" "${labels[@]}" >"$WORK/load.out"
    kill "$SERVICE_PID"
    wait "$SERVICE_PID" || true
    grep '^summary ' "$WORK/load.out" | sed 's/^summary //' >>"$RESULTS"
    python3 - "$WORK/load.out" "$round" "$case" "$load" "$system" <<'EOF'
import json, sys
line = next(l for l in open(sys.argv[1]) if l.startswith("summary "))
s = json.loads(line[len("summary "):])
cpu = {c["label"]: c["us_per_decision"] for c in s["cpu"]}
fmt = lambda v: "-" if v is None else f"{v:.1f}"
print(f"{sys.argv[2]:>5} {sys.argv[3]:<18} {sys.argv[4]:>6} {sys.argv[5]:<17} {s['rate']:>9.0f}"
      f" {s['p50_us']:>7} {s['p99_us']:>7} {fmt(cpu.get('service')):>8} {fmt(cpu.get('redis')):>8}"
      f" {fmt(s['generator_us_per_decision']):>8}  {s['ok']}/{s['over_limit']}/{s['errors']}")
EOF
}

echo "redis-server on $REDIS_PORT (pid $REDIS_PID); results appended to $RESULTS"
printf '%5s %-18s %6s %-17s %9s %7s %7s %8s %8s %8s  %s\n' round case load system \
    decisions/s p50_µs p99_µs svc_µs redis_µs load_µs ok/over/errors
for round in $(seq "$ROUNDS"); do
    for case in $CASES; do
        descriptors=1 rules=1
        [[ $case == descriptors:* ]] && descriptors=${case#*:}
        [[ $case == rules:* ]] && rules=${case#*:}
        write_config "$descriptors" "$rules"
        write_limits "$descriptors" "$rules"
        for load in $LOADS; do
            for system in $SYSTEMS; do run_one "$system" "$load" "$case" "$round"; done
        done
    done
done
