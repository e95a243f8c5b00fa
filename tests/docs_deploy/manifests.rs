//! The deployment files under `deploy/` agree with the binary: every
//! Kubernetes document parses, the container's flags are the binary's, the
//! probes, container ports, Service and scrape config name the same ports,
//! the grace period covers the shutdown, the ConfigMap's rules load, and
//! every metric and label the dashboard and alerts query is one the running
//! service exposes.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::Deserialize;
use serde_yaml_ng::Value;

use crate::support::process::{Serve, command, http_get};
use crate::support::request::{descriptor, request};
use crate::support::tools::Tool;

fn deploy(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("deploy")
        .join(path)
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|err| panic!("{}: {err}", path.display()))
}

/// Every document of a multi-document YAML file.
fn documents(path: &Path) -> Vec<Value> {
    serde_yaml_ng::Deserializer::from_str(&read(path))
        .map(|doc| {
            Value::deserialize(doc).unwrap_or_else(|err| panic!("{}: {err}", path.display()))
        })
        .collect()
}

fn yaml(path: &Path) -> Value {
    serde_yaml_ng::from_str(&read(path)).unwrap_or_else(|err| panic!("{}: {err}", path.display()))
}

fn str_at<'a>(value: &'a Value, path: &[&str]) -> &'a str {
    at(value, path)
        .as_str()
        .unwrap_or_else(|| panic!("{path:?} is not a string: {value:?}"))
}

fn at<'a>(value: &'a Value, path: &[&str]) -> &'a Value {
    path.iter().fold(value, |value, key| {
        value
            .get(key)
            .unwrap_or_else(|| panic!("no {key:?} (of {path:?}) in {value:?}"))
    })
}

fn int(value: &Value) -> u64 {
    value
        .as_u64()
        .unwrap_or_else(|| panic!("not a number: {value:?}"))
}

/// The documents of `deploy/kubernetes/<file>`.
fn manifests(file: &str) -> Vec<Value> {
    documents(&deploy(&format!("kubernetes/{file}")))
}

/// The one document of `kind` named `name` in `docs`.
fn find<'a>(docs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    let found: Vec<&Value> = docs
        .iter()
        .filter(|doc| doc.get("kind").and_then(Value::as_str) == Some(kind))
        .filter(|doc| str_at(doc, &["metadata", "name"]) == name)
        .collect();
    assert_eq!(found.len(), 1, "one {kind} {name}");
    found[0]
}

fn throttlegate_docs() -> Vec<Value> {
    manifests("throttlegate.yaml")
}

/// The throttlegate container of the Deployment.
fn container(docs: &[Value]) -> &Value {
    let deployment = find(docs, "Deployment", "throttlegate");
    let containers = at(deployment, &["spec", "template", "spec", "containers"])
        .as_sequence()
        .expect("containers");
    containers
        .iter()
        .find(|it| str_at(it, &["name"]) == "throttlegate")
        .expect("a container named throttlegate")
}

fn args(container: &Value) -> Vec<String> {
    at(container, &["args"])
        .as_sequence()
        .expect("args")
        .iter()
        .map(|arg| arg.as_str().expect("args are strings").to_owned())
        .collect()
}

/// The value following `flag` in `args` (or given as `flag=value`).
fn arg_value<'a>(args: &'a [String], flag: &str) -> &'a str {
    args.iter()
        .enumerate()
        .find_map(|(i, arg)| {
            if arg == flag {
                args.get(i + 1).map(String::as_str)
            } else {
                arg.strip_prefix(flag)?.strip_prefix('=')
            }
        })
        .unwrap_or_else(|| panic!("no {flag} in {args:?}"))
}

/// The container's ports by name.
fn container_ports(container: &Value) -> BTreeMap<String, u64> {
    at(container, &["ports"])
        .as_sequence()
        .expect("ports")
        .iter()
        .map(|port| {
            (
                str_at(port, &["name"]).to_owned(),
                int(at(port, &["containerPort"])),
            )
        })
        .collect()
}

/// `throttlegate serve --help`.
fn serve_help() -> String {
    let output = command()
        .args(["serve", "--help"])
        .output()
        .expect("run serve --help");
    assert!(output.status.success(), "{output:?}");
    String::from_utf8(output.stdout).expect("utf-8 help")
}

/// The long flags `--help` lists.
fn help_flags(help: &str) -> BTreeSet<String> {
    help.lines()
        .flat_map(|line| line.split([' ', ',']))
        .filter(|word| word.starts_with("--") && word.len() > 2)
        .map(str::to_owned)
        .collect()
}

