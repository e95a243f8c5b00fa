#!/usr/bin/env bash
# Endurance run of the service on the Redis backend: is memory, descriptor
# and Redis key use flat under steady load with config reloads, and is
# every request answered?
#
#   bench/soak.sh                 # 10 minutes; SOAK_DURATION=120 for a short one
#
# Builds the release binaries, starts a redis-server (no persistence) and
# the service on free ports with a config this script writes (domain
# `soak`, key `client`, see bench/soak.py), then:
# 1. measures the maximum throughput of the soak's request mix for
#    MEASURE_DURATION at saturation (closed loop, CONNECTIONSxSTREAMS);
# 2. flushes Redis and runs the soak: SOAK_DURATION seconds paced at
#    SOAK_FRACTION of that throughput (open loop: `--rate`), half of the
#    requests on 8 hot values (values 0 and 1 over their limits, the
#    others under) and half on values never used before in the run, which
#    create Redis keys that expire a minute later;
# 3. rewrites the config every RELOAD_EVERY seconds (value 0's limit
#    alternates) and checks that the service's reload count rises;
# 4. prints a line every REPORT_EVERY seconds: decisions/s, answers,
#    errors, requests sent late, latency percentiles of the interval,
#    service RSS (VmRSS), open descriptors, service and Redis CPU, Redis
#    used_memory and DBSIZE, reloads so far;
# 5. ends with a markdown table and a verdict comparing the first report
#    after SOAK_WARMUP seconds with the last one. Exit 1 if any request
#    failed, the service's RSS grew by more than MAX_RSS_GROWTH_MB, its
#    descriptors by more than MAX_FD_GROWTH, Redis' key count by more than
#    MAX_KEY_GROWTH (a share: no plateau), or a config rewrite was not
#    reloaded.
#
# Environment (defaults in brackets):
#   BIN                directory of the release binaries; when set, nothing
#                      is built [${CARGO_TARGET_DIR:-target}/release, built]
#   SOAK_DURATION      seconds of the soak [600]
#   SOAK_FRACTION      share of the measured throughput to run at [0.5]
#   SOAK_RATE          requests/s; skips the measurement when set
#   SOAK_WARMUP        seconds before the verdict's first report [120]
#   MEASURE_DURATION   seconds of the throughput measurement [20]
#   CONNECTIONS, STREAMS   the load's connections and streams on each
#                      (the measurement's concurrency; the soak's bound on
#                      requests in flight) [4, 32]
#   REPORT_EVERY, RELOAD_EVERY   seconds [30, 60]
#   MAX_RSS_GROWTH_MB [10], MAX_FD_GROWTH [4], MAX_KEY_GROWTH [0.25]
#   SOAK_OUT           a copy of the report (table and verdict) and, next
#                      to it, SOAK_OUT.load: the generator's own output
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
SOAK_DURATION=${SOAK_DURATION:-600}
SOAK_FRACTION=${SOAK_FRACTION:-0.5}
SOAK_RATE=${SOAK_RATE:-}
SOAK_WARMUP=${SOAK_WARMUP:-120}
MEASURE_DURATION=${MEASURE_DURATION:-20}
CONNECTIONS=${CONNECTIONS:-4}
STREAMS=${STREAMS:-32}
REPORT_EVERY=${REPORT_EVERY:-30}
RELOAD_EVERY=${RELOAD_EVERY:-60}
MAX_RSS_GROWTH_MB=${MAX_RSS_GROWTH_MB:-10}
MAX_FD_GROWTH=${MAX_FD_GROWTH:-4}
MAX_KEY_GROWTH=${MAX_KEY_GROWTH:-0.25}
SOAK_OUT=${SOAK_OUT:-}

if [[ -z ${BIN:-} ]]; then
    (cd "$HERE/.." && cargo build --release --bins)
    BIN=${CARGO_TARGET_DIR:-$HERE/../target}/release
fi
for tool in redis-server redis-cli curl python3 "$BIN/throttlegate" "$BIN/throttlegate-load"; do
    command -v "$tool" >/dev/null || {
        echo "missing $tool (redis: apt-get install redis-server; binaries: cargo build --release --bins)" >&2
        exit 1
    }
done

# shellcheck source=bench/common.sh
source "$HERE/common.sh"

free_port REDIS_PORT
free_port GRPC_PORT
free_port HTTP_PORT
start_redis "$REDIS_PORT"
REDIS_PID=$REDIS_STARTED
CONFIG=$WORK/config.yaml
HTTP=127.0.0.1:$HTTP_PORT

