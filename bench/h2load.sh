#!/usr/bin/env bash
# Builds (or flag sets) of throttlegate side by side under h2load, a
# neutral HTTP/2 load generator written in C: service and Redis CPU per
# decision from /proc, and latency percentiles from h2load's per-request
# log at one stream per connection.
#
#   bench/h2load.sh [ROUNDS]          # default 2
#
# Every request is the same: domain `bench`, one descriptor of two entries
# (method=GET, user=user-12345), a fixed-window limit of 10^9 per minute
# that no run reaches (so one hot key; with Redis each decision is a call
# on it). For each round, backend and load, every build runs in turn on a
# fresh service (Redis flushed first): 20,000 requests of warm-up, then
# REQUESTS measured. One line per run on stdout and one JSON line appended
# to $RESULTS.
#
# Environment:
#   BUILDS    space-separated LABEL=BINARY[,FLAG...] (default
#             "main=target/release/throttlegate"); flags after commas are
#             added to `serve`, e.g. "shared=BIN,--grpc-threads,0
#             threads=BIN,--grpc-threads,2" compares two flag sets; a
#             BINARY named limitador-server runs Kuadrant's limitador with
#             the same limit (memory or redis storage)
#   BACKENDS  "memory redis" (default both)
#   LOADS     CONNECTIONSxSTREAMS (default "50x10 10x1"); at one stream
#             per connection h2load logs each request and the percentiles
#             are computed from that log
#   REQUESTS  measured requests per run (default 200000)
#   RESULTS   JSON lines file (default bench/h2load.jsonl), appended to
#   TASKSET   e.g. "0" to pin the service to CPU 0 (h2load and Redis then
#             go to the other CPUs); unpinned when empty (default)
#
# Needs h2load (apt-get install nghttp2-client), redis-server, python3.
set -euo pipefail

ROUNDS=${1:-2}
HERE=$(cd "$(dirname "$0")" && pwd)
BUILDS=${BUILDS:-"main=$HERE/../target/release/throttlegate"}
BACKENDS=${BACKENDS:-"memory redis"}
LOADS=${LOADS:-"50x10 10x1"}
REQUESTS=${REQUESTS:-200000}
RESULTS=${RESULTS:-$HERE/h2load.jsonl}
TASKSET=${TASKSET:-}

for tool in h2load redis-server redis-cli python3; do
    command -v "$tool" >/dev/null || {
        echo "missing $tool (h2load: apt-get install nghttp2-client; redis: apt-get install redis-server)" >&2
        exit 1
    }
done

# shellcheck source=bench/common.sh
source "$HERE/common.sh"

free_port REDIS_PORT
start_redis "$REDIS_PORT"
REDIS_PID=$REDIS_STARTED

# The config in a directory of its own: the service watches its config's
# directory, and h2load's request log is written in $WORK.
mkdir -p "$WORK/config"
cat >"$WORK/config/config.yaml" <<'EOF'
domain: bench
descriptors:
  - key: method
    value: GET
    descriptors:
      - key: user
        rate_limit: {unit: minute, requests_per_unit: 1000000000, algorithm: fixed_window}
EOF
# The same limit for limitador-server (its namespace is the domain).
cat >"$WORK/config/limits.yaml" <<'EOF'
- namespace: bench
  max_value: 1000000000
  seconds: 60
  conditions: []
  variables: ["descriptors[0].user"]
EOF

# The request as a gRPC message: a 5-byte frame header, then the
# RateLimitRequest in protobuf (domain = 1, descriptors = 2; a descriptor's
# entries = 1; an entry's key = 1, value = 2).
python3 - "$WORK/body.bin" <<'EOF'
import sys
def varint(n):
    out = b''
    while True:
        low, n = n & 0x7f, n >> 7
        if n:
            out += bytes([low | 0x80])
        else:
            return out + bytes([low])
def field(number, data):
    return varint(number << 3 | 2) + varint(len(data)) + data
def entry(key, value):
    return field(1, field(1, key.encode()) + field(2, value.encode()))
message = field(1, b'bench') + field(2, entry('method', 'GET') + entry('user', 'user-12345'))
open(sys.argv[1], 'wb').write(b'\x00' + len(message).to_bytes(4, 'big') + message)
EOF

# utime + stime of process $1, in clock ticks.
ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
HZ=$(getconf CLK_TCK)