/// The default `--help` gives for `flag`, from `[default: ...]`.
fn help_default(help: &str, flag: &str) -> String {
    let start = help
        .find(&format!("{flag} <"))
        .unwrap_or_else(|| panic!("{flag} in --help"));
    let rest = &help[start..];
    let default = rest.find("[default: ").expect("a default") + "[default: ".len();
    let end = rest[default..].find(']').expect("]");
    rest[default..default + end].to_owned()
}

/// The port of a listen address (`0.0.0.0:8081`) or URL (`redis://redis:6379`).
fn port_of(addr: &str) -> u64 {
    let tail = addr.rsplit(':').next().expect("port");
    tail.trim_end_matches(|c: char| !c.is_ascii_digit())
        .parse()
        .unwrap_or_else(|_| panic!("no port in {addr}"))
}

#[test]
fn every_kubernetes_document_parses_with_api_version_and_kind() {
    let dir = deploy("kubernetes");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("deploy/kubernetes")
        .map(|entry| entry.expect("entry").path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "yaml"))
        .collect();
    files.sort();
    let names: Vec<String> = files
        .iter()
        .map(|path| path.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, ["redis.yaml", "throttlegate.yaml"]);

    let mut kinds = BTreeMap::new();
    for file in &files {
        let docs = documents(file);
        assert!(!docs.is_empty(), "{}", file.display());
        for doc in &docs {
            let api = str_at(doc, &["apiVersion"]);
            let kind = str_at(doc, &["kind"]);
            let name = str_at(doc, &["metadata", "name"]);
            assert!(
                !name.is_empty(),
                "{}: {kind} without a name",
                file.display()
            );
            kinds.insert(format!("{kind} {name}"), api.to_owned());
        }
    }
    // Current API versions only (policy/v1beta1 and autoscaling/v2beta2 are gone).
    let expected: BTreeMap<String, String> = [
        ("ConfigMap throttlegate-config", "v1"),
        ("Deployment throttlegate", "apps/v1"),
        ("Service throttlegate", "v1"),
        ("Service throttlegate-pods", "v1"),
        ("PodDisruptionBudget throttlegate", "policy/v1"),
        ("HorizontalPodAutoscaler throttlegate", "autoscaling/v2"),
        ("Deployment redis", "apps/v1"),
        ("Service redis", "v1"),
    ]
    .into_iter()
    .map(|(kind, api)| (kind.to_owned(), api.to_owned()))
    .collect();
    assert_eq!(kinds, expected);

    // The selectors pick the Deployment's pods.
    let docs = throttlegate_docs();
    let pod_labels = at(
        find(&docs, "Deployment", "throttlegate"),
        &["spec", "template", "metadata", "labels"],
    );
    for selector in [
        at(
            find(&docs, "Deployment", "throttlegate"),
            &["spec", "selector", "matchLabels"],
        ),
        at(
            find(&docs, "Service", "throttlegate"),
            &["spec", "selector"],
        ),
        at(
            find(&docs, "Service", "throttlegate-pods"),
            &["spec", "selector"],
        ),
        at(
            find(&docs, "PodDisruptionBudget", "throttlegate"),
            &["spec", "selector", "matchLabels"],
        ),
    ] {
        for (key, value) in selector.as_mapping().expect("labels") {
            assert_eq!(
                pod_labels.get(key),
                Some(value),
                "{key:?} in {pod_labels:?}"
            );
        }
    }
    let target = at(
        find(&docs, "HorizontalPodAutoscaler", "throttlegate"),
        &["spec", "scaleTargetRef"],
    );
    assert_eq!(str_at(target, &["kind"]), "Deployment");
    assert_eq!(str_at(target, &["name"]), "throttlegate");
}

#[test]
fn container_flags_and_environment_are_the_binarys() {
    let help = serve_help();
    let flags = help_flags(&help);
    assert!(flags.contains("--shutdown-delay-ms"), "{flags:?}");
    let docs = throttlegate_docs();
    let container = container(&docs);
    let args = args(container);
    assert_eq!(args[0], "serve", "{args:?}");
    let used: Vec<&str> = args
        .iter()
        .filter(|arg| arg.starts_with("--"))
        .map(|arg| arg.split('=').next().unwrap())
        .collect();
    assert!(used.len() >= 4, "{used:?}");
    for flag in used {
        assert!(
            flags.contains(flag),
            "{flag} is not a flag of serve: {flags:?}"
        );
    }
    for env in at(container, &["env"]).as_sequence().expect("env") {
        let name = str_at(env, &["name"]);
        if name.starts_with("THROTTLEGATE_") {
            assert!(
                help.contains(&format!("[env: {name}=")),
                "{name} is not read by serve"
            );
        }
    }
    // Every value is accepted too: the process gets past flag parsing to
    // loading the config, here from a path that does not exist (exit 2
    // naming it), so it never reaches Redis or binds a port.
    let dir = tempfile::tempdir().expect("temporary directory");
    let missing = dir.path().join("missing").to_string_lossy().into_owned();
    let mut run = args.clone();
    let config = run
        .iter()
        .position(|arg| arg == "--config")
        .expect("--config")
        + 1;
    run[config] = missing.clone();
    let output = command()
        .args(&run)
        .env("THROTTLEGATE_GRPC_ADDR", "127.0.0.1:0")
        .env("THROTTLEGATE_HTTP_ADDR", "127.0.0.1:0")
        .output()
        .expect("run serve");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains(&format!("{missing}: error reading config")),
        "{stderr}"
    );
    // What clap says when it refuses a flag or a value.
    assert!(
        !stderr.contains("For more information, try '--help'"),
        "a flag was refused: {stderr}"
    );
}

