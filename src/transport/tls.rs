//! TLS on both servers: the certificate, key and (for mutual TLS) client
//! CA read from PEM files, the handshake on top of an accepted [`Conn`],
//! and reloads when the files change.
//!
//! The handshake runs on the [`Conn`] the [`Listener`] hands out, so the
//! connection cap and the connection's first deadline bound it: a peer that
//! opens TCP and never finishes the handshake is dropped at the same
//! deadline as one that never sends a request. Handshakes run in tasks of
//! their own, never in the accept loop, so a slow one delays no other
//! client. [`Tls`] holds one rustls `ServerConfig` per server (the gRPC one
//! offers ALPN `h2`, the HTTP one `http/1.1`) behind an `ArcSwap`: a reload
//! builds both anew from the files and swaps them in whole, and a handshake
//! uses the configs in force when it starts. Files that fail to load leave
//! the configs in force. Error messages name files, never their contents.

use std::io;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime};

use arc_swap::ArcSwap;
use futures_util::{Stream, StreamExt};
use prometheus_client::metrics::counter::Counter;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::{ServerConfig, WebPkiClientVerifier};
use rustls::{DigitallySignedStruct, DistinguishedName, RootCertStore, SignatureScheme};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::{Instant, MissedTickBehavior};
use tokio_util::task::AbortOnDropHandle;
use tonic::transport::server::Connected;

use crate::log_gate::LogGate;
use crate::pem;
use crate::transport::listener::{Conn, ConnInfo};

/// How often the files are checked for a change.
pub const CHECK_EVERY: Duration = Duration::from_secs(1);

/// Where the server's certificate, key and client CA are read from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// The certificate chain, leaf first (PEM).
    pub cert: PathBuf,
    /// Its private key (PEM: PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// Mutual TLS: clients must present a certificate this CA (PEM, one or
    /// more certificates) signed; `None`: no client certificate asked for.
    pub client_ca: Option<PathBuf>,
    /// With `client_ca`: the client certificate must also be valid for this
    /// name (a DNS name or IP address among its subject alternative names).
    pub client_san: Option<String>,
}

/// Why the TLS files could not be used. The messages name the files, never
/// what they hold.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Pem(#[from] pem::Error),
    #[error("{0}")]
    Invalid(String),
}

/// The two server configs in force and how to rebuild them.
pub struct Tls {
    files: TlsFiles,
    grpc: ArcSwap<ServerConfig>,
    http: ArcSwap<ServerConfig>,
    /// The files as last loaded (or last refused): only a change reloads.
    seen: Mutex<TlsFileStamps>,
    observer: Option<Box<dyn Fn(bool) + Send + Sync>>,
}

/// Which server a handshake is for: the ALPN protocol it offers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// Offers `h2`; a client that sends no ALPN is served all the same.
    Grpc,
    /// Offers `http/1.1`.
    Http,
}

/// Hands out the config in force for one server's handshakes.
#[derive(Clone)]
pub struct TlsAcceptor {
    tls: Arc<Tls>,
    side: Side,
}

/// A connection as the servers read it: plain, or TLS over an accepted
/// [`Conn`] (whose watchdog and permit stay underneath).
#[derive(Debug)]
pub enum Io {
    Plain(Conn),
    Tls(Box<tokio_rustls::server::TlsStream<Conn>>),
}

/// Stops the task that checks the files when dropped.
#[derive(Debug)]
pub struct TlsReloadGuard {
    task: JoinHandle<()>,
}

/// Identity of the TLS files, one stamp each: modification time, length,
/// inode. A Kubernetes secret update (a symlink swap) changes the target's
/// inode.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
struct TlsFileStamps(Vec<Option<(SystemTime, u64, u64)>>);

/// The client verifier of `--tls-client-ca`, and the name the client's
/// certificate must also be valid for.
#[derive(Debug)]
struct SanVerifier {
    inner: Arc<dyn ClientCertVerifier>,
    name: ServerName<'static>,
}

// === impl Tls ===

impl Tls {
    /// Loads the files; an error names the file at fault.
    pub fn load(files: TlsFiles) -> Result<Tls, Error> {
        // The process-wide provider rustls falls back on; ours is explicit,
        // but a client built elsewhere (Redis) may need it.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let seen = TlsFileStamps::of(&files);
        let (grpc, http) = build(&files)?;
        Ok(Tls {
            files,
            grpc: ArcSwap::from_pointee(grpc),
            http: ArcSwap::from_pointee(http),
            seen: Mutex::new(seen),
            observer: None,
        })
    }

    /// `observer` hears every reload's result (true: swapped in).
    pub fn with_observer(mut self, observer: impl Fn(bool) + Send + Sync + 'static) -> Tls {
        self.observer = Some(Box::new(observer));
        self
    }

    pub fn files(&self) -> &TlsFiles {
        &self.files
    }

    /// The acceptor of one server's handshakes.
    pub fn acceptor(self: &Arc<Self>, side: Side) -> TlsAcceptor {
        TlsAcceptor {
            tls: self.clone(),
            side,
        }
    }