run() {
    local label=$1 spec=$2 backend=$3 load=$4 round=$5
    local binary=${spec%%,*} flags=() connections=${load%x*} streams=${load#*x}
    [[ $spec == *,* ]] && IFS=, read -r -a flags <<<"${spec#*,}"
    redis-cli -p "$REDIS_PORT" flushall >/dev/null
    free_port PORT
    local pin=()
    [[ -n $TASKSET ]] && pin=(taskset -c "$TASKSET")
    if [[ $(basename "$binary") == limitador-server ]]; then
        local storage=(memory)
        [[ $backend == redis ]] && storage=(redis "redis://127.0.0.1:$REDIS_PORT")
        RUST_LOG=warn "${pin[@]}" "$binary" --rls-ip 127.0.0.1 --rls-port "$PORT" --http-ip 127.0.0.1 \
            --http-port "$((PORT + 10000))" "$WORK/config/limits.yaml" "${storage[@]}" \
            >"$WORK/service.log" 2>&1 &
    else
        [[ $backend == redis ]] && flags+=(--redis-url "redis://127.0.0.1:$REDIS_PORT")
        "${pin[@]}" "$binary" serve --config "$WORK/config/config.yaml" --grpc-addr "127.0.0.1:$PORT" \
            --http-addr "127.0.0.1:$((PORT + 10000))" "${flags[@]}" >"$WORK/service.log" 2>&1 &
    fi
    local service=$!
    PIDS+=("$service")
    wait_port "$PORT" "$service"
    local load_pin=()
    if [[ -n $TASKSET ]]; then
        local others
        others=$(python3 -c "import os; print(','.join(str(c) for c in sorted(os.sched_getaffinity(0)) if str(c) not in '$TASKSET'.split(',')))")
        load_pin=(taskset -c "$others")
    fi
    local h2=("${load_pin[@]}" h2load -H content-type:application/grpc -H te:trailers
        -d "$WORK/body.bin" -c "$connections" -m "$streams"
        "http://127.0.0.1:$PORT/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit")
    "${h2[@]}" -n 20000 >/dev/null
    local log=()
    rm -f "$WORK/requests.log"
    [[ $streams == 1 ]] && log=(--log-file="$WORK/requests.log")
    local s0 r0 s1 r1 out
    s0=$(ticks "$service") r0=$(ticks "$REDIS_PID")
    out=$("${h2[@]}" -n "$REQUESTS" "${log[@]}")
    s1=$(ticks "$service") r1=$(ticks "$REDIS_PID")
    kill "$service"
    wait "$service" 2>/dev/null || true
    H2LOAD_OUTPUT=$out python3 - "$label" "$backend" "$load" "$round" "$REQUESTS" "$HZ" \
        "$((s1 - s0))" "$((r1 - r0))" "$WORK/requests.log" "$RESULTS" <<'EOF'
import json, os, re, sys
label, backend, load, round_, n, hz, sticks, rticks, log, results = sys.argv[1:]
n, hz = int(n), int(hz)
out = os.environ['H2LOAD_OUTPUT']
rate = float(re.search(r'finished in [\d.]+m?s, ([\d.]+) req/s', out).group(1))
ok = int(re.search(r'(\d+) 2xx', out).group(1))
row = dict(build=label, backend=backend, load=load, round=int(round_), requests=n, ok=ok,
           rate=rate, service_us=int(sticks) * 1e6 / hz / n,
           redis_us=int(rticks) * 1e6 / hz / n if backend == 'redis' else None)
try:
    lat = sorted(int(line.split()[2]) for line in open(log) if line.split()[1:2] == ['200'])
    q = lambda f: lat[min(len(lat) - 1, int(f * len(lat)))]
    row.update(p50_us=q(.5), p90_us=q(.9), p99_us=q(.99), p99_9_us=q(.999))
except FileNotFoundError:
    pass
with open(results, 'a') as f:
    f.write(json.dumps(row) + '\n')
redis = f" redis {row['redis_us']:.1f} µs" if row['redis_us'] is not None else ''
lat = f" p50 {row['p50_us']} p99 {row['p99_us']} p99.9 {row['p99_9_us']} µs" if 'p99_us' in row else ''
print(f"{label:10} {backend:6} {load:6} round {round_}: {rate:9.0f}/s ok {ok}"
      f" service {row['service_us']:.1f} µs{redis}{lat}")
EOF
}

for round in $(seq "$ROUNDS"); do
    for backend in $BACKENDS; do
        for load in $LOADS; do
            for build in $BUILDS; do
                run "${build%%=*}" "${build#*=}" "$backend" "$load" "$round"
            done
        done
    done
done
