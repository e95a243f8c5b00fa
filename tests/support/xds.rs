//! A management server speaking the real xDS protos: the aggregated
//! discovery stream, state of the world, serving the `RateLimitConfig`
//! snapshot a test sets, over plain HTTP/2 or mutual TLS. It records every
//! request (subscriptions, ACKs, NACKs) and can be stopped, ending its
//! streams, and started again on the same port.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use prost::Message as _;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status, Streaming};

use throttlegate::proto::xds::envoy::service::discovery::v3::aggregated_discovery_service_server::{
    AggregatedDiscoveryService, AggregatedDiscoveryServiceServer,
};
use throttlegate::proto::xds::envoy::service::discovery::v3::{DiscoveryRequest, DiscoveryResponse};
use throttlegate::proto::xds::ratelimit::config::ratelimit::v3::{
    RateLimitConfig, RateLimitDescriptor, RateLimitPolicy, RateLimitUnit,
};
use throttlegate::xds::RATE_LIMIT_CONFIG_TYPE;

/// What the server sends: a version and its resources.
#[derive(Debug, Clone)]
pub struct Snapshot {
    pub version: String,
    pub resources: Vec<RateLimitConfig>,
}

/// A running management server.
pub struct AdsServer {
    pub addr: SocketAddr,
    snapshot: watch::Sender<Option<Snapshot>>,
    requests: Arc<Mutex<Vec<DiscoveryRequest>>>,
    nonces: Arc<Mutex<Vec<(String, String)>>>,
    closing: watch::Sender<bool>,
    task: JoinHandle<()>,
}

/// TLS of the server: its certificate and key (PEM) and the CA client
/// certificates must chain to (mutual TLS).
pub struct ServerTls {
    pub cert: String,
    pub key: String,
    pub client_ca: String,
}

impl AdsServer {
    /// A server on a free port.
    pub async fn start(tls: Option<ServerTls>) -> AdsServer {
        AdsServer::start_on("127.0.0.1:0".parse().unwrap(), tls).await
    }

    /// A server on `addr` (a restart uses the port of the one before).
    pub async fn start_on(addr: SocketAddr, tls: Option<ServerTls>) -> AdsServer {
        let listener = bind(addr).await;
        let addr = listener.local_addr().unwrap();
        let (snapshot, _) = watch::channel(None);
        let (closing, _) = watch::channel(false);
        let service = Ads {
            snapshot: snapshot.clone(),
            requests: Arc::new(Mutex::new(Vec::new())),
            nonces: Arc::new(Mutex::new(Vec::new())),
            closing: closing.subscribe(),
        };
        let requests = service.requests.clone();
        let nonces = service.nonces.clone();
        let router = tonic::transport::Server::builder()
            .add_service(AggregatedDiscoveryServiceServer::new(service));
        let task = match tls {
            None => tokio::spawn(async move {
                let _ = router
                    .serve_with_incoming(TcpListenerStream::new(listener))
                    .await;
            }),
            Some(tls) => {
                let incoming = tls_incoming(listener, &tls);
                tokio::spawn(async move {
                    let _ = router.serve_with_incoming(incoming).await;
                })
            }
        };
        AdsServer {
            addr,
            snapshot,
            requests,
            nonces,
            closing,
            task,
        }
    }

    /// Sends `resources` as `version` to every stream, now and later.
    pub fn push(&self, version: &str, resources: Vec<RateLimitConfig>) {
        self.snapshot.send_replace(Some(Snapshot {
            version: version.to_owned(),
            resources,
        }));
    }

    /// Every request received so far.
    pub fn requests(&self) -> Vec<DiscoveryRequest> {
        self.requests.lock().unwrap().clone()
    }

    /// The nonce of the response that carried `version` (the first one).
    pub fn nonce_of(&self, version: &str) -> Option<String> {
        let nonces = self.nonces.lock().unwrap();
        nonces
            .iter()
            .find(|(it, _)| it == version)
            .map(|(_, nonce)| nonce.clone())
    }

