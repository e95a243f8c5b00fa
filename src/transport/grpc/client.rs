//! `throttlegate check`: one `ShouldRateLimit` call to a running service,
//! plain or over TLS (a CA to trust, a client certificate, the name to
//! verify), its answer written as the proto3 JSON `/json` writes
//! ([`crate::transport::http::json::response_json`]).
//!
//! Descriptors are given as text, `key=value[,key=value...]`, one
//! descriptor each, entries outermost first; `\,`, `\=` and `\\` stand for
//! a comma, an equals sign and a backslash inside a key or value.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::TokioIo;
use rustls::RootCertStore;
use rustls::pki_types::ServerName;
use tokio::net::TcpStream;
use tonic::transport::Endpoint;

use crate::pem;
use crate::proto::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use crate::proto::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use crate::proto::envoy::service::ratelimit::v3::rate_limit_response::Code;
use crate::proto::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use crate::proto::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use crate::transport::http::json::response_json;

/// One call: where, how, and what to ask.
#[derive(Debug, Clone)]
pub struct Call {
    /// `host:port`, or a URL `http://host:port` / `https://host:port`
    /// (`https` turns TLS on).
    pub addr: String,
    /// `None`: plain text (h2c), as Envoy calls a service without TLS.
    pub tls: Option<ClientTls>,
    pub domain: String,
    /// Each descriptor's entries, outermost first.
    pub descriptors: Vec<Vec<(String, String)>>,
    /// The request's `hits_addend`.
    pub hits: u32,
    /// Bounds the connection and the call together.
    pub timeout: Duration,
}

/// TLS towards the service.
#[derive(Debug, Clone, Default)]
pub struct ClientTls {
    /// Trust the CA certificates in this PEM file; `None`: the web's
    /// public roots (Mozilla's list, built in).
    pub ca: Option<PathBuf>,
    /// A client certificate chain (PEM) for mutual TLS, with its key.
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
    /// The name the server's certificate must be valid for; `None`: the
    /// host of the address.
    pub server_name: Option<String>,
}

/// The service's answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Checked {
    /// The answer as proto3 JSON, one line.
    pub json: String,
    /// Its overall code is OVER_LIMIT.
    pub over_limit: bool,
}

/// Why no answer came. The messages say what failed, with the cause.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0}")]
    Settings(String),
    #[error(transparent)]
    Pem(#[from] pem::Error),
    #[error("cannot connect to {addr}: {cause}")]
    Connect { addr: String, cause: String },
    #[error("ShouldRateLimit failed: {code:?}: {message}")]
    Rpc { code: tonic::Code, message: String },
    #[error("no answer from {addr} within {timeout:?}")]
    Timeout { addr: String, timeout: Duration },
}

/// Makes the call and waits for its answer (within `call.timeout`).
pub async fn check(call: &Call) -> Result<Checked, Error> {
    let request = request(call);
    let answer = tokio::time::timeout(call.timeout, ask(call, request)).await;
    let response = answer.map_err(|_| Error::Timeout {
        addr: call.addr.clone(),
        timeout: call.timeout,
    })??;
    Ok(Checked {
        json: response_json(&response),
        over_limit: response.overall_code == Code::OverLimit as i32,
    })
}

fn request(call: &Call) -> RateLimitRequest {
    RateLimitRequest {
        domain: call.domain.clone(),
        descriptors: call
            .descriptors
            .iter()
            .map(|entries| RateLimitDescriptor {
                entries: entries
                    .iter()
                    .map(|(key, value)| Entry {
                        key: key.as_bytes().to_vec(),
                        value: value.as_bytes().to_vec(),
                    })
                    .collect(),
                ..Default::default()
            })
            .collect(),
        hits_addend: call.hits,
    }
}

async fn ask(call: &Call, request: RateLimitRequest) -> Result<RateLimitResponse, Error> {
    let (host_port, https) = split_scheme(&call.addr)?;
    let tls = match (&call.tls, https) {
        (Some(tls), _) => Some(tls.clone()),
        (None, true) => Some(ClientTls::default()),
        (None, false) => None,
    };
    // The URI names the peer for tonic; the connector below makes the
    // connection (TLS included), so tonic's own TLS features are not used
    // and the URI stays `http`.
    let endpoint = Endpoint::from_shared(format!("http://{host_port}"))
        .map_err(|err| Error::Settings(format!("bad address '{}': {err}", call.addr)))?;
    let connect_error = |err: tonic::transport::Error| Error::Connect {
        addr: call.addr.clone(),
        cause: chain(&err),
    };
    let channel = match tls {
        None => endpoint.connect().await.map_err(connect_error)?,
        Some(tls) => {
            let (config, name) = tls_config(&tls, &host_port)?;
            let addr = host_port.clone();
            let connector = tower::service_fn(move |_: tonic::codegen::http::Uri| {
                let (config, name, addr) = (config.clone(), name.clone(), addr.clone());
                async move {
                    let tcp = TcpStream::connect(addr.as_str()).await?;
                    let stream = tokio_rustls::TlsConnector::from(config)
                        .connect(name, tcp)
                        .await?;
                    Ok::<_, std::io::Error>(TokioIo::new(stream))
                }
            });
            endpoint
                .connect_with_connector(connector)
                .await
                .map_err(connect_error)?
        }
    };
    let mut request = tonic::Request::new(request);
    request.set_timeout(call.timeout);
    match RateLimitServiceClient::new(channel)
        .should_rate_limit(request)
        .await
    {
        Ok(response) => Ok(response.into_inner()),
        Err(status) if status.code() == tonic::Code::Unknown && status.message().is_empty() => {
            // tonic reports a broken connection (a refused handshake among
            // them) as UNKNOWN with its cause as the source.
            Err(Error::Connect {
                addr: call.addr.clone(),
                cause: chain(&status),
            })
        }
        Err(status) => Err(Error::Rpc {
            code: status.code(),
            message: status.message().to_owned(),
        }),
    }
}

