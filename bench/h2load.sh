#!/usr/bin/env bash
# Builds (or flag sets) of throttlegate side by side under h2load, a
# neutral HTTP/2 load generator written in C: service and Redis CPU per
# decision from /proc, and latency percentiles from h2load's per-request
# log at one stream per connection.
#
#   bench/h2load.sh [ROUNDS]          # default 2
#
# Every request is the same: domain `bench`, one descriptor of two entries
# (method=GET, user=user-12345), a limit that no run reaches (so one hot
# key; with Redis each decision is a call on it, or a part of one). For
# each round, backend and load, every build runs in turn on a fresh
# service (Redis flushed first): 20,000 requests of warm-up, then REQUESTS
# measured. h2load counts a gRPC error as a 2xx answer, so for throttlegate
# the run also reads the service's own counters (/metrics): requests
# decided and backend errors (a shed, a timeout), with a warning on the
# line when not every request was decided. With Redis, INFO commandstats
# over the measured run gives the time inside Redis per decision and the
# decisions per script call. One line per run on stdout and one JSON line
# appended to $RESULTS.
#
# With MINIMAL=1, each round ends with the yardstick in the same Redis: a
# minimal sliding-log script (bench/minimal.lua: TIME, drop what left the
# window, count, add and expire) run by redis-benchmark, 50 clients,
# pipeline 16, REQUESTS calls on one hot key and on keys drawn from 100,000
# (every call allowed): calls/s, time inside Redis and Redis CPU per call.
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
#   ALGORITHM fixed_window (default: 10^9 per minute) or
#             sliding_window_log (10^6 per hour, served with
#             --max-log-entries 1000000 so that the log stays a log)
#   MINIMAL   1: the minimal script's yardstick after each round (above)
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
ALGORITHM=${ALGORITHM:-fixed_window}
MINIMAL=${MINIMAL:-0}
case $ALGORITHM in
fixed_window)
    LIMIT="{unit: minute, requests_per_unit: 1000000000, algorithm: fixed_window}"
    SERVE_FLAGS=()
    ;;
sliding_window_log)
    LIMIT="{unit: hour, requests_per_unit: 1000000, algorithm: sliding_window_log}"
    SERVE_FLAGS=(--max-log-entries 1000000)
    ;;
*) echo "ALGORITHM: fixed_window or sliding_window_log" >&2 && exit 1 ;;
esac

for tool in h2load redis-server redis-cli redis-benchmark python3; do
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
cat >"$WORK/config/config.yaml" <<EOF
domain: bench
descriptors:
  - key: method
    value: GET
    descriptors:
      - key: user
        rate_limit: $LIMIT
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

# The sum of the samples of metric $2 on throttlegate's /metrics at port
# $1 whose labels contain $3 (0 when none).
metric_sum() {
    curl -s "http://127.0.0.1:$1/metrics" |
        awk -v name="$2" -v label="$3" '$1 ~ "^"name"[{]" && index($1, label) { sum += $2 } END { printf "%d", sum }'
}

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
        flags+=(${SERVE_FLAGS[@]+"${SERVE_FLAGS[@]}"})
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
    local s0 r0 s1 r1 out stats decided=-1 failed=-1 d0 f0
    # h2load counts a gRPC error (HTTP 200, grpc-status in the trailers) as
    # 2xx: throttlegate's own counters say how many requests were decided
    # and how many failed in the backend (shed, timeout, ...).
    local metrics=$((PORT + 10000)) own=0
    [[ $(basename "$binary") != limitador-server ]] && own=1
    if ((own)); then
        d0=$(metric_sum "$metrics" throttlegate_decisions_total result=)
        f0=$(metric_sum "$metrics" throttlegate_backend_errors_total kind=)
    fi
    redis-cli -p "$REDIS_PORT" config resetstat >/dev/null
    s0=$(cpu_ticks "$service") r0=$(cpu_ticks "$REDIS_PID")
    out=$("${h2[@]}" -n "$REQUESTS" "${log[@]}")
    s1=$(cpu_ticks "$service") r1=$(cpu_ticks "$REDIS_PID")
    stats=$(redis-cli -p "$REDIS_PORT" info commandstats | tr -d '\r')
    if ((own)); then
        decided=$(($(metric_sum "$metrics" throttlegate_decisions_total result=) - d0))
        failed=$(($(metric_sum "$metrics" throttlegate_backend_errors_total kind=) - f0))
    fi
    kill "$service"
    wait "$service" 2>/dev/null || true
    H2LOAD_OUTPUT=$out COMMANDSTATS=$stats python3 - "$label" "$backend" "$load" "$round" \
        "$REQUESTS" "$HZ" "$((s1 - s0))" "$((r1 - r0))" "$WORK/requests.log" "$RESULTS" \
        "$ALGORITHM" "$decided" "$failed" <<'EOF'
import json, os, re, sys
(label, backend, load, round_, n, hz, sticks, rticks, log, results, algorithm, decided,
 failed) = sys.argv[1:]