#[test]
fn the_config_directory_is_the_configmap_mounted_whole() {
    let docs = throttlegate_docs();
    let deployment = find(&docs, "Deployment", "throttlegate");
    let container = container(&docs);
    let config = arg_value(&args(container), "--config").to_owned();
    let mount = at(container, &["volumeMounts"])
        .as_sequence()
        .expect("volumeMounts")
        .iter()
        .find(|mount| str_at(mount, &["mountPath"]) == config)
        .unwrap_or_else(|| panic!("nothing mounted at {config}"));
    // A subPath mount never sees ConfigMap updates.
    assert!(mount.get("subPath").is_none(), "{mount:?}");
    let volume_name = str_at(mount, &["name"]);
    let volume = at(deployment, &["spec", "template", "spec", "volumes"])
        .as_sequence()
        .expect("volumes")
        .iter()
        .find(|volume| str_at(volume, &["name"]) == volume_name)
        .expect("the mounted volume");
    let map = str_at(volume, &["configMap", "name"]);
    find(&docs, "ConfigMap", map);

    // The pod runs as non-root on a read-only root filesystem.
    let pod = at(deployment, &["spec", "template", "spec", "securityContext"]);
    assert_eq!(at(pod, &["runAsNonRoot"]).as_bool(), Some(true));
    assert_ne!(int(at(pod, &["runAsUser"])), 0);
    let own = at(container, &["securityContext"]);
    assert_eq!(at(own, &["readOnlyRootFilesystem"]).as_bool(), Some(true));
    assert_eq!(
        at(own, &["allowPrivilegeEscalation"]).as_bool(),
        Some(false)
    );
}

#[test]
fn probes_service_and_scrape_config_use_the_listening_ports() {
    let help = serve_help();
    let grpc = port_of(&help_default(&help, "--grpc-addr"));
    let http = port_of(&help_default(&help, "--http-addr"));
    assert_eq!((grpc, http), (8081, 8080));

    let docs = throttlegate_docs();
    let container = container(&docs);
    let args = args(container);
    assert!(!args.iter().any(|arg| arg.starts_with("--grpc-addr")));
    assert!(!args.iter().any(|arg| arg.starts_with("--http-addr")));
    let ports = container_ports(container);
    let expected: BTreeMap<String, u64> = [("grpc".to_owned(), grpc), ("http".to_owned(), http)]
        .into_iter()
        .collect();
    assert_eq!(ports, expected);

    for probe in ["readinessProbe", "livenessProbe"] {
        let probe = at(container, &[probe]);
        assert_eq!(int(at(probe, &["grpc", "port"])), grpc, "{probe:?}");
        // A name the server's health service answers for.
        assert_eq!(str_at(probe, &["grpc", "service"]), "ratelimit");
    }

    let service = find(&docs, "Service", "throttlegate");
    let service_ports = at(service, &["spec", "ports"]).as_sequence().unwrap();
    assert_eq!(service_ports.len(), 2);
    for port in service_ports {
        let name = str_at(port, &["name"]);
        let target = match at(port, &["targetPort"]) {
            Value::String(named) => ports[named.as_str()],
            number => int(number),
        };
        assert_eq!(target, ports[name], "{port:?}");
        assert_eq!(int(at(port, &["port"])), ports[name], "{port:?}");
    }
    let grpc_port = service_ports
        .iter()
        .find(|port| str_at(port, &["name"]) == "grpc")
        .unwrap();
    assert_eq!(str_at(grpc_port, &["appProtocol"]), "grpc");

    // The HPA scales on CPU, which needs a CPU request.
    let hpa = find(&docs, "HorizontalPodAutoscaler", "throttlegate");
    let metric = &at(hpa, &["spec", "metrics"]).as_sequence().unwrap()[0];
    assert_eq!(str_at(metric, &["resource", "name"]), "cpu");
    at(container, &["resources", "requests", "cpu"]);

    // Prometheus keeps the pods' port named `http`: the one serving /metrics.
    let prometheus = yaml(&deploy("prometheus/prometheus.yml"));
    let jobs = at(&prometheus, &["scrape_configs"]).as_sequence().unwrap();
    let pods = jobs
        .iter()
        .find(|job| job.get("kubernetes_sd_configs").is_some())
        .expect("a kubernetes_sd job");
    assert_eq!(str_at(pods, &["metrics_path"]), "/metrics");
    let relabel = at(pods, &["relabel_configs"]).as_sequence().unwrap();
    let keep = |source: &str| {
        relabel
            .iter()
            .find(|rule| {
                rule.get("action").and_then(Value::as_str) == Some("keep")
                    && at(rule, &["source_labels"])[0].as_str() == Some(source)
            })
            .map(|rule| str_at(rule, &["regex"]).to_owned())
            .unwrap_or_else(|| panic!("no keep on {source}"))
    };
    assert_eq!(
        ports[&keep("__meta_kubernetes_pod_container_port_name")],
        http
    );
    let pod_labels = at(
        find(&docs, "Deployment", "throttlegate"),
        &["spec", "template", "metadata", "labels"],
    );
    assert_eq!(
        pod_labels
            .get("app.kubernetes.io/name")
            .and_then(Value::as_str),
        Some(keep("__meta_kubernetes_pod_label_app_kubernetes_io_name").as_str())
    );
    let statics = jobs
        .iter()
        .find(|job| job.get("static_configs").is_some())
        .expect("a static job");
    let target = str_at(&at(statics, &["static_configs"])[0]["targets"][0], &[]);
    assert_eq!(port_of(target), http);
}