    /// Waits, at most `within`, for a request that `matches`.
    pub async fn wait_for(
        &self,
        within: Duration,
        matches: impl Fn(&DiscoveryRequest) -> bool,
    ) -> DiscoveryRequest {
        let deadline = Instant::now() + within;
        loop {
            if let Some(found) = self.requests().into_iter().find(|it| matches(it)) {
                return found;
            }
            assert!(
                Instant::now() < deadline,
                "no such request within {within:?}; received: {:#?}",
                self.requests()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits for the ACK of `version`: the version and its response's nonce.
    pub async fn wait_for_ack(&self, version: &str, within: Duration) -> DiscoveryRequest {
        self.wait_for(within, |it| {
            it.version_info == version
                && it.error_detail.is_none()
                && Some(&it.response_nonce) == self.nonce_of(version).as_ref()
        })
        .await
    }

    /// Stops listening and ends every stream (UNAVAILABLE), as a server
    /// going away does.
    pub async fn stop(self) {
        self.closing.send_replace(true);
        tokio::time::sleep(Duration::from_millis(50)).await;
        self.task.abort();
        let _ = self.task.await;
    }
}

async fn bind(addr: SocketAddr) -> TcpListener {
    // The port of a stopped server may still be held a moment.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match TcpListener::bind(addr).await {
            Ok(it) => return it,
            Err(err) if Instant::now() < deadline => {
                let _ = err;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(err) => panic!("bind {addr}: {err}"),
        }
    }
}

/// The service: one task per stream.
struct Ads {
    snapshot: watch::Sender<Option<Snapshot>>,
    requests: Arc<Mutex<Vec<DiscoveryRequest>>>,
    nonces: Arc<Mutex<Vec<(String, String)>>>,
    closing: watch::Receiver<bool>,
}

type Responses = Pin<Box<dyn Stream<Item = Result<DiscoveryResponse, Status>> + Send>>;

#[tonic::async_trait]
impl AggregatedDiscoveryService for Ads {
    type StreamAggregatedResourcesStream = Responses;

    async fn stream_aggregated_resources(
        &self,
        request: Request<Streaming<DiscoveryRequest>>,
    ) -> Result<Response<Responses>, Status> {
        let mut inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(16);
        let mut snapshot = self.snapshot.subscribe();
        let mut closing = self.closing.clone();
        let requests = self.requests.clone();
        let nonces = self.nonces.clone();
        tokio::spawn(async move {
            // State of the world: nothing is sent before the subscription.
            match inbound.next().await {
                Some(Ok(first)) => requests.lock().unwrap().push(first),
                _ => return,
            }
            snapshot.mark_changed();
            let mut sent = 0u64;
            loop {
                tokio::select! {
                    changed = snapshot.changed() => {
                        if changed.is_err() {
                            return;
                        }
                        let Some(current) = snapshot.borrow_and_update().clone() else {
                            continue;
                        };
                        sent += 1;
                        let nonce = format!("{}-{sent}", current.version);
                        nonces.lock().unwrap().push((current.version.clone(), nonce.clone()));
                        let response = DiscoveryResponse {
                            version_info: current.version,
                            resources: current.resources.iter().map(resource).collect(),
                            type_url: RATE_LIMIT_CONFIG_TYPE.to_owned(),
                            nonce,
                            ..DiscoveryResponse::default()
                        };
                        if tx.send(Ok(response)).await.is_err() {
                            return;
                        }
                    }
                    request = inbound.next() => match request {
                        Some(Ok(request)) => requests.lock().unwrap().push(request),
                        _ => return,
                    },
                    _ = closing.changed() => {
                        let going = *closing.borrow_and_update();
                        if going {
                            let _ = tx.send(Err(Status::unavailable("server going away"))).await;
                            return;
                        }
                    }
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

/// A resource as a server packs it.
pub fn resource(config: &RateLimitConfig) -> prost_types::Any {
    prost_types::Any {
        type_url: RATE_LIMIT_CONFIG_TYPE.to_owned(),
        value: config.encode_to_vec(),
    }
}

/// A domain of one descriptor `key` (any value) limited to `requests`
/// per minute.
pub fn per_minute(domain: &str, key: &str, requests: u32) -> RateLimitConfig {
    RateLimitConfig {
        name: domain.to_owned(),
        domain: domain.to_owned(),
        descriptors: vec![RateLimitDescriptor {
            key: key.to_owned(),
            rate_limit: Some(RateLimitPolicy {
                unit: RateLimitUnit::Minute as i32,
                requests_per_unit: requests,
                ..RateLimitPolicy::default()
            }),
            ..RateLimitDescriptor::default()
        }],
    }
}

// === TLS ===

/// Accepted connections with the TLS handshake done; failed handshakes
/// are dropped (the client sees the alert).
fn tls_incoming(
    listener: TcpListener,
    tls: &ServerTls,
) -> ReceiverStream<Result<TlsIo, std::io::Error>> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(tls.client_ca.as_bytes()) {
        roots.add(cert.unwrap()).unwrap();
    }
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
        Arc::new(roots),
        provider.clone(),
    )
    .build()
    .unwrap();
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(tls.cert.as_bytes())
        .collect::<Result<_, _>>()
        .unwrap();
    let key = PrivateKeyDer::from_pem_slice(tls.key.as_bytes()).unwrap();
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain, key)
        .unwrap();
    config.alpn_protocols = vec![b"h2".to_vec()];
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let (tx, rx) = mpsc::channel(16);
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                return;
            };
            let acceptor = acceptor.clone();
            let tx = tx.clone();
            tokio::spawn(async move {
                if let Ok(stream) = acceptor.accept(tcp).await {
                    let _ = tx.send(Ok(TlsIo(stream))).await;
                }
            });
        }
    });
    ReceiverStream::new(rx)
}

/// A server-side TLS connection as tonic's server takes it.
pub struct TlsIo(tokio_rustls::server::TlsStream<TcpStream>);

impl tonic::transport::server::Connected for TlsIo {
    type ConnectInfo = ();

    fn connect_info(&self) -> Self::ConnectInfo {}
}

impl AsyncRead for TlsIo {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl AsyncWrite for TlsIo {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
}