n, hz = int(n), int(hz)
out = os.environ['H2LOAD_OUTPUT']
rate = float(re.search(r'finished in [\d.]+m?s, ([\d.]+) req/s', out).group(1))
ok = int(re.search(r'(\d+) 2xx', out).group(1))
row = dict(build=label, backend=backend, load=load, round=int(round_), requests=n, ok=ok,
           algorithm=algorithm, rate=rate, service_us=int(sticks) * 1e6 / hz / n,
           redis_us=int(rticks) * 1e6 / hz / n if backend == 'redis' else None)
# The script calls of the measured run (FCALL, EVALSHA, EVAL): their time
# includes the commands they run, which commandstats also counts apart.
calls = usec = 0
for line in os.environ['COMMANDSTATS'].splitlines():
    m = re.match(r'cmdstat_(\w+):calls=(\d+),usec=(\d+)', line)
    if m and m.group(1) in ('fcall', 'evalsha', 'eval'):
        calls, usec = calls + int(m.group(2)), usec + int(m.group(3))
if backend == 'redis' and calls:
    row.update(inside_redis_us=usec / n, decisions_per_call=n / calls)
if int(decided) >= 0:
    row.update(decided=int(decided), failed=int(failed))
try:
    lat = sorted(int(line.split()[2]) for line in open(log) if line.split()[1:2] == ['200'])
    q = lambda f: lat[min(len(lat) - 1, int(f * len(lat)))]
    row.update(p50_us=q(.5), p90_us=q(.9), p99_us=q(.99), p99_9_us=q(.999))
except FileNotFoundError:
    pass
with open(results, 'a') as f:
    f.write(json.dumps(row) + '\n')
redis = f" redis {row['redis_us']:.1f} µs" if row['redis_us'] is not None else ''
if 'inside_redis_us' in row:
    redis += f" (inside {row['inside_redis_us']:.2f} µs, {row['decisions_per_call']:.1f}/call)"
lat = f" p50 {row['p50_us']} p99 {row['p99_us']} p99.9 {row['p99_9_us']} µs" if 'p99_us' in row else ''
check = ''
if 'decided' in row and (row['decided'] != n or row['failed']):
    check = f" WARNING: {row['decided']} decided, {row['failed']} backend errors"
print(f"{label:10} {backend:6} {load:6} round {round_}: {rate:9.0f}/s ok {ok}"
      f" service {row['service_us']:.1f} µs{redis}{lat}{check}")
EOF
}


# The yardstick (see the header) on a hot key and on spread keys
# (redis-benchmark's -r replaces __rand_int__ in the key).
minimal() {
    local round=$1 case out r0 r1 stats sha key rand
    for case in hot spread; do
        redis-cli -p "$REDIS_PORT" flushall >/dev/null
        sha=$(redis-cli -p "$REDIS_PORT" -x script load <"$HERE/minimal.lua")
        key=minimal rand=()
        [[ $case == spread ]] && key=minimal:__rand_int__ rand=(-r 100000)
        redis-cli -p "$REDIS_PORT" config resetstat >/dev/null
        r0=$(cpu_ticks "$REDIS_PID")
        out=$(redis-benchmark -p "$REDIS_PORT" -n "$REQUESTS" -c 50 -P 16 "${rand[@]}" -q \
            evalsha "$sha" 1 "$key" 1000000000 1000000000 | tr '\r' '\n' | grep 'per second' | tail -1)
        r1=$(cpu_ticks "$REDIS_PID")
        stats=$(redis-cli -p "$REDIS_PORT" info commandstats | tr -d '\r')
        python3 - "$case" "$round" "$REQUESTS" "$HZ" "$((r1 - r0))" "$RESULTS" "$out" "$stats" <<'EOF'
import json, re, sys
case, round_, n, hz, rticks, results, out, stats = sys.argv[1:]
n = int(n)
rate = float(re.search(r'([\d.]+) requests per second', out).group(1))
usec = int(re.search(r'cmdstat_evalsha:calls=\d+,usec=(\d+)', stats).group(1))
row = dict(build=f'minimal-{case}', backend='redis', load='50x16', round=int(round_),
           requests=n, rate=rate, redis_us=int(rticks) * 1e6 / int(hz) / n,
           inside_redis_us=usec / n)
with open(results, 'a') as f:
    f.write(json.dumps(row) + '\n')
print(f"{row['build']:14} redis  round {round_}: {rate:9.0f}/s redis {row['redis_us']:.1f} µs"
      f" (inside {row['inside_redis_us']:.2f} µs)")
EOF
    done
}

for round in $(seq "$ROUNDS"); do
    for backend in $BACKENDS; do
        for load in $LOADS; do
            for build in $BUILDS; do
                run "${build%%=*}" "${build#*=}" "$backend" "$load" "$round"
            done
        done
    done
    if [[ $MINIMAL == 1 ]]; then minimal "$round"; fi
done