#[test]
fn redis_url_names_the_redis_service() {
    let docs = throttlegate_docs();
    let url = arg_value(&args(container(&docs)), "--redis-url").to_owned();
    let host = url
        .strip_prefix("redis://")
        .and_then(|rest| rest.split(':').next())
        .expect("redis://host:port");
    let redis = manifests("redis.yaml");
    let service = find(&redis, "Service", host);
    let port = &at(service, &["spec", "ports"])[0];
    assert_eq!(int(at(port, &["port"])), port_of(&url));
    let deployment = find(&redis, "Deployment", "redis");
    let container = &at(deployment, &["spec", "template", "spec", "containers"])[0];
    assert_eq!(
        int(at(&at(container, &["ports"])[0], &["containerPort"])),
        int(at(port, &["targetPort"]))
    );
    for (key, value) in at(service, &["spec", "selector"]).as_mapping().unwrap() {
        assert_eq!(
            at(deployment, &["spec", "template", "metadata", "labels"]).get(key),
            Some(value)
        );
    }
}

#[test]
fn grace_period_outlasts_shutdown_delay_and_drain() {
    let docs = throttlegate_docs();
    let args = args(container(&docs));
    let delay: u64 = arg_value(&args, "--shutdown-delay-ms").parse().unwrap();
    let drain: u64 = arg_value(&args, "--drain-timeout-ms").parse().unwrap();
    // The values compose and deploy/local/run.sh use (deploy/throttlegate.env).
    let env = read(&deploy("throttlegate.env"));
    let env_value = |name: &str| -> u64 {
        env.lines()
            .find_map(|line| line.strip_prefix(&format!("{name}=")))
            .unwrap_or_else(|| panic!("{name} in throttlegate.env"))
            .parse()
            .unwrap()
    };
    assert_eq!(delay, env_value("THROTTLEGATE_SHUTDOWN_DELAY_MS"));
    assert_eq!(drain, env_value("THROTTLEGATE_DRAIN_TIMEOUT_MS"));
    // Envoy's health check (deploy/envoy/envoy.yaml) sees NOT_SERVING
    // within interval + timeout.
    let envoy = yaml(&deploy("envoy/envoy.yaml"));
    let clusters = at(&envoy, &["static_resources", "clusters"])
        .as_sequence()
        .unwrap();
    let cluster = clusters
        .iter()
        .find(|it| it["name"].as_str() == Some("throttlegate"))
        .expect("the throttlegate cluster");
    let check = &at(cluster, &["health_checks"])[0];
    let secs = |value: &Value| -> u64 {
        let text = value.as_str().expect("a duration");
        (text.trim_end_matches('s').parse::<f64>().unwrap() * 1000.0) as u64
    };
    let envoy_sees_within = secs(at(check, &["interval"])) + secs(at(check, &["timeout"]));
    assert!(
        envoy_sees_within + 1000 < delay,
        "{envoy_sees_within} ms of Envoy health checks against {delay} ms"
    );
    // The headless Service Envoy should call is on the gRPC port.
    let headless = find(&docs, "Service", "throttlegate-pods");
    assert_eq!(str_at(headless, &["spec", "clusterIP"]), "None");
    let grace = int(at(
        find(&docs, "Deployment", "throttlegate"),
        &["spec", "template", "spec", "terminationGracePeriodSeconds"],
    ));
    assert!(
        grace * 1000 > delay + drain,
        "terminationGracePeriodSeconds {grace} s does not outlast {delay} + {drain} ms"
    );
    // The readiness probe sees NOT_SERVING well within the delay.
    let readiness = at(container(&docs), &["readinessProbe"]);
    let seen_within = int(at(readiness, &["periodSeconds"]))
        * readiness.get("failureThreshold").map_or(3, int)
        * 1000;
    assert!(
        seen_within < delay,
        "{seen_within} ms of probes against {delay} ms"
    );
}

