//! TLS clients for the service's two ports: a tonic channel over a
//! tokio-rustls stream made by hand (so ALPN, trust and the client
//! certificate are the test's to choose), and raw HTTP/1.1 over TLS.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::TokioIo;
use rustls::pki_types::ServerName;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tonic::transport::{Channel, Endpoint};

use throttlegate::proto::envoy::service::ratelimit::v3::RateLimitResponse;
use throttlegate::proto::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;

use super::service::one_entry_request;

/// The name the server certificates carry.
fn server_name() -> ServerName<'static> {
    ServerName::try_from("127.0.0.1").expect("an IP address")
}

/// A TLS stream to `addr` with `config`, handshake done.
pub async fn connect(
    addr: SocketAddr,
    config: Arc<rustls::ClientConfig>,
) -> std::io::Result<tokio_rustls::client::TlsStream<TcpStream>> {
    let tcp = TcpStream::connect(addr).await?;
    tokio_rustls::TlsConnector::from(config)
        .connect(server_name(), tcp)
        .await
}

/// A gRPC channel over TLS with `config` (whose ALPN the caller chose).
pub async fn channel(
    addr: SocketAddr,
    config: Arc<rustls::ClientConfig>,
) -> Result<Channel, tonic::transport::Error> {
    let connector = tower::service_fn(move |_uri: tonic::codegen::http::Uri| {
        let config = config.clone();
        async move { connect(addr, config).await.map(TokioIo::new) }
    });
    Endpoint::from_shared(format!("http://{addr}"))
        .expect("valid uri")
        .connect_timeout(Duration::from_secs(5))
        .timeout(Duration::from_secs(10))
        .connect_with_connector(connector)
        .await
}

/// One ShouldRateLimit call of domain `domain`, `k=v`, over TLS with
/// `config`; any failure (the handshake, the call) as text.
pub async fn decide(
    addr: SocketAddr,
    config: Arc<rustls::ClientConfig>,
    domain: &str,
) -> Result<RateLimitResponse, String> {
    let channel = channel(addr, config)
        .await
        .map_err(|err| format!("{err:?}"))?;
    let mut client = RateLimitServiceClient::new(channel);
    let call = client.should_rate_limit(one_entry_request(domain, "k", "v"));
    match tokio::time::timeout(Duration::from_secs(10), call).await {
        Ok(Ok(response)) => Ok(response.into_inner()),
        Ok(Err(status)) => Err(format!("{status:?}")),
        Err(_) => Err("no answer within 10 s".to_owned()),
    }
}

/// Sends `request` (a whole HTTP/1.1 request, `Connection: close`) over
/// TLS with `config`; the response, or why there is none.
pub async fn https(
    addr: SocketAddr,
    config: Arc<rustls::ClientConfig>,
    request: &str,
) -> Result<String, String> {
    let exchange = async {
        let mut stream = connect(addr, config).await.map_err(|err| err.to_string())?;
        stream
            .write_all(request.as_bytes())
            .await
            .map_err(|err| err.to_string())?;
        read_all(&mut stream).await
    };
    tokio::time::timeout(Duration::from_secs(10), exchange)
        .await
        .unwrap_or_else(|_| Err("no answer within 10 s".to_owned()))
}

/// Everything read until the end; what was read if an error cuts it short,
/// the error if nothing was.
async fn read_all(stream: &mut (impl AsyncReadExt + Unpin)) -> Result<String, String> {
    let mut response = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match stream.read(&mut buf).await {
            Ok(0) => break,
            Ok(n) => response.extend_from_slice(&buf[..n]),
            Err(err) if response.is_empty() => return Err(err.to_string()),
            Err(_) => break,
        }
    }
    Ok(String::from_utf8_lossy(&response).into_owned())
}

/// `GET path` over TLS.
pub async fn https_get(
    addr: SocketAddr,
    config: Arc<rustls::ClientConfig>,
    path: &str,
) -> Result<String, String> {
    let request = format!("GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n");
    https(addr, config, &request).await
}

/// `POST /json` of a one-entry request of `domain` over TLS.
pub async fn https_json(
    addr: SocketAddr,
    config: Arc<rustls::ClientConfig>,
    domain: &str,
) -> Result<String, String> {
    let body = format!(
        r#"{{"domain":"{domain}","descriptors":[{{"entries":[{{"key":"k","value":"v"}}]}}]}}"#
    );
    let request = format!(
        "POST /json HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    https(addr, config, &request).await
}

/// A plain-text HTTP/1.1 `GET path`: what the server sends back, if
/// anything (not UTF-8 checked: a TLS server answers with an alert).
pub async fn plain_get(addr: SocketAddr, path: &str) -> Result<String, String> {
    let exchange = async {
        let mut stream = TcpStream::connect(addr)
            .await
            .map_err(|err| err.to_string())?;
        let request = format!("GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n");
        stream
            .write_all(request.as_bytes())
            .await
            .map_err(|err| err.to_string())?;
        read_all(&mut stream).await
    };
    tokio::time::timeout(Duration::from_secs(10), exchange)
        .await
        .unwrap_or_else(|_| Err("no answer within 10 s".to_owned()))
}

/// The value of the series `series` in `/metrics` text.
pub fn sample(metrics: &str, series: &str) -> Option<f64> {
    metrics
        .lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|value| value.trim().parse().ok())
}
