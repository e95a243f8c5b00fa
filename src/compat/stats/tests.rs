use super::*;
use std::collections::HashMap;

fn translate(pairs: &[(&str, &str)]) -> (Vec<FlagValue>, Vec<String>) {
    let vars: HashMap<String, String> = pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    let get = |name: &str| {
        vars.get(name)
            .map(|it| it.trim().to_owned())
            .filter(|it| !it.is_empty())
    };
    let mut flags = Vec::new();
    let mut problems = Vec::new();
    stats(&get, &mut flags, &mut problems);
    (flags, problems)
}

fn owned(pairs: &[(&'static str, &str)]) -> Vec<FlagValue> {
    pairs.iter().map(|(k, v)| (*k, (*v).to_owned())).collect()
}

#[test]
fn envoy_gateway_prometheus_settings() {
    assert_eq!(
        translate(&[
            ("USE_STATSD", "false"),
            ("USE_PROMETHEUS", "true"),
            ("PROMETHEUS_ADDR", ":19001"),
            ("PROMETHEUS_MAPPER_YAML", "/etc/statsd-exporter/conf.yaml"),
        ]),
        (
            owned(&[
                ("ratelimit-prometheus-addr", "0.0.0.0:19001"),
                (
                    "ratelimit-prometheus-mapping",
                    "/etc/statsd-exporter/conf.yaml"
                ),
            ]),
            vec![]
        )
    );
    assert_eq!(
        translate(&[
            ("USE_PROMETHEUS", "1"),
            ("PROMETHEUS_ADDR", "localhost:9100"),
            ("PROMETHEUS_PATH", "/stats"),
        ])
        .0,
        owned(&[
            ("ratelimit-prometheus-addr", "127.0.0.1:9100"),
            ("ratelimit-prometheus-path", "/stats"),
        ])
    );
    assert_eq!(
        translate(&[("USE_PROMETHEUS", "true")]).0,
        owned(&[("ratelimit-prometheus-addr", "0.0.0.0:9090")])
    );
    // Only when asked for, and never with DISABLE_STATS.
    assert_eq!(
        translate(&[("PROMETHEUS_ADDR", ":19001")]),
        (vec![], vec![])
    );
    assert_eq!(
        translate(&[("USE_PROMETHEUS", "true"), ("DISABLE_STATS", "true")]),
        (vec![], vec![])
    );
}

#[test]
fn statsd_and_dogstatsd_settings() {
    assert_eq!(
        translate(&[
            ("USE_STATSD", "true"),
            ("STATSD_HOST", "statsd-exporter"),
            ("STATSD_PORT", "9125"),
            ("EXTRA_TAGS", "env:prod, team:edge"),
            ("STATS_FLUSH_INTERVAL", "1m30s"),
        ]),
        (
            owned(&[
                ("statsd-addr", "statsd-exporter:9125"),
                ("statsd-tag", "env:prod"),
                ("statsd-tag", "team:edge"),
                ("statsd-flush-interval-ms", "90000"),
            ]),
            vec![]
        )
    );
    assert_eq!(
        translate(&[("USE_DOG_STATSD", "true")]).0,
        owned(&[
            ("statsd-addr", "localhost:8125"),
            ("statsd-protocol", "udp"),
            ("statsd-tag-format", "dogstatsd"),
        ])
    );
    assert!(translate(&[("STATSD_HOST", "x")]).0.is_empty());
}

#[test]
fn values_that_cannot_be_used_are_named() {
    let (flags, problems) = translate(&[
        ("USE_STATSD", "true"),
        ("EXTRA_TAGS", "novalue,:x,ok:1"),
        ("STATS_FLUSH_INTERVAL", "10 parsecs"),
        ("USE_PROMETHEUS", "maybe"),
    ]);
    assert_eq!(
        flags,
        owned(&[("statsd-addr", "localhost:8125"), ("statsd-tag", "ok:1")])
    );
    assert_eq!(problems.len(), 4, "{problems:?}");
    let (flags, problems) = translate(&[("USE_STATSD", "true"), ("STATSD_PORT", "http")]);
    assert!(flags.is_empty());
    assert_eq!(problems.len(), 1);
}

#[test]
fn go_durations() {
    assert_eq!(go_duration_ms("10s"), Some(10_000));
    assert_eq!(go_duration_ms("250ms"), Some(250));
    assert_eq!(go_duration_ms("1.5h"), Some(5_400_000));
    assert_eq!(go_duration_ms("1m30s"), Some(90_000));
    assert_eq!(go_duration_ms("1500us"), Some(1));
    assert_eq!(go_duration_ms("10"), None);
    assert_eq!(go_duration_ms("s"), None);
    assert_eq!(go_duration_ms(""), None);
}
