//! A real Envoy per test: found through `ENVOY_BIN`, started from a YAML
//! config the test writes (ports filled in here), ready once its admin
//! `/ready` answers 200, read through its admin `/stats`, stopped on drop.
//!
//! Without `ENVOY_BIN` the tests are skipped with a printed reason, except
//! under `CI=true`, where a missing Envoy fails them with how to install it.

use std::collections::BTreeMap;
use std::fmt::Display;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use super::process::{free_addr, http_get};
use super::tools::Tool;

/// How long Envoy may take to answer `/ready` with 200.
const START_UP: Duration = Duration::from_secs(30);

/// How long Envoy may take to exit after SIGTERM before it is killed.
const STOP: Duration = Duration::from_secs(5);

/// The Envoy binary from `ENVOY_BIN`, or `None` after printing why `test`
/// is skipped (under `CI=true` it panics instead): see [`Tool::require`].
///
/// Each test starts with
/// `let Some(bin) = envoy_bin("name") else { return };`.
pub fn envoy_bin(test: &str) -> Option<PathBuf> {
    Tool::Envoy.require(test)
}

/// A `--base-id` no other Envoy of this test run uses: the process id
/// (at most 2^22 on Linux) times 256 plus a counter of this process, so
/// two test binaries running at once never pick the same one.
fn base_id() -> u32 {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    assert!(n < 256, "more than 256 Envoys in one test binary");
    (std::process::id() % (1 << 22)) * 256 + n
}

/// An Envoy config before it starts: the YAML text of everything but
/// `admin` (which is added here), with `${NAME}` placeholders.
///
/// - `${PORT_<NAME>}`: a free loopback port, picked at start; the address
///   is [`Envoy::addr`]`("<NAME>")`. Listeners bind `127.0.0.1`.
/// - any other `${NAME}`: the value given with [`EnvoyConfig::var`].
///
/// A placeholder left without a value is a panic naming it.
pub struct EnvoyConfig {
    yaml: String,
    vars: Vec<(String, String)>,
    concurrency: u32,
}

impl EnvoyConfig {
    pub fn new(yaml: &str) -> EnvoyConfig {
        EnvoyConfig {
            yaml: yaml.to_owned(),
            vars: Vec::new(),
            concurrency: 1,
        }
    }

    /// `${name}` is replaced with `value` (the last one given wins).
    pub fn var(mut self, name: &str, value: impl Display) -> EnvoyConfig {
        self.vars.push((name.to_owned(), value.to_string()));
        self
    }

    /// Worker threads (`--concurrency`, 1 unless set).
    pub fn concurrency(mut self, threads: u32) -> EnvoyConfig {
        self.concurrency = threads;
        self
    }

    /// Starts Envoy and waits until it is ready.
    pub fn start(self, bin: &Path) -> Envoy {
        Envoy::start(bin, self)
    }
}

/// A running Envoy; SIGTERM, then SIGKILL, and waited for on drop. Its log
/// is printed when dropped during a panic (a failing test).
pub struct Envoy {
    child: Option<Child>,
    pub admin: SocketAddr,
    ports: BTreeMap<String, SocketAddr>,
    dir: tempfile::TempDir,
}

impl Envoy {
    /// The config of `yaml` (see [`EnvoyConfig`]).
    pub fn config(yaml: &str) -> EnvoyConfig {
        EnvoyConfig::new(yaml)
    }