/// The ConfigMap's files, written to a new directory.
fn configmap_dir() -> (tempfile::TempDir, BTreeMap<String, String>) {
    let docs = throttlegate_docs();
    let map = find(&docs, "ConfigMap", "throttlegate-config");
    let dir = tempfile::tempdir().expect("temporary directory");
    let mut files = BTreeMap::new();
    for (name, text) in at(map, &["data"]).as_mapping().expect("data") {
        let name = name.as_str().expect("file name");
        let text = text.as_str().expect("file text");
        // Only these are loaded from a config directory.
        assert!(
            name.ends_with(".yaml") || name.ends_with(".yml"),
            "{name} would not be loaded"
        );
        std::fs::write(dir.path().join(name), text).expect("write rules");
        files.insert(name.to_owned(), text.to_owned());
    }
    assert!(!files.is_empty());
    (dir, files)
}

#[test]
fn configmap_rules_pass_check_config() {
    let (dir, files) = configmap_dir();
    let output = command()
        .arg("check-config")
        .arg(dir.path())
        .output()
        .expect("run check-config");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    for text in files.values() {
        let domain = text
            .lines()
            .find_map(|line| line.strip_prefix("domain: "))
            .expect("a domain line");
        assert!(stdout.contains(&format!("domain {domain}")), "{stdout}");
    }
}

/// Every PromQL expression of the dashboard (panels, variables,
/// annotations).
fn dashboard_exprs() -> Vec<String> {
    fn walk(value: &serde_json::Value, out: &mut Vec<String>) {
        match value {
            serde_json::Value::Object(map) => {
                for (key, value) in map {
                    match (key.as_str(), value) {
                        ("expr" | "query" | "definition", serde_json::Value::String(text))
                            if text.contains("throttlegate_") =>
                        {
                            out.push(text.clone())
                        }
                        _ => walk(value, out),
                    }
                }
            }
            serde_json::Value::Array(items) => items.iter().for_each(|item| walk(item, out)),
            _ => {}
        }
    }
    let dashboard: serde_json::Value =
        serde_json::from_str(&read(&deploy("grafana/dashboard.json"))).expect("dashboard.json");
    let mut out = Vec::new();
    walk(&dashboard, &mut out);
    out
}

/// The alerting rules' expressions, by alert name.
fn alert_exprs() -> BTreeMap<String, String> {
    let alerts = yaml(&deploy("prometheus/alerts.yaml"));
    let mut out = BTreeMap::new();
    for group in at(&alerts, &["groups"]).as_sequence().expect("groups") {
        for rule in at(group, &["rules"]).as_sequence().expect("rules") {
            out.insert(
                str_at(rule, &["alert"]).to_owned(),
                str_at(rule, &["expr"]).to_owned(),
            );
        }
    }
    out
}

