//! The connection to the management server: plain HTTP/2, or TLS (rustls,
//! ring) with the server's CA, an optional client certificate (mutual TLS)
//! and the name the server's certificate must carry. Files are read when
//! the settings are checked at start-up and again at every connection, so
//! a renewed certificate is used from the next reconnection on.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::TokioIo;
use rustls::pki_types::ServerName;
use tonic::transport::{Channel, Endpoint, Uri};

use crate::pem;

/// How long a connection attempt (TCP, then TLS) may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// TLS to the management server.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct XdsTls {
    /// CA certificates the server's chain must lead to; `None`: the
    /// built-in web roots.
    pub ca: Option<PathBuf>,
    /// A client certificate chain (PEM) to present: mutual TLS.
    pub cert: Option<PathBuf>,
    /// The private key of `cert`.
    pub key: Option<PathBuf>,
    /// The name the server's certificate must be valid for (and the SNI
    /// sent); `None`: the host of the server address.
    pub server_name: Option<String>,
}

/// Where the server is: `host:port`, or an `http://`/`https://` URL (the
/// scheme does not choose TLS: `tls` does).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct XdsServerAddress {
    pub host: String,
    pub port: u16,
}

impl XdsServerAddress {
    /// Parses `address`; the message says what is wrong.
    pub fn parse(address: &str) -> Result<XdsServerAddress, String> {
        let rest = address
            .strip_prefix("http://")
            .or_else(|| address.strip_prefix("https://"))
            .unwrap_or(address)
            .trim_end_matches('/');
        let refused = || format!("xDS server '{address}' is not host:port");
        let (host, port) = rest.rsplit_once(':').ok_or_else(refused)?;
        let host = host.trim_start_matches('[').trim_end_matches(']');
        let port: u16 = port.parse().map_err(|_| refused())?;
        if host.is_empty() || rest.contains('/') {
            return Err(refused());
        }
        Ok(XdsServerAddress {
            host: host.to_owned(),
            port,
        })
    }

    fn uri(&self) -> String {
        if self.host.contains(':') {
            format!("http://[{}]:{}", self.host, self.port)
        } else {
            format!("http://{}:{}", self.host, self.port)
        }
    }
}

/// The rustls client config `tls` describes; an error names the file or
/// the setting at fault.
pub fn client_config(tls: &XdsTls) -> Result<rustls::ClientConfig, String> {
    let mut roots = rustls::RootCertStore::empty();
    match &tls.ca {
        Some(ca) => {
            for cert in pem::certificates(ca).map_err(|err| err.to_string())? {
                roots
                    .add(cert)
                    .map_err(|err| format!("{}: {err}", ca.display()))?;
            }
        }
        None => roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned()),
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|err| err.to_string())?
        .with_root_certificates(roots);
    let mut config = match (&tls.cert, &tls.key) {
        (Some(cert), Some(key)) => {
            let chain = pem::certificates(cert).map_err(|err| err.to_string())?;
            let key_der = pem::private_key(key).map_err(|err| err.to_string())?;
            builder
                .with_client_auth_cert(chain, key_der)
                .map_err(|err| format!("{}: {err}", cert.display()))?
        }
        (None, None) => builder.with_no_client_auth(),
        (Some(_), None) => return Err("an xDS client certificate needs its key".to_owned()),
        (None, Some(_)) => return Err("an xDS client key needs its certificate".to_owned()),
    };
    // gRPC servers (grpc-go among them) refuse a TLS client without h2.
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(config)
}

/// The name the server's certificate is checked against.
pub fn server_name(target: &XdsServerAddress, tls: &XdsTls) -> Result<ServerName<'static>, String> {
    let name = tls.server_name.as_deref().unwrap_or(&target.host);
    ServerName::try_from(name.to_owned())
        .map_err(|_| format!("'{name}' is not a DNS name or IP address for the xDS server"))
}

/// A channel to `target`, connected now (an error says why not).
pub async fn connect(target: &XdsServerAddress, tls: Option<&XdsTls>) -> Result<Channel, String> {
    let endpoint = Endpoint::from_shared(target.uri())
        .map_err(|err| err.to_string())?
        .connect_timeout(CONNECT_TIMEOUT)
        .http2_keep_alive_interval(Duration::from_secs(30))
        .keep_alive_timeout(Duration::from_secs(10));
    let Some(tls) = tls else {
        return endpoint.connect().await.map_err(|err| describe(&err));
    };
    let connector = tokio_rustls::TlsConnector::from(Arc::new(client_config(tls)?));
    let name = server_name(target, tls)?;
    let address = (target.host.clone(), target.port);
    let connect = tower::service_fn(move |_: Uri| {
        let connector = connector.clone();
        let name = name.clone();
        let address = address.clone();
        async move {
            let tcp = tokio::net::TcpStream::connect(address).await?;
            tcp.set_nodelay(true)?;
            let stream = connector.connect(name, tcp).await?;
            Ok::<_, std::io::Error>(TokioIo::new(stream))
        }
    });
    tokio::time::timeout(CONNECT_TIMEOUT, endpoint.connect_with_connector(connect))
        .await
        .map_err(|_| format!("no connection within {} s", CONNECT_TIMEOUT.as_secs()))?
        .map_err(|err| describe(&err))
}

/// An error with its causes, which tonic keeps apart (the TLS alert is a
/// cause of "transport error").
fn describe(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests;