/// `host:port` and whether the address asked for `https`.
fn split_scheme(addr: &str) -> Result<(String, bool), Error> {
    let (rest, https) = if let Some(rest) = addr.strip_prefix("https://") {
        (rest, true)
    } else if let Some(rest) = addr.strip_prefix("http://") {
        (rest, false)
    } else if addr.contains("://") {
        return Err(Error::Settings(format!(
            "'{addr}': only http:// and https:// addresses"
        )));
    } else {
        (addr, false)
    };
    let rest = rest.trim_end_matches('/');
    if rest.is_empty() || rest.contains('/') {
        return Err(Error::Settings(format!("'{addr}' is not host:port")));
    }
    Ok((rest.to_owned(), https))
}

/// The rustls client config (ALPN `h2`) and the name to verify.
fn tls_config(
    tls: &ClientTls,
    host_port: &str,
) -> Result<(Arc<rustls::ClientConfig>, ServerName<'static>), Error> {
    let mut roots = RootCertStore::empty();
    match &tls.ca {
        Some(path) => {
            for cert in pem::certificates(path)? {
                roots.add(cert).map_err(|err| {
                    Error::Settings(format!("{}: not a CA certificate: {err}", path.display()))
                })?;
            }
        }
        None => roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned()),
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|err| Error::Settings(err.to_string()))?
        .with_root_certificates(roots);
    let mut config = match (&tls.cert, &tls.key) {
        (Some(cert), Some(key)) => builder
            .with_client_auth_cert(pem::certificates(cert)?, pem::private_key(key)?)
            .map_err(|err| {
                Error::Settings(format!(
                    "{} and {} do not go together: {err}",
                    cert.display(),
                    key.display()
                ))
            })?,
        (None, None) => builder.with_no_client_auth(),
        _ => {
            return Err(Error::Settings(
                "a client certificate needs its key, and a key its certificate".into(),
            ));
        }
    };
    config.alpn_protocols = vec![b"h2".to_vec()];
    let name = match &tls.server_name {
        Some(name) => name.clone(),
        None => host_of(host_port).to_owned(),
    };
    let name = ServerName::try_from(name.clone())
        .map_err(|_| Error::Settings(format!("'{name}' is not a DNS name or IP address")))?;
    Ok((Arc::new(config), name))
}

/// The host of `host:port` (`[::1]:8081` gives `::1`).
fn host_of(host_port: &str) -> &str {
    if let Some(rest) = host_port.strip_prefix('[') {
        return rest.split(']').next().unwrap_or(rest);
    }
    host_port
        .rsplit_once(':')
        .map_or(host_port, |(host, _)| host)
}

/// An error and its causes, `: `-joined (tonic's own text is only
/// "transport error").
fn chain(err: &(dyn std::error::Error + 'static)) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        let more = cause.to_string();
        if !text.contains(&more) {
            text.push_str(": ");
            text.push_str(&more);
        }
        source = cause.source();
    }
    text
}

/// One descriptor from `key=value[,key=value...]`: entries split at
/// commas, each at its first `=`; a backslash makes the next character
/// (`,`, `=` or `\`) literal. A key must not be empty; a value may be.
pub fn parse_descriptor(text: &str) -> Result<Vec<(String, String)>, String> {
    let mut entries = Vec::new();
    let mut key: Option<String> = None;
    let mut current = String::new();
    let mut chars = text.chars();
    let mut finish = |key: Option<String>, value: String| match key {
        Some(key) if !key.is_empty() => {
            entries.push((key, value));
            Ok(())
        }
        Some(_) => Err(format!("'{text}': an entry with an empty key")),
        None => Err(format!(
            "'{text}': '{value}' is not key=value (a literal ',' or '=' is written '\\,' or '\\=')"
        )),
    };
    while let Some(c) = chars.next() {
        match c {
            '\\' => match chars.next() {
                Some(escaped @ (',' | '=' | '\\')) => current.push(escaped),
                _ => {
                    return Err(format!("'{text}': '\\' escapes only ',', '=' and '\\'"));
                }
            },
            '=' if key.is_none() => key = Some(std::mem::take(&mut current)),
            ',' => finish(key.take(), std::mem::take(&mut current))?,
            c => current.push(c),
        }
    }
    finish(key, current)?;
    Ok(entries)
}

#[cfg(test)]
mod tests;
