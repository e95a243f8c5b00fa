//! The Envoy example in `deploy/` (envoy.yaml, docker-compose.yaml,
//! Dockerfile, config/) agrees with itself and with the built binary:
//! domain, ports, flags, health endpoints, rules, build command. Neither
//! Envoy nor Docker is needed: the files are parsed, and the rules are
//! served by the real binary and asked as Envoy would ask.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use crate::support::process::{Serve, command, http_get};
use crate::support::request::{descriptor, request};
use serde_yaml_ng::Value;
use throttlegate::proto::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use throttlegate::proto::envoy::service::ratelimit::v3::rate_limit_response::Code;

const RATELIMIT_FILTER: &str = "envoy.filters.http.ratelimit";
const RATELIMIT_TYPE: &str =
    "type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimit";
const HCM_TYPE: &str = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager";
const HTTP_OPTIONS: &str = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions";
/// The service names `grpc.health.v1.Health` answers for.
const HEALTH_SERVICES: [&str; 3] = [
    "",
    "ratelimit",
    "envoy.service.ratelimit.v3.RateLimitService",
];

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn deploy(path: &str) -> PathBuf {
    root().join("deploy").join(path)
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|err| panic!("read {}: {err}", path.display()))
}

fn yaml(path: &Path) -> Value {
    serde_yaml_ng::from_str(&read(path))
        .unwrap_or_else(|err| panic!("{} is not YAML: {err}", path.display()))
}

fn str_at<'a>(value: &'a Value, path: &[&str]) -> &'a str {
    let mut at = value;
    for key in path {
        at = &at[*key];
    }
    at.as_str()
        .unwrap_or_else(|| panic!("no string at {path:?} in {value:?}"))
}

fn seq(value: &Value) -> &[Value] {
    value
        .as_sequence()
        .map(Vec::as_slice)
        .unwrap_or_else(|| panic!("not a list: {value:?}"))
}

fn envoy() -> Value {
    yaml(&deploy("envoy/envoy.yaml"))
}

/// docker-compose.yaml with its `<<: *anchor` merge keys applied, as
/// Compose reads it.
fn compose() -> Value {
    let mut compose = yaml(&deploy("docker-compose.yaml"));
    compose.apply_merge().expect("compose merge keys");
    compose
}

/// The compose services of the two replicas, which are also the endpoint
/// names of Envoy's `throttlegate` cluster.
const REPLICAS: [&str; 2] = ["throttlegate-a", "throttlegate-b"];

/// Every HTTP connection manager of every listener.
fn connection_managers(envoy: &Value) -> Vec<&Value> {
    let mut found = Vec::new();
    for listener in seq(&envoy["static_resources"]["listeners"]) {
        for chain in seq(&listener["filter_chains"]) {
            for filter in seq(&chain["filters"]) {
                if filter["typed_config"]["@type"].as_str() == Some(HCM_TYPE) {
                    found.push(&filter["typed_config"]);
                }
            }
        }
    }
    assert!(!found.is_empty(), "no HttpConnectionManager in envoy.yaml");
    found
}

/// The one rate-limit filter's typed_config.
fn ratelimit_filter(envoy: &Value) -> &Value {
    let filters: Vec<&Value> = connection_managers(envoy)
        .into_iter()
        .flat_map(|hcm| seq(&hcm["http_filters"]))
        .filter(|filter| filter["name"].as_str() == Some(RATELIMIT_FILTER))
        .collect();
    assert_eq!(filters.len(), 1, "one {RATELIMIT_FILTER} filter");
    &filters[0]["typed_config"]
}

fn cluster<'a>(envoy: &'a Value, name: &str) -> &'a Value {
    seq(&envoy["static_resources"]["clusters"])
        .iter()
        .find(|it| it["name"].as_str() == Some(name))
        .unwrap_or_else(|| panic!("no cluster {name} in envoy.yaml"))
}