    fn start(bin: &Path, config: EnvoyConfig) -> Envoy {
        let dir = tempfile::tempdir().expect("create a temporary directory");
        let admin = free_addr();
        let mut ports = BTreeMap::new();
        let yaml = substitute(&config.yaml, &config.vars, &mut ports);
        let text = format!(
            "admin:\n  address:\n    socket_address: {{address: 127.0.0.1, port_value: {}}}\n{yaml}",
            admin.port()
        );
        let path = dir.path().join("envoy.yaml");
        std::fs::write(&path, &text).expect("write the Envoy config");
        let log = dir.path().join("envoy.log");
        let child = Command::new(bin)
            .arg("-c")
            .arg(&path)
            .arg("--disable-hot-restart")
            .args(["--base-id", &base_id().to_string()])
            .args(["--concurrency", &config.concurrency.to_string()])
            .args(["-l", "warning"])
            .arg("--log-path")
            .arg(&log)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|err| panic!("cannot run {}: {err}", bin.display()));
        let mut envoy = Envoy {
            child: Some(child),
            admin,
            ports,
            dir,
        };
        envoy.wait_ready();
        envoy
    }

    fn wait_ready(&mut self) {
        let deadline = Instant::now() + START_UP;
        loop {
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|it| it.try_wait().ok().flatten())
            {
                panic!(
                    "Envoy exited before it was ready: {status}\nconfig:\n{}\nlog:\n{}",
                    self.config_text(),
                    self.log()
                );
            }
            if admin_get(self.admin, "/ready").is_some_and(|(status, _)| status == 200) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "Envoy not ready within {START_UP:?}\nlog:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The address picked for `${PORT_<name>}`.
    pub fn addr(&self, name: &str) -> SocketAddr {
        *self
            .ports
            .get(name)
            .unwrap_or_else(|| panic!("no ${{PORT_{name}}} in the config"))
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    /// Envoy's log so far (`-l warning`).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("envoy.log")).unwrap_or_default()
    }

    /// The config Envoy was started with, placeholders filled in.
    pub fn config_text(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("envoy.yaml")).unwrap_or_default()
    }

    /// Every counter and gauge of admin `/stats` (`name: value` lines;
    /// histograms, whose values are not one number, are left out).
    pub async fn stats(&self) -> BTreeMap<String, u64> {
        let text = http_get(self.admin, "/stats").await;
        let body = text.split_once("\r\n\r\n").map_or("", |(_, body)| body);
        body.lines()
            .filter_map(|line| {
                let (name, value) = line.split_once(": ")?;
                Some((name.to_owned(), value.trim().parse().ok()?))
            })
            .collect()
    }

    /// The counter `name`; 0 when Envoy has not created it yet (it
    /// creates most counters at their first increment).
    pub async fn counter(&self, name: &str) -> u64 {
        self.stats().await.get(name).copied().unwrap_or(0)
    }

    /// Waits until `check` holds for the counter `name`, for at most
    /// `within`; its last value.
    pub async fn wait_counter(
        &self,
        name: &str,
        within: Duration,
        check: impl Fn(u64) -> bool,
    ) -> u64 {
        let deadline = Instant::now() + within;
        loop {
            let value = self.counter(name).await;
            if check(value) {
                return value;
            }
            assert!(
                Instant::now() < deadline,
                "{name} is still {value} after {within:?}\nlog:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The counters `cluster.<cluster>.ratelimit.{ok, over_limit, error,
    /// failure_mode_allowed}`, which the HTTP rate-limit filter keeps per
    /// route cluster.
    pub async fn ratelimit_counters(&self, cluster: &str) -> RateLimitCounters {
        let stats = self.stats().await;
        let get = |name: &str| {
            stats
                .get(&format!("cluster.{cluster}.ratelimit.{name}"))
                .copied()
                .unwrap_or(0)
        };
        RateLimitCounters {
            ok: get("ok"),
            over_limit: get("over_limit"),
            error: get("error"),
            failure_mode_allowed: get("failure_mode_allowed"),
        }
    }
}

/// The HTTP rate-limit filter's counters of one route cluster.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RateLimitCounters {
    pub ok: u64,
    pub over_limit: u64,
    pub error: u64,
    pub failure_mode_allowed: u64,
}

impl Drop for Envoy {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = Command::new("kill")
                .args(["-TERM", &child.id().to_string()])
                .status();
            let deadline = Instant::now() + STOP;
            while matches!(child.try_wait(), Ok(None)) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        if std::thread::panicking() {
            eprintln!(
                "---- Envoy (admin {}) config:\n{}\n---- Envoy log:\n{}\n----",
                self.admin,
                self.config_text(),
                self.log()
            );
        }
    }
}

