//! Certificates made at run time with rcgen: a CA, server certificates for
//! 127.0.0.1 and localhost, client certificates; written as PEM files, and
//! the rustls configs of TLS clients trusting a CA.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// A certificate authority that signs server and client certificates.
pub struct Ca {
    issuer: CertifiedIssuer<'static, KeyPair>,
}

/// A certificate and its key, as PEM text.
#[derive(Clone)]
pub struct Issued {
    pub cert: String,
    pub key: String,
}

/// PEM files of a certificate and key in a directory.
#[derive(Clone)]
pub struct Files {
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl Ca {
    /// A new CA named `name`.
    pub fn new(name: &str) -> Ca {
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("params");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let key = KeyPair::generate().expect("ca key");
        Ca {
            issuer: CertifiedIssuer::self_signed(params, key).expect("ca certificate"),
        }
    }

    /// The CA certificate, PEM.
    pub fn pem(&self) -> String {
        self.issuer.pem()
    }

    /// Writes the CA certificate to `dir/name`.
    pub fn write(&self, dir: &Path, name: &str) -> PathBuf {
        let path = dir.join(name);
        std::fs::write(&path, self.pem()).expect("write ca");
        path
    }

    /// A server certificate for 127.0.0.1 and localhost.
    pub fn server(&self) -> Issued {
        self.issue(
            vec!["127.0.0.1".to_owned(), "localhost".to_owned()],
            "server",
            ExtendedKeyUsagePurpose::ServerAuth,
        )
    }

    /// A certificate for 127.0.0.1 usable as server and client, as the
    /// nodes of a Redis Cluster over TLS use theirs on the cluster bus.
    pub fn node(&self) -> Issued {
        let mut params =
            CertificateParams::new(vec!["127.0.0.1".to_owned(), "localhost".to_owned()])
                .expect("params");
        params.distinguished_name.push(DnType::CommonName, "node");
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        let key = KeyPair::generate().expect("key");
        let cert = params.signed_by(&key, &self.issuer).expect("sign");
        Issued {
            cert: cert.pem(),
            key: key.serialize_pem(),
        }
    }

    /// A server certificate for the DNS name `name` only.
    pub fn server_named(&self, name: &str) -> Issued {
        self.issue(
            vec![name.to_owned()],
            name,
            ExtendedKeyUsagePurpose::ServerAuth,
        )
    }

    /// A client certificate carrying the DNS name `name`.
    pub fn client(&self, name: &str) -> Issued {
        self.issue(
            vec![name.to_owned()],
            name,
            ExtendedKeyUsagePurpose::ClientAuth,
        )
    }

    fn issue(&self, names: Vec<String>, cn: &str, usage: ExtendedKeyUsagePurpose) -> Issued {
        let mut params = CertificateParams::new(names).expect("params");
        params.distinguished_name.push(DnType::CommonName, cn);
        params.extended_key_usages = vec![usage];
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        let key = KeyPair::generate().expect("key");
        let cert = params.signed_by(&key, &self.issuer).expect("sign");
        Issued {
            cert: cert.pem(),
            key: key.serialize_pem(),
        }
    }
}

impl Issued {
    /// Writes `<prefix>.crt` and `<prefix>.key` into `dir`.
    pub fn write(&self, dir: &Path, prefix: &str) -> Files {
        let files = Files {
            cert: dir.join(format!("{prefix}.crt")),
            key: dir.join(format!("{prefix}.key")),
        };
        std::fs::write(&files.cert, &self.cert).expect("write cert");
        std::fs::write(&files.key, &self.key).expect("write key");
        files
    }

    fn chain(&self) -> Vec<CertificateDer<'static>> {
        CertificateDer::pem_slice_iter(self.cert.as_bytes())
            .collect::<Result<_, _>>()
            .expect("certificate pem")
    }

    fn private_key(&self) -> PrivateKeyDer<'static> {
        PrivateKeyDer::from_pem_slice(self.key.as_bytes()).expect("key pem")
    }
}

impl Files {
    pub fn cert(&self) -> &str {
        self.cert.to_str().expect("utf-8 path")
    }

    pub fn key(&self) -> &str {
        self.key.to_str().expect("utf-8 path")
    }
}

/// A TLS client config trusting `ca` only, presenting `identity` if given,
/// offering the ALPN protocols `alpn` (none if empty).
pub fn client_config(
    ca: &Ca,
    identity: Option<&Issued>,
    alpn: &[&[u8]],
) -> Arc<rustls::ClientConfig> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(ca.pem().as_bytes()) {
        roots.add(cert.expect("ca pem")).expect("trust anchor");
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("protocol versions")
        .with_root_certificates(roots);
    let mut config = match identity {
        Some(identity) => builder
            .with_client_auth_cert(identity.chain(), identity.private_key())
            .expect("client certificate"),
        None => builder.with_no_client_auth(),
    };
    config.alpn_protocols = alpn.iter().map(|it| it.to_vec()).collect();
    Arc::new(config)
}