    /// Loads the files now: on success new handshakes use them; on failure
    /// (logged, without the files' contents) the configs in force stay.
    pub fn reload_now(&self) -> Result<(), Error> {
        let mut seen = self.seen.lock().unwrap_or_else(PoisonError::into_inner);
        *seen = TlsFileStamps::of(&self.files);
        self.reload_locked()
    }

    /// Reloads if the files changed since the last load; `None` if not.
    pub fn reload_if_changed(&self) -> Option<Result<(), Error>> {
        let mut seen = self.seen.lock().unwrap_or_else(PoisonError::into_inner);
        let now = TlsFileStamps::of(&self.files);
        if now == *seen {
            return None;
        }
        *seen = now;
        Some(self.reload_locked())
    }

    fn reload_locked(&self) -> Result<(), Error> {
        let res = build(&self.files);
        if let Some(observer) = &self.observer {
            observer(res.is_ok());
        }
        match res {
            Ok((grpc, http)) => {
                self.grpc.store(Arc::new(grpc));
                self.http.store(Arc::new(http));
                tracing::info!(
                    cert = %self.files.cert.display(),
                    "tls certificate reloaded: new connections use it"
                );
                Ok(())
            }
            Err(err) => {
                tracing::error!("tls files refused, the certificate in force stays: {err}");
                Err(err)
            }
        }
    }

    /// Checks the files every `every` (on the blocking pool) and reloads
    /// them when they change, until the guard is dropped.
    pub fn spawn_reloader(self: &Arc<Self>, every: Duration) -> TlsReloadGuard {
        let every = every.max(Duration::from_millis(1));
        let tls = self.clone();
        let task = tokio::spawn(async move {
            let mut ticks = tokio::time::interval_at(Instant::now() + every, every);
            ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
            loop {
                ticks.tick().await;
                let checking = tls.clone();
                let _ = tokio::task::spawn_blocking(move || checking.reload_if_changed()).await;
            }
        });
        TlsReloadGuard { task }
    }
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tls")
            .field("files", &self.files)
            .finish_non_exhaustive()
    }
}

/// Both servers' configs from the files.
fn build(files: &TlsFiles) -> Result<(ServerConfig, ServerConfig), Error> {
    let chain = pem::certificates(&files.cert)?;
    let key = pem::private_key(&files.key)?;
    let verifier = match &files.client_ca {
        Some(path) => Some(client_verifier(path, files.client_san.as_deref())?),
        None if files.client_san.is_some() => {
            return Err(Error::Invalid(
                "a required client certificate name needs a client CA".to_owned(),
            ));
        }
        None => None,
    };
    let config = |alpn: &[u8]| -> Result<ServerConfig, Error> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|err| Error::Invalid(format!("tls: {err}")))?;
        let builder = match &verifier {
            Some(verifier) => builder.with_client_cert_verifier(verifier.clone()),
            None => builder.with_no_client_auth(),
        };
        let mut config = builder
            .with_single_cert(chain.clone(), key.clone_key())
            .map_err(|err| {
                Error::Invalid(format!(
                    "{} and {} do not make a usable certificate: {err}",
                    files.cert.display(),
                    files.key.display()
                ))
            })?;
        config.alpn_protocols = vec![alpn.to_vec()];
        Ok(config)
    };
    Ok((config(b"h2")?, config(b"http/1.1")?))
}