/// The rate_limits entries of every route, each a list of actions.
fn route_rate_limits(envoy: &Value) -> Vec<&Value> {
    let mut found = Vec::new();
    for hcm in connection_managers(envoy) {
        for host in seq(&hcm["route_config"]["virtual_hosts"]) {
            for route in seq(&host["routes"]) {
                if let Some(limits) = route["route"]["rate_limits"].as_sequence() {
                    found.extend(limits.iter().map(|it| &it["actions"]));
                }
                if let Some(limits) =
                    route["typed_per_filter_config"][RATELIMIT_FILTER]["rate_limits"].as_sequence()
                {
                    found.extend(limits.iter().map(|it| &it["actions"]));
                }
            }
        }
    }
    assert!(
        !found.is_empty(),
        "no route-level rate_limits in envoy.yaml"
    );
    found
}

/// The descriptor key Envoy gives the entry an action produces.
fn action_key(action: &Value) -> String {
    let mapping = action.as_mapping().expect("an action is a mapping");
    assert_eq!(mapping.len(), 1, "one action per list item: {action:?}");
    let (kind, body) = mapping.iter().next().unwrap();
    match kind.as_str().unwrap() {
        "remote_address" => "remote_address".to_owned(),
        "source_cluster" => "source_cluster".to_owned(),
        "destination_cluster" => "destination_cluster".to_owned(),
        "request_headers" => str_at(body, &["descriptor_key"]).to_owned(),
        "generic_key" => body["descriptor_key"]
            .as_str()
            .unwrap_or("generic_key")
            .to_owned(),
        other => panic!("an action this test does not know: {other}"),
    }
}

/// The domain and the top-level descriptor keys of every rules file.
fn rules() -> Vec<(String, BTreeSet<String>)> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(deploy("config"))
        .expect("deploy/config")
        .map(|it| it.unwrap().path())
        .filter(|it| {
            matches!(
                it.extension().and_then(|e| e.to_str()),
                Some("yaml" | "yml")
            )
        })
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no rules in deploy/config");
    files
        .iter()
        .map(|file| {
            let rules = yaml(file);
            let keys = seq(&rules["descriptors"])
                .iter()
                .map(|it| str_at(it, &["key"]).to_owned())
                .collect();
            (str_at(&rules, &["domain"]).to_owned(), keys)
        })
        .collect()
}

/// The compose service `throttlegate`'s command, as a list of arguments.
fn throttlegate_command(compose: &Value) -> Vec<String> {
    seq(&compose["services"][REPLICAS[0]]["command"])
        .iter()
        .map(|it| it.as_str().expect("string arguments").to_owned())
        .collect()
}

/// The value following `flag` in `args`.
fn flag_value<'a>(args: &'a [String], flag: &str) -> Option<&'a str> {
    args.iter()
        .position(|it| it == flag)
        .map(|at| args.get(at + 1).expect("a value after the flag").as_str())
}

fn serve_help() -> String {
    let out = command()
        .args(["serve", "--help"])
        .output()
        .expect("run serve --help");
    assert!(out.status.success(), "{out:?}");
    String::from_utf8(out.stdout).expect("utf-8 help")
}

/// The port of `--grpc-addr` in compose, else the binary's default.
fn compose_grpc_port(compose: &Value) -> u16 {
    let args = throttlegate_command(compose);
    let addr = match flag_value(&args, "--grpc-addr") {
        Some(addr) => addr.to_owned(),
        None => {
            let help = serve_help();
            let at = help.find("--grpc-addr").expect("--grpc-addr in help");
            let default = &help[at..];
            let start = default.find("[default: ").expect("a default") + "[default: ".len();
            let end = start + default[start..].find(']').unwrap();
            default[start..end].to_owned()
        }
    };
    addr.rsplit(':').next().unwrap().parse().expect("a port")
}

