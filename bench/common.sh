# Shared by the benchmark scripts (sourced, not run): a scratch directory
# and the processes to stop on exit, free ports, and redis-server.

WORK=$(mktemp -d)
PIDS=()
cleanup() {
    for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$WORK"
}
trap cleanup EXIT

# A port no socket uses, with the port 10000 above it free too (a cluster
# node's bus port); both below the usual ephemeral range (32768 and up), so
# no outgoing connection takes one between this check and the bind. Sets
# the variable named $1 (not printed: a command substitution's subshell
# would forget TAKEN).
TAKEN=" "
free_port() {
    local candidate
    while :; do
        candidate=$((12000 + RANDOM % 10000))
        [[ $TAKEN == *" $candidate "* || $TAKEN == *" $((candidate + 10000)) "* ]] && continue
        [[ -z $(ss -Htan "sport = :$candidate or sport = :$((candidate + 10000))") ]] || continue
        TAKEN+="$candidate $((candidate + 10000)) "
        printf -v "$1" %s "$candidate"
        return
    done
}

# redis-server on PORT with no persistence, its log in $WORK/redis-PORT;
# extra arguments are passed on. Sets REDIS_STARTED to its pid. With
# REDIS_WRAPPER (an array, e.g. valgrind and its options) the server runs
# under it, its stderr in $WORK/redis-PORT/wrapper; it must answer within
# REDIS_START_SECONDS (default 5).
start_redis() {
    local port=$1 dir=$WORK/redis-$1
    shift
    mkdir -p "$dir"
    ${REDIS_WRAPPER[@]+"${REDIS_WRAPPER[@]}"} \
        redis-server --port "$port" --bind 127.0.0.1 --dir "$dir" --save "" \
        --appendonly no --daemonize no --logfile "$dir/log" "$@" 2>>"$dir/wrapper" &
    REDIS_STARTED=$!
    PIDS+=("$REDIS_STARTED")
    for _ in $(seq $((${REDIS_START_SECONDS:-5} * 20))); do
        redis-cli -p "$port" ping >/dev/null 2>&1 && return
        sleep 0.05
    done
    echo "redis-server on $port did not start; its log:" >&2
    cat "$dir/log" >&2
    exit 1
}

# Waits until 127.0.0.1:$1 accepts a connection, while process $2 lives; else prints
# $WORK/service.log and exits.
wait_port() {
    for _ in $(seq 400); do
        (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return
        kill -0 "$2" 2>/dev/null || break
        sleep 0.05
    done
    echo "the service (pid $2) did not listen on $1; its log:" >&2
    cat "$WORK/service.log" >&2
    exit 1
}

# The sum of utime + stime of the given pids, in clock ticks (CLK_TCK).
cpu_ticks() {
    local total=0 pid
    for pid in "$@"; do
        total=$((total + $(awk '{print $14 + $15}' "/proc/$pid/stat")))
    done
    echo "$total"
}

# Exits naming the first of the given tools (names or paths) not found.
require_tools() {
    local tool
    for tool in "$@"; do
        command -v "$tool" >/dev/null || {
            echo "missing $tool (redis: apt-get install redis-server; binaries: cargo build --release --bins)" >&2
            exit 1
        }
    done
}

# The key of descriptor $1, as throttlegate-load names it.
descriptor_key() {
    if (($1 == 0)); then echo user; else echo "user_$1"; fi
}

# Starts Envoy ($ENVOY_BIN, --concurrency $ENVOY_CONCURRENCY) on
# $WORK/envoy.yaml, admin on port $1; sets ENVOY_PID once admin /ready
# answers 200.
start_envoy() {
    local admin=$1
    "$ENVOY_BIN" -c "$WORK/envoy.yaml" --concurrency "$ENVOY_CONCURRENCY" \
        --disable-hot-restart --base-id "$admin" -l warning >"$WORK/envoy.log" 2>&1 &
    ENVOY_PID=$!
    PIDS+=("$ENVOY_PID")
    for _ in $(seq 400); do
        [[ $(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$admin/ready") == 200 ]] && return
        kill -0 "$ENVOY_PID" 2>/dev/null || break
        sleep 0.05
    done
    echo "Envoy (pid $ENVOY_PID) did not get ready; its log:" >&2
    cat "$WORK/envoy.log" >&2
    exit 1
}

stop() { # stops process $1, waits for it and forgets it
    kill "$1" 2>/dev/null || true
    wait "$1" 2>/dev/null || true
    local kept=() pid
    for pid in "${PIDS[@]}"; do [[ $pid == "$1" ]] || kept+=("$pid"); done
    PIDS=("${kept[@]}")
}

# wrk on 127.0.0.1:$1 with $2 connections for $3, each request with the
# header `x-user: user-12345`, on $WRK_THREADS threads (default 1, at most
# the connections). Prints one line `result REQUESTS DURATION_US CONNECT
# READ WRITE STATUS TIMEOUT P50 P90 P99 P99.9` (errors by kind, STATUS =
# answers other than 2xx/3xx, latencies in µs).
wrk_load() {
    local threads=${WRK_THREADS:-1}
    ((threads > $2)) && threads=$2
    [[ -f $WORK/wrk.lua ]] || cat >"$WORK/wrk.lua" <<'EOF'
wrk.headers["x-user"] = "user-12345"
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format("result %d %d %d %d %d %d %d %.0f %.0f %.0f %.0f\n",
    summary.requests, summary.duration, e.connect, e.read, e.write, e.status,
    e.timeout, latency:percentile(50), latency:percentile(90),
    latency:percentile(99), latency:percentile(99.9)))
end
EOF
    wrk -t "$threads" -c "$2" -d "$3" -s "$WORK/wrk.lua" "http://127.0.0.1:$1/" | grep '^result '
}