#[test]
fn dashboard_and_prometheus_files_parse() {
    let dashboard: serde_json::Value =
        serde_json::from_str(&read(&deploy("grafana/dashboard.json"))).expect("dashboard.json");
    let panels = dashboard["panels"].as_array().expect("panels");
    let titles: Vec<&str> = panels
        .iter()
        .filter(|panel| panel["type"] != "row")
        .map(|panel| panel["title"].as_str().expect("title"))
        .collect();
    for title in [
        "Decisions by result",
        "Near-limit share",
        "Backend latency",
        "Backend errors",
        "gRPC requests in flight",
        "Config reloads",
        "Decision latency against Envoy's timeout",
        "Abandoned calls",
    ] {
        assert!(titles.contains(&title), "{title} in {titles:?}");
    }
    let exprs = dashboard_exprs();
    assert!(
        exprs.iter().any(|expr| expr.contains("histogram_quantile(")
            && expr.contains("throttlegate_backend_latency_seconds_bucket")),
        "{exprs:?}"
    );
    // The decision latency is drawn against Envoy's 20 ms timeout.
    let latency = panels
        .iter()
        .find(|panel| panel["title"] == "Decision latency against Envoy's timeout")
        .expect("the decision latency panel");
    assert!(
        latency["targets"][0]["expr"]
            .as_str()
            .is_some_and(|expr| expr.contains("throttlegate_decision_latency_seconds_bucket")),
        "{latency}"
    );
    let steps = latency["fieldConfig"]["defaults"]["thresholds"]["steps"]
        .as_array()
        .expect("threshold steps");
    assert!(steps.iter().any(|step| step["value"] == 0.02), "{steps:?}");
    assert_eq!(
        latency["fieldConfig"]["defaults"]["custom"]["thresholdsStyle"]["mode"],
        "line"
    );
    assert!(
        exprs
            .iter()
            .any(|expr| expr.contains("throttlegate_abandoned_calls_total")),
        "{exprs:?}"
    );

    let alerts = alert_exprs();
    assert_eq!(
        alerts.keys().collect::<Vec<_>>(),
        [
            "ThrottlegateAbandonedCalls",
            "ThrottlegateBackendErrors",
            "ThrottlegateConfigReloadFailed",
            "ThrottlegateDecisionLatencyNearEnvoyTimeout",
            "ThrottlegateNearLimitShareHigh"
        ]
    );
    // The latency alert fires below Envoy's 20 ms, on the histogram's
    // 15 ms edge.
    let latency = &alerts["ThrottlegateDecisionLatencyNearEnvoyTimeout"];
    assert!(
        latency.contains("histogram_quantile(0.99") && latency.contains("> 0.015"),
        "{latency}"
    );
    assert!(
        throttlegate::metrics::DECISION_LATENCY_BUCKETS.contains(&0.015)
            && throttlegate::metrics::DECISION_LATENCY_BUCKETS.contains(&0.02)
    );
    let prometheus = yaml(&deploy("prometheus/prometheus.yml"));
    let rule_files = at(&prometheus, &["rule_files"]).as_sequence().unwrap();
    assert_eq!(rule_files.len(), 1);
    assert!(
        deploy("prometheus")
            .join(str_at(&rule_files[0], &[]))
            .exists()
    );
}

/// The exposed series: metric name → label → values seen.
type Exposed = BTreeMap<String, BTreeMap<String, BTreeSet<String>>>;

/// Parses an OpenMetrics text exposition into [`Exposed`].
fn exposed(text: &str) -> Exposed {
    let mut out = Exposed::new();
    for line in text.lines().filter(|line| !line.starts_with('#')) {
        let name_end = line.find(['{', ' ']).unwrap_or(line.len());
        let labels = out.entry(line[..name_end].to_owned()).or_default();
        if line[name_end..].starts_with('{') {
            for (key, value) in parse_labels(&line[name_end + 1..]).0 {
                labels.entry(key).or_default().insert(value);
            }
        }
    }
    out.remove("");
    out
}

/// `key="value",...}` (after the `{`): the pairs (quotes taken off,
/// escapes kept) and the length read, up to and with the `}`. The
/// operator between key and value is kept with the key when it is not `=`.
fn parse_labels(text: &str) -> (Vec<(String, String)>, usize) {
    let mut pairs = Vec::new();
    let mut rest = text;
    loop {
        rest = rest.trim_start_matches([',', ' ']);
        if let Some(after) = rest.strip_prefix('}') {
            return (pairs, text.len() - after.len());
        }
        let op = rest.find(['=', '!']).expect("a label operator");
        let key = rest[..op].trim();
        let quote = rest[op..].find('"').expect("a quoted value") + op;
        let op_text = rest[op..quote].trim();
        let mut end = quote + 1;
        let bytes = rest.as_bytes();
        while bytes[end] != b'"' {
            end += if bytes[end] == b'\\' { 2 } else { 1 };
        }
        let key = if op_text == "=" {
            key.to_owned()
        } else {
            format!("{key}{op_text}")
        };
        pairs.push((key, rest[quote + 1..end].to_owned()));
        rest = &rest[end + 1..];
    }
}