/// The container side of every `ports` entry of a compose service.
fn published_ports(compose: &Value, service: &str) -> Vec<u16> {
    seq(&compose["services"][service]["ports"])
        .iter()
        .map(|it| {
            let text = it.as_str().expect("ports as \"host:container\"");
            text.rsplit(':').next().unwrap().parse().expect("a port")
        })
        .collect()
}

/// A compose volume `source:target[:mode]`: the source, resolved against
/// deploy/, and the target.
fn volumes(compose: &Value, service: &str) -> Vec<(PathBuf, String)> {
    seq(&compose["services"][service]["volumes"])
        .iter()
        .map(|it| {
            let mut parts = it.as_str().expect("short volume syntax").split(':');
            let source = parts.next().unwrap();
            let target = parts.next().expect("a target").to_owned();
            (deploy(source), target)
        })
        .collect()
}

fn squeeze(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// The `cargo build ...` command of the Dockerfile's RUN instruction,
/// line continuations joined.
fn dockerfile_build_command(dockerfile: &str) -> String {
    let joined = dockerfile.replace("\\\n", " ");
    let line = joined
        .lines()
        .find(|it| it.starts_with("RUN ") && it.contains("cargo build"))
        .expect("a RUN cargo build in the Dockerfile");
    let command = &line[line.find("cargo build").unwrap()..];
    squeeze(command.split("&&").next().unwrap())
}

#[test]
fn envoy_yaml_has_the_ratelimit_filter_for_the_rules_domain() {
    let envoy = envoy();
    let filter = ratelimit_filter(&envoy);
    assert_eq!(str_at(filter, &["@type"]), RATELIMIT_TYPE);
    let domain = str_at(filter, &["domain"]);
    let domains: Vec<String> = rules().into_iter().map(|(domain, _)| domain).collect();
    assert!(
        domains.iter().any(|it| it == domain),
        "filter domain {domain} has no rules file in deploy/config ({domains:?})"
    );
    assert_eq!(
        str_at(
            filter,
            &[
                "rate_limit_service",
                "grpc_service",
                "envoy_grpc",
                "cluster_name"
            ]
        ),
        "throttlegate"
    );
    assert_eq!(
        str_at(filter, &["rate_limit_service", "transport_api_version"]),
        "V3"
    );
    assert_eq!(str_at(filter, &["timeout"]), "0.020s");
    assert!(
        filter["failure_mode_deny"].as_bool().is_some(),
        "failure_mode_deny set explicitly"
    );
    assert_eq!(
        str_at(filter, &["enable_x_ratelimit_headers"]),
        "DRAFT_VERSION_03"
    );
    // The router must come after the rate-limit filter, and last.
    for hcm in connection_managers(&envoy) {
        let names: Vec<&str> = seq(&hcm["http_filters"])
            .iter()
            .map(|it| str_at(it, &["name"]))
            .collect();
        assert_eq!(
            names.last(),
            Some(&"envoy.filters.http.router"),
            "{names:?}"
        );
    }
}

#[test]
fn throttlegate_cluster_is_http2_on_the_grpc_port_compose_serves() {
    let envoy = envoy();
    let compose = compose();
    let cluster = cluster(&envoy, "throttlegate");
    assert_eq!(str_at(cluster, &["type"]), "STRICT_DNS");
    let options = &cluster["typed_extension_protocol_options"][HTTP_OPTIONS];
    assert_eq!(
        str_at(options, &["@type"]),
        format!("type.googleapis.com/{HTTP_OPTIONS}")
    );
    assert!(
        options["explicit_http_config"]["http2_protocol_options"].is_mapping(),
        "HTTP/2 to throttlegate: {options:?}"
    );
    let endpoints = seq(&cluster["load_assignment"]["endpoints"]);
    let lb = seq(&endpoints[0]["lb_endpoints"]);
    let grpc = compose_grpc_port(&compose);
    assert_eq!(grpc, 8081, "the documented gRPC port");
    let names: Vec<&str> = lb
        .iter()
        .map(|it| {
            let address = &it["endpoint"]["address"]["socket_address"];
            let port = address["port_value"].as_u64().expect("port_value") as u16;
            assert_eq!(
                port, grpc,
                "envoy's cluster port vs throttlegate's gRPC port"
            );
            str_at(address, &["address"])
        })
        .collect();
    assert_eq!(names, REPLICAS, "one endpoint per compose replica");
    for replica in REPLICAS {
        assert!(compose["services"][replica].is_mapping(), "{replica}");
        assert!(published_ports(&compose, replica).contains(&grpc));
        assert_eq!(
            seq(&compose["services"][replica]["command"]),
            seq(&compose["services"][REPLICAS[0]]["command"]),
            "the replicas run alike"
        );
        assert!(compose["services"][replica]["depends_on"]["redis"].is_mapping());
    }
    // Envoy's active health check asks a service name throttlegate answers.
    for check in seq(&cluster["health_checks"]) {
        let service = check["grpc_health_check"]["service_name"]
            .as_str()
            .unwrap_or("");
        assert!(HEALTH_SERVICES.contains(&service), "{service}");
    }
    // The listener the README's curl loop calls.
    let listener = &seq(&envoy["static_resources"]["listeners"])[0];
    assert_eq!(
        listener["address"]["socket_address"]["port_value"].as_u64(),
        Some(10000)
    );
    assert!(published_ports(&compose, "envoy").contains(&10000));
}

#[test]
fn every_descriptor_key_the_route_actions_produce_has_a_rule() {
    let envoy = envoy();
    let domain = str_at(ratelimit_filter(&envoy), &["domain"]).to_owned();
    let keys: BTreeSet<String> = rules()
        .into_iter()
        .filter(|(it, _)| *it == domain)
        .flat_map(|(_, keys)| keys)
        .collect();
    let produced: Vec<String> = route_rate_limits(&envoy)
        .into_iter()
        .flat_map(|actions| seq(actions).iter().map(action_key))
        .collect();
    for key in ["remote_address", "api_key", "path"] {
        assert!(produced.iter().any(|it| it == key), "{key} in {produced:?}");
    }
    for key in &produced {
        assert!(
            keys.contains(key),
            "no rule for {key} in domain {domain}: {keys:?}"
        );
    }
}

#[test]
fn check_config_accepts_deploy_config() {
    let out = command()
        .arg("check-config")
        .arg(deploy("config"))
        .output()
        .expect("run check-config");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    let domain = str_at(ratelimit_filter(&envoy()), &["domain"]).to_owned();
    assert!(stdout.contains(&format!("domain {domain}")), "{stdout}");
}

/// The descriptors Envoy sends for `GET path` from `client`, without an
/// API key: one per rate_limits entry whose actions all produced a value,
/// and a fixed [path=/expensive] on the route for paths under /expensive.
fn envoy_descriptors(client: &str, path: &str) -> Vec<RateLimitDescriptor> {
    let mut descriptors = vec![descriptor(&[("remote_address", client)])];
    if path == "/expensive" || path.starts_with("/expensive/") {
        descriptors.push(descriptor(&[("path", "/expensive")]));
    }
    descriptors
}

#[tokio::test]
async fn the_served_rules_allow_five_requests_from_an_address_then_deny() {
    let domain = str_at(ratelimit_filter(&envoy()), &["domain"]).to_owned();
    let mut service = Serve::config(deploy("config")).spawn();
    let mut client = service.client().await;
    let mut codes = Vec::new();
    for _ in 0..8 {
        let answer = client
            .should_rate_limit(request(&domain, envoy_descriptors("172.18.0.1", "/")))
            .await
            .expect("a decision")
            .into_inner();
        codes.push(answer.overall_code);
    }
    let ok = Code::Ok as i32;
    let over = Code::OverLimit as i32;
    assert_eq!(codes, vec![ok, ok, ok, ok, ok, over, over, over]);

    // Another address has its own five.
    let answer = client
        .should_rate_limit(request(&domain, envoy_descriptors("172.18.0.2", "/")))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(answer.overall_code, ok);

    // The expensive path is shared by every address: two in total.
    let mut codes = Vec::new();
    for (i, path) in ["/expensive", "/expensive/a", "/expensive/b"]
        .into_iter()
        .enumerate()
    {
        let answer = client
            .should_rate_limit(request(
                &domain,
                envoy_descriptors(&format!("10.1.0.{i}"), path),
            ))
            .await
            .unwrap()
            .into_inner();
        codes.push(answer.overall_code);
    }
    assert_eq!(codes, vec![ok, ok, over]);

    // With an API key, its descriptor is sent too and counted per key.
    let with_key = |address: &str| {
        let mut descriptors = envoy_descriptors(address, "/");
        descriptors.push(descriptor(&[("api_key", "premium-key")]));
        request(&domain, descriptors)
    };
    let answer = client
        .should_rate_limit(with_key("10.2.0.1"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(answer.overall_code, ok);
    let api_key_status = &answer.statuses[1];
    assert_eq!(
        api_key_status
            .current_limit
            .as_ref()
            .map(|it| it.requests_per_unit),
        Some(1000)
    );
}

#[test]
fn compose_flags_are_flags_of_serve() {
    let compose = compose();
    let args = throttlegate_command(&compose);
    assert_eq!(args.first().map(String::as_str), Some("serve"));
    let help = serve_help();
    let flags: Vec<&String> = args.iter().filter(|it| it.starts_with("--")).collect();
    assert!(!flags.is_empty());
    for flag in flags {
        let name = flag.split('=').next().unwrap();
        assert!(
            help.contains(&format!("{name} ")) || help.contains(&format!("{name}\n")),
            "{name} is not a flag of serve:\n{help}"
        );
    }
    assert_eq!(flag_value(&args, "--redis-url"), Some("redis://redis:6379"));
    assert!(compose["services"]["redis"].is_mapping());

    // --config is the mount of deploy/config.
    let config = flag_value(&args, "--config").expect("--config");
    let mounted = volumes(&compose, REPLICAS[0]);
    assert!(
        mounted
            .iter()
            .any(|(source, target)| target == config && *source == deploy("./config")),
        "{mounted:?}"
    );
    assert!(deploy("config").is_dir());

    // Envoy's mount is envoy.yaml at the image's default config path.
    let mounted = volumes(&compose, "envoy");
    assert!(
        mounted
            .iter()
            .any(|(source, target)| target == "/etc/envoy/envoy.yaml"
                && source.canonicalize().ok() == deploy("envoy/envoy.yaml").canonicalize().ok()),
        "{mounted:?}"
    );
    assert!(str_at(&compose, &["services", "envoy", "image"]).starts_with("envoyproxy/envoy:"));

    // The build is deploy/Dockerfile from the repository root.
    let build = &compose["services"][REPLICAS[0]]["build"];
    let context = deploy(str_at(build, &["context"]));
    let dockerfile = context.join(str_at(build, &["dockerfile"]));
    assert_eq!(
        dockerfile.canonicalize().unwrap(),
        deploy("Dockerfile").canonicalize().unwrap()
    );
    assert_eq!(
        context.canonicalize().unwrap(),
        root().canonicalize().unwrap()
    );

    // Every service has a health check.
    for (name, service) in compose["services"].as_mapping().unwrap() {
        assert!(
            service["healthcheck"]["test"].is_sequence(),
            "no healthcheck for {name:?}"
        );
    }
}

#[tokio::test]
async fn the_health_checks_ask_an_endpoint_the_service_answers() {
    let compose = compose();
    let dockerfile = read(&deploy("Dockerfile"));
    let test: Vec<&str> = seq(&compose["services"][REPLICAS[0]]["healthcheck"]["test"])
        .iter()
        .map(|it| it.as_str().unwrap())
        .collect();
    let url = test
        .iter()
        .find(|it| it.starts_with("http://"))
        .expect("an URL in the compose health check");
    let http_port = flag_value(&throttlegate_command(&compose), "--http-addr")
        .map(|it| it.rsplit(':').next().unwrap().to_owned())
        .unwrap_or_else(|| "8080".to_owned());
    let prefix = format!("http://127.0.0.1:{http_port}");
    let path = url.strip_prefix(&prefix).expect("the HTTP port");
    assert_eq!(path, "/healthcheck");
    let healthcheck = dockerfile
        .lines()
        .skip_while(|it| !it.starts_with("HEALTHCHECK"))
        .take(2)
        .collect::<String>();
    assert!(
        healthcheck.contains(&format!("{prefix}{path}")),
        "{healthcheck}"
    );

    let mut service = Serve::config(deploy("config")).spawn();
    service.connect().await;
    let response = http_get(service.http, path).await;
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
}

#[test]
fn dockerfile_builds_as_the_docs_say_and_runs_as_non_root() {
    let dockerfile = read(&deploy("Dockerfile"));
    let docs = squeeze(&read(&root().join("docs/operations.md")));
    let build = dockerfile_build_command(&dockerfile);
    assert_eq!(build, "cargo build --release --locked --bin throttlegate");
    assert!(
        docs.contains(&format!("`{build}`")),
        "docs/operations.md lacks `{build}`"
    );

    let instructions: Vec<&str> = dockerfile
        .lines()
        .filter(|it| !it.starts_with('#') && !it.starts_with(' '))
        .collect();
    let user = instructions
        .iter()
        .rev()
        .find_map(|it| it.strip_prefix("USER "))
        .expect("USER");
    let user = user.split(':').next().unwrap().trim();
    assert!(user != "root" && user != "0", "USER {user}");
    assert!(instructions.iter().any(|it| it.starts_with("HEALTHCHECK ")));
    let exposed: Vec<&str> = instructions
        .iter()
        .filter_map(|it| it.strip_prefix("EXPOSE "))
        .flat_map(str::split_whitespace)
        .collect();
    assert!(exposed.contains(&"8081"), "{exposed:?}");
    assert!(exposed.contains(&"8080"), "{exposed:?}");
    // The default command serves the directory compose mounts rules on.
    let cmd = instructions
        .iter()
        .find_map(|it| it.strip_prefix("CMD "))
        .expect("CMD");
    let cmd: Vec<String> = serde_json::from_str(cmd).expect("CMD in exec form");
    assert_eq!(
        flag_value(&cmd, "--config"),
        flag_value(&throttlegate_command(&compose()), "--config")
    );
    // The binary copied is the one the release build makes.
    assert!(
        dockerfile.contains("/target/release/throttlegate "),
        "copies target/release/throttlegate"
    );
}

/// The value of `name=value` in deploy/throttlegate.env.
fn env_file_value(name: &str) -> u64 {
    let text = read(&deploy("throttlegate.env"));
    text.lines()
        .filter(|line| !line.starts_with('#'))
        .find_map(|line| line.strip_prefix(&format!("{name}=")))
        .unwrap_or_else(|| panic!("no {name} in deploy/throttlegate.env"))
        .trim()
        .parse()
        .expect("a number")
}

/// Seconds of an Envoy duration (`"2s"`, `"0.5s"`).
fn seconds(value: &Value) -> f64 {
    let text = value
        .as_str()
        .unwrap_or_else(|| panic!("a duration: {value:?}"));
    text.strip_suffix('s')
        .and_then(|it| it.parse().ok())
        .unwrap_or_else(|| panic!("a duration in seconds: {text}"))
}

#[test]
fn replicas_answer_longer_after_sigterm_than_envoy_takes_to_see_it() {
    let envoy = envoy();
    let compose = compose();
    let delay_ms = env_file_value("THROTTLEGATE_SHUTDOWN_DELAY_MS");
    let drain_ms = env_file_value("THROTTLEGATE_DRAIN_TIMEOUT_MS");
    let cluster = cluster(&envoy, "throttlegate");
    let checks = seq(&cluster["health_checks"]);
    assert_eq!(checks.len(), 1);
    let check = &checks[0];
    let interval = seconds(&check["interval"]);
    let timeout = seconds(&check["timeout"]);
    // Envoy stops calling a replica at its first NOT_SERVING answer, at
    // most one interval plus one timeout after it turned NOT_SERVING.
    let seen_within_ms = (interval + timeout) * 1000.0;
    assert!(
        (delay_ms as f64) > seen_within_ms + 1000.0,
        "shutdown delay {delay_ms} ms vs interval {interval} s + timeout {timeout} s"
    );
    // A fresh cluster is checked as often, not once a minute.
    let no_traffic = seconds(&check["no_traffic_interval"]);
    assert!(no_traffic <= interval, "no_traffic_interval {no_traffic} s");
    // Never the stopping replica when the other is unhealthy too.
    assert_eq!(
        cluster["common_lb_config"]["healthy_panic_threshold"]["value"].as_f64(),
        Some(0.0)
    );
    // Both replicas read the delay from the file (the binary reads
    // THROTTLEGATE_* variables), and Docker waits for delay and drain.
    let help = serve_help();
    for name in [
        "THROTTLEGATE_SHUTDOWN_DELAY_MS",
        "THROTTLEGATE_DRAIN_TIMEOUT_MS",
    ] {
        assert!(help.contains(&format!("[env: {name}=")), "{name}");
    }
    for replica in REPLICAS {
        let service = &compose["services"][replica];
        let env_files: Vec<PathBuf> = seq(&service["env_file"])
            .iter()
            .map(|it| deploy(it.as_str().expect("a path")))
            .collect();
        assert_eq!(env_files, [deploy("throttlegate.env")], "{replica}");
        let args = throttlegate_command(&compose);
        assert!(flag_value(&args, "--shutdown-delay-ms").is_none());
        let grace = str_at(service, &["stop_grace_period"]);
        let grace: u64 = grace.strip_suffix('s').unwrap().parse().unwrap();
        assert!(grace * 1000 > delay_ms + drain_ms, "{replica}: {grace} s");
    }
    // The script runs the replicas with the same file.
    let script = read(&deploy("local/run.sh"));
    assert!(
        script.contains("\"$deploy/throttlegate.env\""),
        "run.sh sources it"
    );
}

#[test]
fn paths_are_normalized_and_matched_whatever_their_case() {
    let envoy = envoy();
    for hcm in connection_managers(&envoy) {
        assert_eq!(hcm["normalize_path"].as_bool(), Some(true));
        assert_eq!(hcm["merge_slashes"].as_bool(), Some(true));
        assert_eq!(
            hcm["path_with_escaped_slashes_action"].as_str(),
            Some("UNESCAPE_AND_FORWARD")
        );
        for host in seq(&hcm["route_config"]["virtual_hosts"]) {
            for route in seq(&host["routes"]) {
                let matcher = &route["match"];
                if matcher["prefix"].as_str() == Some("/") {
                    continue;
                }
                assert_eq!(
                    matcher["case_sensitive"].as_bool(),
                    Some(false),
                    "{matcher:?}"
                );
            }
        }
    }
}

#[test]
fn hits_addend_is_only_where_envoy_sends_it_and_its_route_demands_a_number() {
    let envoy = envoy();
    let mut costed = 0;
    for hcm in connection_managers(&envoy) {
        for host in seq(&hcm["route_config"]["virtual_hosts"]) {
            for route in seq(&host["routes"]) {
                // Envoy drops hits_addend on a route's own rate_limits.
                if let Some(limits) = route["route"]["rate_limits"].as_sequence() {
                    for limit in limits {
                        assert!(limit["hits_addend"].is_null(), "{limit:?}");
                    }
                }
                let per_route = &route["typed_per_filter_config"][RATELIMIT_FILTER];
                let Some(limits) = per_route["rate_limits"].as_sequence() else {
                    continue;
                };
                assert_eq!(
                    str_at(per_route, &["@type"]),
                    "type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimitPerRoute"
                );
                for limit in limits {
                    let Some(format) = limit["hits_addend"]["format"].as_str() else {
                        continue;
                    };
                    costed += 1;
                    // A format that gives no number makes Envoy skip the
                    // call: the route only matches when the header is one.
                    let header = format
                        .strip_prefix("%REQ(")
                        .and_then(|it| it.strip_suffix(")%"))
                        .expect("a request header");
                    let demanded = seq(&route["match"]["headers"]).iter().any(|it| {
                        it["name"].as_str() == Some(header)
                            && it["string_match"]["safe_regex"]["regex"]
                                .as_str()
                                .is_some_and(|re| re.starts_with('^') && re.ends_with('$'))
                    });
                    assert!(demanded, "{header} not required to be a number: {route:?}");
                }
            }
        }
    }
    assert!(costed > 0, "no rule with a cost");
}

#[test]
fn compose_runs_the_envoy_version_the_suite_tests() {
    assert_eq!(
        str_at(&compose(), &["services", "envoy", "image"]),
        "envoyproxy/envoy:v1.40.0"
    );
}

/// The descriptors (as key chains: `route.remote_address`) the actions of
/// envoy.yaml can send.
fn produced_chains(envoy: &Value) -> BTreeSet<String> {
    route_rate_limits(envoy)
        .into_iter()
        .map(|actions| {
            seq(actions)
                .iter()
                .map(action_key)
                .collect::<Vec<_>>()
                .join(".")
        })
        .collect()
}

/// The key chains of a rules file's descriptors, every level.
fn rule_chains(rules: &Value) -> BTreeSet<String> {
    fn walk(nodes: &Value, prefix: &str, out: &mut BTreeSet<String>) {
        for node in nodes.as_sequence().map(Vec::as_slice).unwrap_or_default() {
            let chain = format!("{prefix}{}", str_at(node, &["key"]));
            if node.get("rate_limit").is_some() {
                out.insert(chain.clone());
            }
            walk(&node["descriptors"], &format!("{chain}."), out);
        }
    }
    let mut out = BTreeSet::new();
    walk(&rules["descriptors"], "", &mut out);
    out
}

#[test]
fn every_rule_set_limits_exactly_the_descriptors_envoy_sends() {
    let envoy = envoy();
    let domain = str_at(ratelimit_filter(&envoy), &["domain"]);
    let produced = produced_chains(&envoy);
    let mut sets = vec![(
        "deploy/config/edge.yaml".to_owned(),
        yaml(&deploy("config/edge.yaml")),
    )];
    let manifests: Vec<Value> =
        serde_yaml_ng::Deserializer::from_str(&read(&deploy("kubernetes/throttlegate.yaml")))
            .map(|doc| serde::Deserialize::deserialize(doc).expect("a YAML document"))
            .collect();
    let map = manifests
        .iter()
        .find(|doc| doc["kind"].as_str() == Some("ConfigMap"))
        .expect("the rules ConfigMap");
    for (name, text) in map["data"].as_mapping().expect("data") {
        let rules = serde_yaml_ng::from_str(text.as_str().unwrap()).expect("rules YAML");
        sets.push((format!("ConfigMap {}", name.as_str().unwrap()), rules));
    }
    for (name, rules) in sets {
        assert_eq!(str_at(&rules, &["domain"]), domain, "{name}");
        assert_eq!(
            rule_chains(&rules),
            produced,
            "{name}: rules vs what Envoy sends"
        );
    }
}