reload_count() {
    curl -fsS "http://$HTTP/metrics" |
        awk '/^throttlegate_config_reloads_total\{result="ok"\}/ { print $2 + 0; found = 1 }
             END { if (!found) print 0 }'
}

# Rules for the rate $1 (variant $2); waits for the reload when the service
# runs already.
configure() {
    local before
    [[ -n ${SERVICE_PID:-} ]] && before=$(reload_count)
    python3 "$HERE/soak.py" config "$1" "$2" "$CONFIG"
    [[ -z ${SERVICE_PID:-} ]] && return
    for _ in $(seq 100); do
        (($(reload_count) > before)) && return
        sleep 0.1
    done
    echo "the service did not reload $CONFIG within 10 s; its log:" >&2
    cat "$WORK/service.log" >&2
    exit 1
}

SERVICE_PID=
configure "${SOAK_RATE:-1000}" 0
RUST_LOG=warn "$BIN/throttlegate" serve --config "$CONFIG" --watch-config on \
    --grpc-addr "127.0.0.1:$GRPC_PORT" --http-addr "$HTTP" \
    --redis-url "redis://127.0.0.1:$REDIS_PORT" 2>>"$WORK/service.log" &
SERVICE_PID=$!
PIDS+=("$SERVICE_PID")
for _ in $(seq 400); do
    curl -fsS "http://$HTTP/metrics" >/dev/null 2>&1 && break
    kill -0 "$SERVICE_PID" 2>/dev/null || break
    sleep 0.05
done
curl -fsS "http://$HTTP/metrics" >/dev/null || {
    echo "the service (pid $SERVICE_PID) did not start; its log:" >&2
    cat "$WORK/service.log" >&2
    exit 1
}
echo "service pid $SERVICE_PID (gRPC $GRPC_PORT, HTTP $HTTP_PORT), redis-server pid $REDIS_PID ($REDIS_PORT)"
echo "machine: $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg)"

if [[ -z $SOAK_RATE ]]; then
    "$BIN/throttlegate-load" --addr "http://127.0.0.1:$GRPC_PORT" --domain soak --key client \
        --distribution hot-and-fresh --hot-keys 8 --hot-share 0.5 \
        --connections "$CONNECTIONS" --streams "$STREAMS" --warmup 2s \
        --duration "${MEASURE_DURATION}s" --pid "service=$SERVICE_PID" --pid "redis=$REDIS_PID" \
        >"$WORK/measure.out"
    MAX_RATE=$(sed -n 's/^summary //p' "$WORK/measure.out" | python3 -c 'import json,sys; print(round(json.load(sys.stdin)["rate"]))')
    grep -E '^(requests|answers|latency|cpu)' "$WORK/measure.out" | sed 's/^/measure: /'
    SOAK_RATE=$(python3 -c "print(max(1, round($MAX_RATE * $SOAK_FRACTION)))")
    echo "saturation: $MAX_RATE decisions/s; the soak runs at $SOAK_RATE requests/s ($SOAK_FRACTION of it)"
fi

redis-cli -p "$REDIS_PORT" flushall >/dev/null
configure "$SOAK_RATE" 0
echo "soak: ${SOAK_DURATION}s, load average $(cut -d' ' -f1-3 /proc/loadavg)"
status=0
python3 "$HERE/soak.py" watch --load "$BIN/throttlegate-load" --grpc "127.0.0.1:$GRPC_PORT" \
    --http "$HTTP" --redis-port "$REDIS_PORT" --service-pid "$SERVICE_PID" \
    --redis-pid "$REDIS_PID" --config "$CONFIG" --rate "$SOAK_RATE" \
    --duration "$SOAK_DURATION" --report-every "$REPORT_EVERY" --reload-every "$RELOAD_EVERY" \
    --warmup "$SOAK_WARMUP" --connections "$CONNECTIONS" --streams "$STREAMS" \
    --max-rss-growth-mb "$MAX_RSS_GROWTH_MB" --max-fd-growth "$MAX_FD_GROWTH" \
    --max-key-growth "$MAX_KEY_GROWTH" ${SOAK_OUT:+--raw "$SOAK_OUT.load"} |
    tee ${SOAK_OUT:+"$SOAK_OUT"} || status=$?
echo "load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)"
if grep -qiE 'panic|error' "$WORK/service.log"; then
    echo "the service logged errors:" >&2
    grep -iE 'panic|error' "$WORK/service.log" | tail -20 >&2
fi
exit "$status"
