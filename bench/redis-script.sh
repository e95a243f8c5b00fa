#!/usr/bin/env bash
# Redis CPU per call of the decision, against a minimal sliding-log script.
#
#   bench/redis-script.sh [LABEL=BINARY ...]
#
# Each LABEL=BINARY is a throttlegate binary whose Lua is measured (its
# hidden `print-lua` subcommand prints the function library and the EVALSHA
# script exactly as the service sends them); default
# new=${CARGO_TARGET_DIR:-target}/debug/throttlegate. Give two (for example
# old=... new=...) to compare versions in the same run: each library has
# its own name, so both load into one server.
#
# Starts one redis-server (--save "" --appendonly no) on a free port, loads
# every library (FUNCTION LOAD) and script (SCRIPT LOAD), the minimal
# yardstick of docs/redis.md ("Per-call cost") and `return 1`, then for each
# round and case runs every variant in turn: CONFIG RESETSTAT, `redis-benchmark
# -n N -c 50 -P 16` of one command, and `usec_per_call` of that command in
# INFO commandstats (time inside Redis only, so little moved by other load
# on the machine). Variants per binary: FCALL of the sliding log, FCALL of
# the fixed window, EVALSHA of the sliding log; then the yardstick and
# `return 1`. Cases:
#   hot     one key per variant, 1,000 per second: after the first 1,000
#           calls of a round nearly every call is denied
#   spread  a key per call out of 1,000,000 (redis-benchmark's
#           __rand_int__), 1,000 per second: every call is allowed and
#           writes
# Prints one line per variant and round (µs per call and its ratio to the
# yardstick of the same round and case), then the median per variant.
#
# Environment: ROUNDS (default 3), REQUESTS per variant and round (default
# 100000), CASES (default "hot spread").
#
# CALLGRIND=1 runs redis-server under `valgrind --tool=callgrind` and
# measures instructions per call instead (`callgrind_control --zero` before
# a variant, `--dump` after, its total Ir over the calls): exact and
# unmoved by the machine's load, but about 50x slower, so the defaults
# become ROUNDS=1 and REQUESTS=2000, and the hot limit 20 per second (a
# slow server must still deny most calls). The figure counts everything
# the server does per call (reading the command, the reply), alike for
# every variant.

set -euo pipefail
cd "$(dirname "$0")/.."
. bench/common.sh

CALLGRIND=${CALLGRIND:-0}
if [[ $CALLGRIND == 1 ]]; then
    ROUNDS=${ROUNDS:-1}
    REQUESTS=${REQUESTS:-2000}
    HOT_LIMIT=20
else
    ROUNDS=${ROUNDS:-3}
    REQUESTS=${REQUESTS:-100000}
    HOT_LIMIT=1000