/// `yaml` with every `${...}` replaced: `${PORT_<NAME>}` by a free port
/// (recorded in `ports` under `<NAME>`), others from `vars`.
fn substitute(
    yaml: &str,
    vars: &[(String, String)],
    ports: &mut BTreeMap<String, SocketAddr>,
) -> String {
    let mut out = String::with_capacity(yaml.len());
    // A value may hold placeholders itself (a cluster naming a port): it
    // is put back in front of what is left, and scanned again.
    let mut rest = yaml.to_owned();
    while let Some(start) = rest.find("${") {
        out.push_str(&rest[..start]);
        let end = rest[start..]
            .find('}')
            .unwrap_or_else(|| panic!("unclosed ${{ in the Envoy config: {}", &rest[start..]));
        let name = &rest[start + 2..start + end];
        let after = &rest[start + end + 1..];
        if let Some(port) = name.strip_prefix("PORT_") {
            let addr = *ports.entry(port.to_owned()).or_insert_with(free_addr);
            out.push_str(&addr.port().to_string());
            rest = after.to_owned();
        } else {
            let value = vars
                .iter()
                .rev()
                .find(|(key, _)| key == name)
                .map(|(_, value)| value)
                .unwrap_or_else(|| panic!("no value for ${{{name}}} in the Envoy config"));
            assert!(
                !value.contains(&format!("${{{name}}}")),
                "${{{name}}} refers to itself"
            );
            rest = format!("{value}{after}");
        }
    }
    out.push_str(&rest);
    out
}

