//! The `--config-xds-*` flags: rules from an xDS management server
//! instead of files. Invariant: a TLS or xDS flag that would be ignored is
//! refused instead.

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

use crate::app::XdsFlags;
use crate::xds::{XdsServerAddress, XdsSettings, XdsTls};

/// Rules from a management server over xDS instead of files.
#[derive(Debug, Default, Args)]
pub(super) struct XdsArgs {
    /// Take the rules from this xDS management server (`host:port`), over
    /// its aggregated discovery stream (state of the world), as
    /// `ratelimit.config.ratelimit.v3.RateLimitConfig` resources, one per
    /// domain; excludes --config.
    #[arg(long, env = "THROTTLEGATE_CONFIG_XDS_SERVER", value_name = "HOST:PORT", value_parser = XdsServerAddress::parse)]
    config_xds_server: Option<XdsServerAddress>,
    /// The node id the xDS server picks the resources by.
    #[arg(
        long,
        env = "THROTTLEGATE_CONFIG_XDS_NODE_ID",
        default_value = "default"
    )]
    config_xds_node_id: String,
    /// Node metadata sent to the xDS server, `key=value` (repeat, or
    /// comma-separated).
    #[arg(long, env = "THROTTLEGATE_CONFIG_XDS_NODE_METADATA", value_name = "KEY=VALUE", value_delimiter = ',', value_parser = parse_key_value)]
    config_xds_node_metadata: Vec<(String, String)>,
    /// Serve before the xDS server's first config arrives: until it does,
    /// every request is answered through --failure-mode and health reports
    /// SERVING. Without it nothing is served until then.
    #[arg(long, env = "THROTTLEGATE_CONFIG_XDS_FORCE_START")]
    config_xds_force_start: bool,
    /// The first wait before reconnecting to the xDS server after a failed
    /// connection or stream; doubled after each failure, up to 60 s.
    #[arg(long, env = "THROTTLEGATE_CONFIG_XDS_RETRY_INTERVAL_MS", default_value_t = 3_000, value_parser = clap::value_parser!(u64).range(1..))]
    config_xds_retry_interval_ms: u64,
    /// TLS to the xDS server (checked against --config-xds-tls-ca, or the
    /// built-in web roots).
    #[arg(long, env = "THROTTLEGATE_CONFIG_XDS_TLS")]
    config_xds_tls: bool,
    /// With --config-xds-tls: the CA certificates (PEM) the xDS server's
    /// certificate must chain to.
    #[arg(long, env = "THROTTLEGATE_CONFIG_XDS_TLS_CA", value_name = "FILE")]
    config_xds_tls_ca: Option<PathBuf>,
    /// With --config-xds-tls: present this client certificate (PEM chain)
    /// to the xDS server (mutual TLS); needs --config-xds-tls-key.
    #[arg(long, env = "THROTTLEGATE_CONFIG_XDS_TLS_CERT", value_name = "FILE")]
    config_xds_tls_cert: Option<PathBuf>,
    /// The private key of --config-xds-tls-cert (PEM).
    #[arg(long, env = "THROTTLEGATE_CONFIG_XDS_TLS_KEY", value_name = "FILE")]
    config_xds_tls_key: Option<PathBuf>,
    /// With --config-xds-tls: the name the xDS server's certificate must be
    /// valid for (and the TLS server name sent) [default: the server's host].
    #[arg(
        long,
        env = "THROTTLEGATE_CONFIG_XDS_TLS_SERVER_NAME",
        value_name = "NAME"
    )]
    config_xds_tls_server_name: Option<String>,
}

fn parse_key_value(text: &str) -> Result<(String, String), String> {
    match text.split_once('=') {
        Some((key, value)) if !key.is_empty() => Ok((key.to_owned(), value.to_owned())),
        _ => Err(format!("'{text}' is not key=value")),
    }
}

/// The xDS flags as `app` takes them; `None` without a server. TLS files
/// given without --config-xds-tls are refused (they would be ignored).
pub(super) fn xds_flags(args: XdsArgs) -> Result<Option<XdsFlags>, String> {
    let tls_given = args.config_xds_tls_ca.is_some()
        || args.config_xds_tls_cert.is_some()
        || args.config_xds_tls_key.is_some()
        || args.config_xds_tls_server_name.is_some();
    let Some(server) = args.config_xds_server else {
        if tls_given || args.config_xds_tls || args.config_xds_force_start {
            return Err("the --config-xds-* flags need --config-xds-server".to_owned());
        }
        return Ok(None);
    };
    if tls_given && !args.config_xds_tls {
        return Err(
            "--config-xds-tls-* need --config-xds-tls: without it the xDS server is reached in plain text"
                .to_owned(),
        );
    }
    let tls = args.config_xds_tls.then_some(XdsTls {
        ca: args.config_xds_tls_ca,
        cert: args.config_xds_tls_cert,
        key: args.config_xds_tls_key,
        server_name: args.config_xds_tls_server_name,
    });
    Ok(Some(XdsFlags {
        settings: XdsSettings {
            server,
            node_id: args.config_xds_node_id,
            node_metadata: args.config_xds_node_metadata,
            tls,
            retry_interval: Duration::from_millis(args.config_xds_retry_interval_ms),
        },
        force_start: args.config_xds_force_start,
    }))
}