/// Requires a client certificate signed by the CA in `path` (and valid for
/// `san`, when given).
fn client_verifier(path: &Path, san: Option<&str>) -> Result<Arc<dyn ClientCertVerifier>, Error> {
    let mut roots = RootCertStore::empty();
    for cert in pem::certificates(path)? {
        roots.add(cert).map_err(|_| {
            Error::Invalid(format!(
                "{}: a certificate in it is not a usable CA certificate",
                path.display()
            ))
        })?;
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let inner = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
        .build()
        .map_err(|err| Error::Invalid(format!("{}: {err}", path.display())))?;
    let Some(san) = san else {
        return Ok(inner);
    };
    let name = ServerName::try_from(san.to_owned()).map_err(|_| {
        Error::Invalid(format!(
            "'{san}' is neither a DNS name nor an IP address: no client certificate can carry it"
        ))
    })?;
    Ok(Arc::new(SanVerifier { inner, name }))
}

// === impl SanVerifier ===

impl ClientCertVerifier for SanVerifier {
    fn offer_client_auth(&self) -> bool {
        self.inner.offer_client_auth()
    }

    fn client_auth_mandatory(&self) -> bool {
        self.inner.client_auth_mandatory()
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        self.inner.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        let verified = self
            .inner
            .verify_client_cert(end_entity, intermediates, now)?;
        let cert = webpki::EndEntityCert::try_from(end_entity).map_err(|_| {
            rustls::Error::InvalidCertificate(rustls::CertificateError::BadEncoding)
        })?;
        cert.verify_is_valid_for_subject_name(&self.name)
            .map_err(|_| {
                rustls::Error::InvalidCertificate(rustls::CertificateError::NotValidForName)
            })?;
        Ok(verified)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

// === impl TlsAcceptor ===

impl TlsAcceptor {
    /// The config new handshakes of this server use.
    fn config(&self) -> Arc<ServerConfig> {
        match self.side {
            Side::Grpc => self.tls.grpc.load_full(),
            Side::Http => self.tls.http.load_full(),
        }
    }

    /// The handshake on `conn`, with the config in force now; fails when
    /// the connection's deadline passes first (see [`Conn`]).
    pub async fn handshake(&self, conn: Conn) -> io::Result<Io> {
        let acceptor = tokio_rustls::TlsAcceptor::from(self.config());
        let stream = acceptor.accept(conn).await?;
        Ok(Io::Tls(Box::new(stream)))
    }
}

impl std::fmt::Debug for TlsAcceptor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsAcceptor")
            .field("side", &self.side)
            .finish_non_exhaustive()
    }
}

/// The connections of `conns` (accepted within the cap, each with its
/// deadlines) after their handshakes, for the gRPC server: a task takes them and
/// starts one task per handshake; finished handshakes come out in the
/// order they finish. A failed handshake (refused certificate, plain text,
/// the deadline) is counted in `failures` and logged at most once a second
/// under the listener's `name`. Dropping the stream drops `conns` (for a
/// listener's, it stops accepting and closes the listening socket).
pub fn handshaken(
    conns: impl Stream<Item = Conn> + Send + 'static,
    name: &'static str,
    acceptor: TlsAcceptor,
    failures: Counter,
) -> impl Stream<Item = Io> + Send + 'static {
    // Unbounded, yet bounded by the connection cap: every item holds a permit.
    let (tx, rx) = mpsc::unbounded_channel::<Io>();
    let log = Arc::new(LogGate::new());
    let task = tokio::spawn(async move {
        let mut conns = std::pin::pin!(conns);
        loop {
            let conn = tokio::select! {
                conn = conns.next() => match conn {
                    Some(conn) => conn,
                    None => return,
                },
                () = tx.closed() => return,
            };
            let tx = tx.clone();
            let acceptor = acceptor.clone();
            let failures = failures.clone();
            let log = log.clone();
            tokio::spawn(async move {
                match acceptor.handshake(conn).await {
                    Ok(io) => {
                        let _ = tx.send(io);
                    }
                    Err(err) => handshake_failed(name, &err, &failures, &log),
                }
            });
        }
    });
    let guard = AbortOnDropHandle::new(task);
    tokio_stream::wrappers::UnboundedReceiverStream::new(rx).map(move |io| {
        let _owned = &guard;
        io
    })
}

/// Counts and logs (at most once a second) a failed handshake.
pub(crate) fn handshake_failed(
    listener: &'static str,
    err: &io::Error,
    failures: &Counter,
    log: &LogGate,
) {
    failures.inc();
    if let Some(suppressed) = log.admit() {
        tracing::info!(listener, suppressed, "tls handshake failed: {err}");
    }
}

// === impl TlsReloadGuard ===

impl TlsReloadGuard {
    pub fn is_running(&self) -> bool {
        !self.task.is_finished()
    }
}

impl Drop for TlsReloadGuard {
    fn drop(&mut self) {
        self.task.abort();
    }
}

// === impl TlsFileStamps ===

impl TlsFileStamps {
    fn of(files: &TlsFiles) -> TlsFileStamps {
        use std::os::unix::fs::MetadataExt;
        let paths = [
            Some(&files.cert),
            Some(&files.key),
            files.client_ca.as_ref(),
        ];
        TlsFileStamps(
            paths
                .into_iter()
                .flatten()
                .map(|path| {
                    let meta = std::fs::metadata(path).ok()?;
                    Some((meta.modified().ok()?, meta.len(), meta.ino()))
                })
                .collect(),
        )
    }
}

// === impl Io ===

impl Io {
    fn conn(&self) -> &Conn {
        match self {
            Io::Plain(conn) => conn,
            Io::Tls(stream) => stream.get_ref().0,
        }
    }

    /// The connection's watchdog (see [`Conn::watchdog`]).
    pub fn watchdog(&self) -> Arc<crate::transport::listener::Watchdog> {
        self.conn().watchdog()
    }
}

impl Connected for Io {
    type ConnectInfo = ConnInfo;

    fn connect_info(&self) -> ConnInfo {
        self.conn().connect_info()
    }
}

impl AsyncRead for Io {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Io::Plain(conn) => Pin::new(conn).poll_read(cx, buf),
            Io::Tls(stream) => Pin::new(stream.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Io {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Io::Plain(conn) => Pin::new(conn).poll_write(cx, buf),
            Io::Tls(stream) => Pin::new(stream.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Io::Plain(conn) => Pin::new(conn).poll_write_vectored(cx, bufs),
            Io::Tls(stream) => Pin::new(stream.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Io::Plain(conn) => conn.is_write_vectored(),
            Io::Tls(stream) => stream.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Io::Plain(conn) => Pin::new(conn).poll_flush(cx),
            Io::Tls(stream) => Pin::new(stream.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Io::Plain(conn) => Pin::new(conn).poll_shutdown(cx),
            Io::Tls(stream) => Pin::new(stream.as_mut()).poll_shutdown(cx),
        }
    }
}