/// `GET path` on the admin port, blocking, with a short timeout: the
/// status and body, or `None` when it does not answer (yet).
fn admin_get(addr: SocketAddr, path: &str) -> Option<(u16, String)> {
    use std::io::{Read, Write};
    let mut stream =
        std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(500)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    let request = format!("GET {path} HTTP/1.1\r\nHost: admin\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).ok()?;
    let mut response = Vec::new();
    stream.read_to_end(&mut response).ok()?;
    let text = String::from_utf8_lossy(&response).into_owned();
    let status = text.split_whitespace().nth(1)?.parse().ok()?;
    let body = text.split_once("\r\n\r\n").map_or("", |(_, body)| body);
    Some((status, body.to_owned()))
}

/// A static cluster of HTTP/2 (gRPC) endpoints, as one line of YAML flow
/// style, so it fits a `clusters:` list at any indentation:
/// `- ${RLS_CLUSTER}` with `.var("RLS_CLUSTER", grpc_cluster(...))`.
/// `extra` is more fields of the cluster in flow style (`health_checks:
/// [...]`), or empty.
pub fn grpc_cluster(name: &str, endpoints: &[SocketAddr], extra: &str) -> String {
    let endpoints: Vec<String> = endpoints
        .iter()
        .map(|addr| {
            format!(
                "{{endpoint: {{address: {{socket_address: {{address: {}, port_value: {}}}}}}}}}",
                addr.ip(),
                addr.port()
            )
        })
        .collect();
    let extra = if extra.is_empty() {
        String::new()
    } else {
        format!(", {extra}")
    };
    format!(
        "{{name: {name}, type: STATIC, connect_timeout: 1s, lb_policy: ROUND_ROBIN, \
         typed_extension_protocol_options: {{envoy.extensions.upstreams.http.v3.HttpProtocolOptions: \
         {{\"@type\": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions, \
         explicit_http_config: {{http2_protocol_options: {{}}}}}}}}, \
         load_assignment: {{cluster_name: {name}, endpoints: [{{lb_endpoints: [{}]}}]}}{extra}}}",
        endpoints.join(", ")
    )
}

/// A static HTTP/1.1 cluster of one loopback port, in flow style like
/// [`grpc_cluster`]; `port` is a placeholder name such as `PORT_UPSTREAM`
/// (so the same Envoy's `upstream` listener can serve it).
pub fn http_cluster(name: &str, port: &str) -> String {
    format!(
        "{{name: {name}, type: STATIC, connect_timeout: 1s, \
         load_assignment: {{cluster_name: {name}, endpoints: [{{lb_endpoints: \
         [{{endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: ${{{port}}}}}}}}}}}]}}]}}}}"
    )
}

/// The protected upstream, served by Envoy itself: a listener on
/// `${PORT_UPSTREAM}` answering every request 200 with a direct response,
/// as one line of YAML flow style for a `listeners:` list. Each header
/// named in `echo` is copied from the request to the response when
/// present (`x-reply-tokens: 4` in, `x-reply-tokens: 4` out), so a test
/// picks the response headers per request.
///
/// The rate-limit filter does nothing on a route that is itself a direct
/// response (it has no route entry and no cluster), so the routes under
/// test forward to this listener through [`http_cluster`].
pub fn upstream_listener(echo: &[&str]) -> String {
    let headers: Vec<String> = echo
        .iter()
        .map(|name| format!("{{header: {{key: {name}, value: \"%REQ({name})%\"}}}}"))
        .collect();
    format!(
        "{{name: upstream, address: {{socket_address: {{address: 127.0.0.1, port_value: ${{PORT_UPSTREAM}}}}}}, \
         filter_chains: [{{filters: [{{name: envoy.filters.network.http_connection_manager, typed_config: \
         {{\"@type\": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager, \
         stat_prefix: upstream, route_config: {{virtual_hosts: [{{name: upstream, domains: [\"*\"], \
         routes: [{{match: {{prefix: /}}, direct_response: {{status: 200, body: {{inline_string: ok}}}}, \
         response_headers_to_add: [{}]}}]}}]}}, \
         http_filters: [{{name: envoy.filters.http.router, typed_config: \
         {{\"@type\": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router}}}}]}}}}]}}]}}",
        headers.join(", ")
    )
}

/// The usual front: an `edge` listener on `${PORT_HTTP}` (HTTP/1.1,
/// `use_remote_address: true`) whose one route forwards everything to
/// cluster `upstream` (the same Envoy's [`upstream_listener`], echoing
/// `x-reply-tokens`), behind the HTTP rate-limit filter of domain `edge`
/// asking cluster `throttlegate` (`rls`, over HTTP/2).
///
/// What tests change, as YAML flow style:
/// - `ROUTE_RATE_LIMITS`: the route's own `rate_limits` (`[]`);
/// - `PER_ROUTE`: the route's `typed_per_filter_config` (`{}`);
/// - `FILTER`: more fields of the filter's config (`timeout: 1s`), such as
///   `failure_mode_deny: true` or the filter-level `rate_limits: [...]`;
/// - `RLS_CLUSTER`: the whole `throttlegate` cluster ([`grpc_cluster`]);
/// - `BEFORE_RATELIMIT`: an HTTP filter before the rate-limit filter, as
///   `- {name: ..., typed_config: {...}}` (none).
pub fn edge(rls: &[SocketAddr]) -> EnvoyConfig {
    EnvoyConfig::new(EDGE)
        .var("UPSTREAM_LISTENER", upstream_listener(&["x-reply-tokens"]))
        .var(
            "UPSTREAM_CLUSTER",
            http_cluster("upstream", "PORT_UPSTREAM"),
        )
        .var("RLS_CLUSTER", grpc_cluster("throttlegate", rls, ""))
        .var("ROUTE_RATE_LIMITS", "[]")
        .var("PER_ROUTE", "{}")
        .var("FILTER", "timeout: 1s")
        .var("BEFORE_RATELIMIT", "")
}

const EDGE: &str = r#"
static_resources:
  listeners:
    - ${UPSTREAM_LISTENER}
    - name: edge
      address: {socket_address: {address: 127.0.0.1, port_value: ${PORT_HTTP}}}
      filter_chains:
        - filters:
            - name: envoy.filters.network.http_connection_manager
              typed_config:
                "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
                stat_prefix: edge
                use_remote_address: true
                route_config:
                  virtual_hosts:
                    - name: all
                      domains: ["*"]
                      routes:
                        - {match: {prefix: "/"}, route: {cluster: upstream, rate_limits: ${ROUTE_RATE_LIMITS}}, typed_per_filter_config: ${PER_ROUTE}}
                http_filters:
                  ${BEFORE_RATELIMIT}
                  - name: envoy.filters.http.ratelimit
                    typed_config: {"@type": type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimit, domain: edge, rate_limit_service: {grpc_service: {envoy_grpc: {cluster_name: throttlegate}}, transport_api_version: V3}, ${FILTER}}
                  - name: envoy.filters.http.router
                    typed_config:
                      "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
    - ${RLS_CLUSTER}
    - ${UPSTREAM_CLUSTER}
"#;