fi
CASES=${CASES:-hot spread}
SOURCES=("$@")
if [[ ${#SOURCES[@]} -eq 0 ]]; then
    SOURCES=("new=${CARGO_TARGET_DIR:-target}/debug/throttlegate")
fi

free_port PORT
if [[ $CALLGRIND == 1 ]]; then
    mkdir -p "$WORK/callgrind"
    REDIS_WRAPPER=(valgrind --tool=callgrind --callgrind-out-file="$WORK/callgrind/out")
    REDIS_START_SECONDS=60
fi
start_redis "$PORT"
cli() { redis-cli -p "$PORT" "$@"; }

# The yardstick: the smallest sliding log worth the name (bench/minimal.lua).
MINIMAL=$(cli -x SCRIPT LOAD <bench/minimal.lua)
NOTHING=$(cli SCRIPT LOAD 'return 1')

# Variants: a label, the command's name in INFO commandstats, the command
# up to its key, and what follows the key (%s is the algorithm's fields).
LABELS=() STATS=() HEADS=() TAILS=()
variant() { LABELS+=("$1") STATS+=("$2") HEADS+=("$3") TAILS+=("$4"); }
# The spread case's keys never reach 1,000; the hot key does (HOT_LIMIT).
# A limit is one argument, its fields joined by ':' (builds before the
# packed limit argument took eight; builds with `charge` take nine).
LOG='sliding_window_log:LIMIT:1000000:LIMIT:0:1:1:enforce'
FIXED='fixed_window:LIMIT:1000000:LIMIT:1:1:1:enforce'
for source in "${SOURCES[@]}"; do
    label=${source%%=*} binary=${source#*=}
    "$binary" print-lua library >"$WORK/$label.library"
    "$binary" print-lua decide >"$WORK/$label.decide"
    mapfile -t names < <("$binary" print-lua names)
    cli -x FUNCTION LOAD <"$WORK/$label.library" >/dev/null
    sha=$(cli -x SCRIPT LOAD <"$WORK/$label.decide")
    # Builds whose limits have a ninth field, `charge`, get if_allowed.
    charge=''
    grep -q "'charge'" "$WORK/$label.library" && charge=':if_allowed'
    variant "$label-fcall-log" fcall "FCALL ${names[1]} 1" "'' 0 0 $LOG$charge"
    variant "$label-fcall-fixed" fcall "FCALL ${names[1]} 1" "'' 0 0 $FIXED$charge"
    variant "$label-evalsha-log" evalsha "EVALSHA $sha 1" "'' 0 0 $LOG$charge"
done
variant minimal evalsha "EVALSHA $MINIMAL 1" "1000000 LIMIT"
variant return-1 evalsha "EVALSHA $NOTHING 1" ""

# usec_per_call of command $1 since the last CONFIG RESETSTAT.
usec_per_call() {
    cli INFO commandstats | tr -d '\r' |
        sed -n "s/^cmdstat_$1:.*usec_per_call=\([0-9.]*\).*/\1/p"
}

# Instructions per call since the last `callgrind_control --zero`: dump,
# read the newest dump's total, divide.
instructions_per_call() {
    callgrind_control --dump "$REDIS_STARTED" >/dev/null 2>&1
    local dump
    dump=$(ls -t "$WORK"/callgrind/out.* | head -1)
    awk -v n="$REQUESTS" '/^(summary|totals):/ { printf "%.0f", $2 / n; exit }' "$dump"
}
UNIT=usec/call
[[ $CALLGRIND == 1 ]] && UNIT=Ir/call

RESULTS=$WORK/results
: >"$RESULTS"
printf '%-6s %-5s %-22s %10s %8s\n' case round variant "$UNIT" /minimal
for round in $(seq "$ROUNDS"); do
    for case in $CASES; do
        cli FLUSHALL >/dev/null
        declare -A usec=()
        for idx in "${!LABELS[@]}"; do
            label=${LABELS[$idx]}
            if [[ $case == hot ]]; then
                key="tg:hot:$label:$round"
                random=()
                limit=$HOT_LIMIT
            else
                key="tg:spread:$label:$round:__rand_int__"
                random=(-r 1000000)
                limit=1000
            fi
            cli CONFIG RESETSTAT >/dev/null
            [[ $CALLGRIND == 1 ]] && callgrind_control --zero "$REDIS_STARTED" >/dev/null 2>&1
            # eval: the tails hold '' (an empty now_us: the server's TIME).
            eval "redis-benchmark -p $PORT -n $REQUESTS -c 50 -P 16 -q ${random[*]} \
                ${HEADS[$idx]} $key ${TAILS[$idx]//LIMIT/$limit}" >/dev/null
            if [[ $CALLGRIND == 1 ]]; then
                usec[$label]=$(instructions_per_call)
            else
                usec[$label]=$(usec_per_call "${STATS[$idx]}")
            fi
        done
        for label in "${LABELS[@]}"; do
            ratio=$(awk -v a="${usec[$label]}" -v b="${usec[minimal]}" 'BEGIN { printf "%.2f", a / b }')
            printf '%-6s %-5s %-22s %10s %8s\n' "$case" "$round" "$label" "${usec[$label]}" "$ratio"
            echo "$case $label ${usec[$label]} $ratio" >>"$RESULTS"
        done
        unset usec
    done
done

echo
echo "median over $ROUNDS rounds (load average: $(cut -d' ' -f1-3 /proc/loadavg))"
printf '%-6s %-22s %10s %8s\n' case variant "$UNIT" /minimal
for case in $CASES; do
    for label in "${LABELS[@]}"; do
        awk -v c="$case" -v l="$label" '$1 == c && $2 == l { u[n] = $3; r[n++] = $4 }
            END {
                asort(u); asort(r)
                m = int((n + 1) / 2)
                printf "%-6s %-22s %10s %8s\n", c, l, u[m], r[m]
            }' "$RESULTS"
    done
done
