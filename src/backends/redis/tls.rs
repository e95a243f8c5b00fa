//! TLS to Redis beyond what a `rediss://` URL says: whom to trust, the
//! client certificate, verification; for a single server, Sentinel's
//! master and every Cluster node alike.
//!
//! Invariant: certificates are read and checked when the settings are,
//! so a bad file is a start-up error, never a connection that cannot be
//! made; and any TLS setting needs `rediss://`.

use std::path::PathBuf;
use std::sync::Arc;

use redis::{ConnectionAddr, ConnectionInfo, TlsCertificates};

use crate::backends::Error;
use crate::pem;

/// TLS to Redis beyond what a `rediss://` URL says: whom to trust, the
/// client certificate, verification. Any of it needs `rediss://`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RedisTls {
    /// Trust the CA certificates in this PEM file instead of the built-in
    /// web roots.
    pub ca: Option<PathBuf>,
    /// Client certificate (PEM chain) for servers that ask for one
    /// (`tls-auth-clients yes`); comes with `client_key`.
    pub client_cert: Option<PathBuf>,
    pub client_key: Option<PathBuf>,
    /// Accept any server certificate: no verification at all.
    pub insecure: bool,
    /// Verify the server's certificate chain but not the name in it.
    pub skip_hostname_verification: bool,
}

impl RedisTls {
    /// Whether anything is asked of TLS.
    pub fn is_set(&self) -> bool {
        *self != RedisTls::default()
    }

    /// The CA and client certificate the redis client is built with, read
    /// (and checked) from their files now; `None` when neither is given.
    pub(super) fn certificates(&self) -> Result<Option<TlsCertificates>, Error> {
        let failed = |err: pem::Error| Error::Protocol(format!("redis tls: {err}"));
        let client_tls = match (&self.client_cert, &self.client_key) {
            (None, None) => None,
            (Some(cert), Some(key)) => {
                let client_cert = pem::read(cert).map_err(failed)?;
                let chain = pem::certificates_in(cert, &client_cert).map_err(failed)?;
                let client_key = pem::read(key).map_err(failed)?;
                let key_der = pem::private_key_in(key, &client_key).map_err(failed)?;
                usable_client_certificate(chain, key_der).map_err(|err| {
                    Error::Protocol(format!(
                        "redis tls: {} and {} do not make a usable client certificate: {err}",
                        cert.display(),
                        key.display()
                    ))
                })?;
                Some(redis::ClientTlsConfig {
                    client_cert,
                    client_key,
                })
            }
            (Some(_), None) | (None, Some(_)) => {
                return Err(Error::Protocol(
                    "a redis client certificate and its key come together".into(),
                ));
            }
        };
        let root_cert = match &self.ca {
            Some(path) => {
                let text = pem::read(path).map_err(failed)?;
                pem::certificates_in(path, &text).map_err(failed)?;
                Some(text)
            }
            None => None,
        };
        if client_tls.is_none() && root_cert.is_none() {
            return Ok(None);
        }
        Ok(Some(TlsCertificates {
            client_tls,
            root_cert,
        }))
    }

    /// `info` with these settings; refused unless it is TLS (`rediss://`)
    /// when any is given.
    pub(super) fn apply(
        &self,
        info: ConnectionInfo,
        redacted_url: &str,
    ) -> Result<ConnectionInfo, Error> {
        if !self.is_set() {
            return Ok(info);
        }
        if !matches!(info.addr(), ConnectionAddr::TcpTls { .. }) {
            return Err(Error::Protocol(format!(
                "redis tls settings need a rediss:// url, not {redacted_url}"
            )));
        }
        let info = match self.certificates()? {
            Some(certs) => redis::Client::build_with_tls(info, certs)
                .map_err(|err| Error::Protocol(format!("redis tls: {err}")))?
                .get_connection_info()
                .clone(),
            None => info,
        };
        let mut addr = info.addr().clone();
        if let ConnectionAddr::TcpTls { insecure, .. } = &mut addr {
            *insecure |= self.insecure;
        }
        if self.skip_hostname_verification {
            addr.set_danger_accept_invalid_hostnames(true);
        }
        Ok(info.set_addr(addr))
    }
}

/// Whether `chain` and `key` make a client certificate rustls can present
/// (the key parses and is of a supported kind), so that a bad pair is a
/// start-up error rather than a connection that can never be made.
fn usable_client_certificate(
    chain: Vec<rustls::pki_types::CertificateDer<'static>>,
    key: rustls::pki_types::PrivateKeyDer<'static>,
) -> Result<(), rustls::Error> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_root_certificates(rustls::RootCertStore::empty())
        .with_client_auth_cert(chain, key)
        .map(drop)
}