/// The labels every series gets from the scrape itself (target labels and
/// the ones prometheus.yml adds by relabelling).
fn target_labels() -> BTreeSet<String> {
    let prometheus = yaml(&deploy("prometheus/prometheus.yml"));
    let mut labels: BTreeSet<String> = ["job", "instance"].map(str::to_owned).into();
    for job in at(&prometheus, &["scrape_configs"]).as_sequence().unwrap() {
        for rule in job
            .get("relabel_configs")
            .and_then(Value::as_sequence)
            .into_iter()
            .flatten()
        {
            if let Some(label) = rule.get("target_label").and_then(Value::as_str) {
                labels.insert(label.to_owned());
            }
        }
    }
    labels
}

/// The problems of one PromQL expression against what the service exposes:
/// unknown metric names, label matchers naming a label the metric lacks or
/// (for `=`) a value it never takes, and `by (...)` labels none of the
/// expression's metrics carry.
fn check_expr(expr: &str, exposed: &Exposed, targets: &BTreeSet<String>) -> Vec<String> {
    let mut problems = Vec::new();
    let mut metrics = BTreeSet::new();
    let mut rest = expr;
    while let Some(start) = rest.find("throttlegate_") {
        let tail = &rest[start..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        let name = &tail[..end];
        rest = &tail[end..];
        let Some(labels) = exposed.get(name) else {
            problems.push(format!("no metric {name}"));
            continue;
        };
        metrics.insert(name.to_owned());
        if let Some(matchers) = rest.strip_prefix('{') {
            let (pairs, read) = parse_labels(matchers);
            rest = &matchers[read..];
            for (key, value) in pairs {
                let plain = key.trim_end_matches(['=', '~', '!']);
                match labels.get(plain) {
                    None => problems.push(format!("{name} has no label {plain}")),
                    Some(values) if key == plain && !values.contains(&value) => {
                        problems.push(format!("{name} never has {plain}=\"{value}\": {values:?}"))
                    }
                    Some(_) => {}
                }
            }
        }
    }
    let mut rest = expr;
    while let Some(start) = rest.find("by (") {
        let inner = &rest[start + 4..];
        let end = inner.find(')').expect("closing )");
        for label in inner[..end].split(',').map(str::trim) {
            let carried = metrics
                .iter()
                .any(|metric| exposed[metric].contains_key(label));
            if !carried && !targets.contains(label) {
                problems.push(format!("by ({label}): no metric of the expression has it"));
            }
        }
        rest = &inner[end..];
    }
    problems
}

#[test]
fn the_expression_check_catches_unknown_names_labels_and_values() {
    let exposed = exposed(
        "# TYPE a histogram\nthrottlegate_a_bucket{le=\"1\",backend=\"memory\"} 1\nthrottlegate_b_total{result=\"ok\"} 1\n# EOF\n",
    );
    let targets = target_labels();
    let ok = "histogram_quantile(0.5, sum by (backend, le, instance) (rate(throttlegate_a_bucket[5m]))) / sum(rate(throttlegate_b_total{result=\"ok\",result=~\"o.*\"}[5m]))";
    assert_eq!(check_expr(ok, &exposed, &targets), Vec::<String>::new());
    for bad in [
        "rate(throttlegate_a[5m])",
        "rate(throttlegate_b{result=\"error\"}[5m])",
        "rate(throttlegate_b_total{kind=\"x\"}[5m])",
        "rate(throttlegate_b_total{result=\"nope\"}[5m])",
        "sum by (kind) (rate(throttlegate_b_total[5m]))",
    ] {
        assert!(!check_expr(bad, &exposed, &targets).is_empty(), "{bad}");
    }
}

#[tokio::test]
async fn every_metric_and_label_queried_is_exposed_by_the_service() {
    use throttlegate::proto::envoy::service::ratelimit::v3::rate_limit_response::Code;
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::health_client::HealthClient;

    let (_dir, files) = configmap_dir();
    let rules = files.get("edge.yaml").expect("edge.yaml in the ConfigMap");
    let mut server = Serve::yaml(rules).spawn();
    let channel = server.connect().await;

    // The probes' health service name and the HTTP alternative answer.
    let docs = throttlegate_docs();
    let probe = at(container(&docs), &["readinessProbe", "grpc", "service"])
        .as_str()
        .unwrap()
        .to_owned();
    let health = HealthClient::new(channel.clone())
        .check(HealthCheckRequest { service: probe })
        .await
        .expect("health check")
        .into_inner();
    assert_eq!(health.status(), ServingStatus::Serving);
    let healthcheck = http_get(server.http, "/healthcheck").await;
    assert!(healthcheck.starts_with("HTTP/1.1 200"), "{healthcheck}");

    // A decision, so that decision series exist.
    let answer = throttlegate::proto::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient::new(channel)
        .should_rate_limit(request(
            "edge",
            vec![descriptor(&[("remote_address", "10.0.0.1")])],
        ))
        .await
        .expect("decision")
        .into_inner();
    assert_eq!(answer.overall_code(), Code::Ok);

    // A reload, so that its counter moves.
    const RELOADS_OK: &str = "throttlegate_config_reloads_total{result=\"ok\"}";
    let before = server.metric(RELOADS_OK).await;
    server.signal("HUP");
    let deadline = Instant::now() + Duration::from_secs(10);
    while server.metric(RELOADS_OK).await <= before {
        assert!(Instant::now() < deadline, "no reload\n{}", server.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let response = http_get(server.http, "/metrics").await;
    let body = &response[response.find("\r\n\r\n").expect("end of head") + 4..];
    let exposed = exposed(body);
    assert!(
        exposed.contains_key("throttlegate_backend_latency_seconds_bucket"),
        "{body}"
    );
    let targets = target_labels();

    let dashboard = dashboard_exprs();
    let alerts = alert_exprs();
    assert!(dashboard.len() >= 8, "{dashboard:?}");
    let mut problems = Vec::new();
    let mut used = BTreeSet::new();
    for expr in dashboard.iter().chain(alerts.values()) {
        for problem in check_expr(expr, &exposed, &targets) {
            problems.push(format!("{problem}\n    in {expr}"));
        }
        used.extend(
            exposed
                .keys()
                .filter(|name| {
                    expr.match_indices(name.as_str()).any(|(at, _)| {
                        !expr[at + name.len()..]
                            .starts_with(|c: char| c == '_' || c.is_ascii_alphanumeric())
                    })
                })
                .cloned(),
        );
    }
    assert!(problems.is_empty(), "{}\n\n{body}", problems.join("\n"));
    // What the dashboard is for.
    for name in [
        "throttlegate_decisions_total",
        "throttlegate_backend_latency_seconds_bucket",
        "throttlegate_backend_errors_total",
        "throttlegate_grpc_requests_in_flight",
        "throttlegate_config_reloads_total",
    ] {
        assert!(used.contains(name), "{name} is not queried: {used:?}");
    }
}

#[test]
fn kubernetes_manifests_validate_against_the_kubernetes_schemas() {
    let validate = Tool::KubernetesValidate;
    let Some(tool) =
        validate.require("kubernetes_manifests_validate_against_the_kubernetes_schemas")
    else {
        return;
    };
    let mut files: Vec<PathBuf> = ["kubernetes", "envoy-gateway"]
        .into_iter()
        .flat_map(|dir| std::fs::read_dir(deploy(dir)).expect("deploy/ folder"))
        .map(|entry| entry.expect("entry").path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "yaml"))
        .collect();
    files.sort();
    let output = std::process::Command::new(&tool)
        .arg("--strict")
        .args(&files)
        .output()
        .unwrap_or_else(|err| panic!("run {}: {err} ({})", tool.display(), validate.install()));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(output.status.success(), "{text}");
    // Every document was checked, none skipped for an unknown kind.
    let documents: usize = files.iter().map(|it| documents(it).len()).sum();
    assert_eq!(
        text.matches(" passed for resource ").count(),
        documents,
        "{text}"
    );
}

/// The Envoy Gateway example changes only the rate-limit image, at the path
/// Envoy Gateway reads it from, inside a well-formed `EnvoyGateway`.
#[test]
fn the_envoy_gateway_example_swaps_only_the_rate_limit_image() {
    let path = deploy("envoy-gateway/envoy-gateway-config.yaml");
    let map = yaml(&path);
    assert_eq!(str_at(&map, &["kind"]), "ConfigMap");
    assert_eq!(str_at(&map, &["metadata", "name"]), "envoy-gateway-config");
    let config: Value =
        serde_yaml_ng::from_str(str_at(&map, &["data", "envoy-gateway.yaml"])).expect("yaml");
    assert_eq!(str_at(&config, &["kind"]), "EnvoyGateway");
    assert_eq!(
        str_at(&config, &["apiVersion"]),
        "gateway.envoyproxy.io/v1alpha1"
    );
    let deployment = at(&config, &["provider", "kubernetes", "rateLimitDeployment"]);
    let container = at(deployment, &["container"]);
    let image = str_at(container, &["image"]);
    assert!(image.contains("throttlegate"), "{image}");
    // Nothing else of Envoy Gateway's Deployment is changed: no command,
    // arguments or environment of our own.
    assert_eq!(
        container.as_mapping().map(|it| it.len()),
        Some(1),
        "{container:?}"
    );
    assert_eq!(
        deployment.as_mapping().map(|it| it.len()),
        Some(1),
        "{deployment:?}"
    );
    assert_eq!(str_at(&config, &["rateLimit", "backend", "type"]), "Redis");
}
