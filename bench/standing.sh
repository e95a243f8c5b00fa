#!/usr/bin/env bash
# Every measurement behind docs/benchmarks.md, one after the other, on one
# quiet machine: 30 to 75 minutes, depending on the machine. Each part's
# output goes to OUT/PART.txt (its JSON lines to OUT/PART.jsonl where it
# writes any); a part that fails is named at the end and the others still
# run.
#
#   bench/standing.sh OUT [PART...]   # default every part, in this order:
#
#   h2load       CPU per decision and decisions/s under h2load, with
#                `--grpc-threads 2` and limitador, and the minimal script
#   h2load-log   the same for the sliding log (throttlegate only)
#   exact        exactly N across two instances (bench/exact.sh)
#   envoy        latency added at Envoy's HTTP rate-limit filter
#   sweep        decisions/s and p99 against concurrency, and the plot
#                (OUT/concurrency.svg)
#   growth       cost growth: descriptors, keys, rules, connections
#   cluster      one Redis server against a three-primary cluster
#   memory       bytes per key in the memory backend (cargo bench)
#   first        the first requests of a fresh service
#   script       Redis's own time per call against the minimal script
#   overload     goodput under overload, batching off and on, at 1,000,
#                2,000 and 4,000 in flight
#   rlqs         RLQS against RLS behind Envoy
#   soak         ten minutes on Redis with reloads
#
# Environment:
#   BIN        directory of the release binaries
#              (default ${CARGO_TARGET_DIR:-target}/release; built first
#              with `cargo build --release --bins`)
#   LIMITADOR  path to limitador-server (release build); without it the
#              limitador rows are left out
#   ENVOY_BIN  the Envoy binary (default `envoy` on PATH)
#
# Start it on an idle machine (load average under 0.1) and leave the
# machine alone until it ends: decisions/s and tail latency move with
# anything else that runs.
set -uo pipefail

OUT=${1:?usage: bench/standing.sh OUT [PART...]}
shift
PARTS=${*:-"h2load h2load-log exact envoy sweep growth cluster memory first script overload rlqs soak"}
HERE=$(cd "$(dirname "$0")" && pwd)
export BIN=${BIN:-${CARGO_TARGET_DIR:-$HERE/../target}/release}
export ENVOY_BIN=${ENVOY_BIN:-envoy}
LIMITADOR=${LIMITADOR:-}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

(cd "$HERE/.." && cargo build --release --locked --bins -q) || exit 1
(cd "$HERE/.." && cargo bench --locked --bench memory_per_key --no-run -q) || exit 1

failed=()
part() { # name, then the command; stdout and stderr to OUT/name.txt
    local name=$1
    shift
    printf '%s %-10s ' "$(date +%H:%M:%S)" "$name"
    if "$@" >"$OUT/$name.txt" 2>&1; then
        echo done
    else
        echo "FAILED (see $OUT/$name.txt)"
        failed+=("$name")
    fi
}

h2load_builds="main=$BIN/throttlegate threads=$BIN/throttlegate,--grpc-threads,2"
[[ -n $LIMITADOR ]] && h2load_builds+=" limitador=$LIMITADOR"

{
    echo "date: $(date -u +%Y-%m-%dT%H:%MZ)"
    echo "commit: $(git -C "$HERE/.." rev-parse --short HEAD)$(git -C "$HERE/.." diff --quiet HEAD -- src lua || echo ' (modified)')"
    echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | xargs), $(nproc) vCPU, $(free -g | awk '/Mem:/{print $2}') GiB"
    echo "os: $(. /etc/os-release && echo "$PRETTY_NAME"), $(uname -r)"
    echo "rustc: $(rustc --version)"
    echo "redis: $(redis-server --version | awk '{print $3}')"
    echo "envoy: $("$ENVOY_BIN" --version 2>/dev/null | grep -o 'version: [^ ]*' || echo none)"
    [[ -n $LIMITADOR ]] && echo "limitador: $LIMITADOR"
    echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
} >"$OUT/machine.txt"

for name in $PARTS; do
    case $name in
    h2load)
        part h2load env BUILDS="$h2load_builds" MINIMAL=1 RESULTS="$OUT/h2load.jsonl" \
            "$HERE/h2load.sh" 2
        ;;
    h2load-log)
        part h2load-log env BUILDS="main=$BIN/throttlegate" ALGORITHM=sliding_window_log MINIMAL=1 \
            RESULTS="$OUT/h2load.jsonl" "$HERE/h2load.sh" 2
        ;;
    exact) part exact env LIMITADOR="$LIMITADOR" "$HERE/exact.sh" 1 ;;
    envoy)
        part envoy env LIMITADOR="$LIMITADOR" DURATION=5s WARMUP=1s RESULTS="$OUT/envoy.jsonl" \
            "$HERE/envoy.sh" 2
        ;;
    sweep)
        local_systems="memory redis-batch${LIMITADOR:+ limitador-memory limitador-redis}"
        part sweep env LIMITADOR="$LIMITADOR" SYSTEMS="$local_systems" \
            LOADS="1x1 4x1 16x1 64x1 50x10" REQUESTS=50000 RESULTS="$OUT/sweep.jsonl" \
            "$HERE/compare.sh" 2
        part plot "$HERE/plot.py" "$OUT/sweep.jsonl" -o "$OUT/concurrency.svg"
        ;;
    growth)
        part growth env SYSTEMS="memory redis-batch" ALGORITHM=sliding_window_log LOADS=50x10 \
            REQUESTS=50000 RESULTS="$OUT/growth.jsonl" \
            CASES="descriptors:1 descriptors:4 descriptors:16 keys:1 keys:10000 keys:1000000 rules:1 rules:100 rules:10000 connections:1 connections:8 connections:64" \
            "$HERE/compare.sh" 2
        ;;
    cluster) part cluster "$HERE/cluster.sh" 2 ;;
    memory) part memory bash -c "cd '$HERE/..' && cargo bench --locked --bench memory_per_key" ;;
    first) part first "$HERE/first-requests.sh" 3 ;;
    script) part script "$HERE/redis-script.sh" "main=$BIN/throttlegate" ;;
    overload) part overload env RESULTS="$OUT/overload.jsonl" "$HERE/overload.sh" 2 ;;
    rlqs)
        part rlqs env DURATION=5s WARMUP=1s RESULTS="$OUT/rlqs.jsonl" "$HERE/rlqs.sh" 2
        ;;
    soak) part soak env SOAK_OUT="$OUT/soak-report.txt" "$HERE/soak.sh" ;;
    *)
        echo "unknown part $name" >&2
        failed+=("$name")
        ;;
    esac
done
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)" >>"$OUT/machine.txt"
((${#failed[@]} == 0)) || {
    echo "failed: ${failed[*]}"
    exit 1
}
