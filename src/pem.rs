//! PEM files of certificates and keys (TLS on both servers, TLS to Redis),
//! read with errors that name the file and what is wrong, never quoting
//! what it holds: a key must not end up in a log line.

use std::io;
use std::path::{Path, PathBuf};

use rustls::pki_types::pem::{self, PemObject};
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// Why a PEM file could not be used; names the file only.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot read {}: {source}", path.display())]
    Read { path: PathBuf, source: io::Error },
    #[error("{}: {what}", path.display())]
    Invalid { path: PathBuf, what: &'static str },
}

/// The whole file.
pub fn read(path: &Path) -> Result<Vec<u8>, Error> {
    std::fs::read(path).map_err(|source| Error::Read {
        path: path.to_owned(),
        source,
    })
}

/// Every certificate in `text` (read from `path`); at least one.
pub fn certificates_in(path: &Path, text: &[u8]) -> Result<Vec<CertificateDer<'static>>, Error> {
    let certs = CertificateDer::pem_slice_iter(text)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|err| invalid(path, problem(&err)))?;
    if certs.is_empty() {
        return Err(invalid(
            path,
            "no certificate in it (a PEM CERTIFICATE block)",
        ));
    }
    Ok(certs)
}

/// The first private key in `text` (read from `path`).
pub fn private_key_in(path: &Path, text: &[u8]) -> Result<PrivateKeyDer<'static>, Error> {
    PrivateKeyDer::from_pem_slice(text).map_err(|err| {
        invalid(
            path,
            match err {
                pem::Error::NoItemsFound => {
                    "no private key in it (a PEM PRIVATE KEY, RSA PRIVATE KEY or EC PRIVATE KEY block)"
                }
                other => problem(&other),
            },
        )
    })
}

/// Every certificate in the file at `path`; at least one.
pub fn certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, Error> {
    certificates_in(path, &read(path)?)
}

/// The first private key in the file at `path`.
pub fn private_key(path: &Path) -> Result<PrivateKeyDer<'static>, Error> {
    private_key_in(path, &read(path)?)
}

fn invalid(path: &Path, what: &'static str) -> Error {
    Error::Invalid {
        path: path.to_owned(),
        what,
    }
}

/// What is wrong with a PEM file, without quoting it (the parser's own
/// messages may quote a line).
fn problem(err: &pem::Error) -> &'static str {
    match err {
        pem::Error::MissingSectionEnd { .. } => "malformed PEM: a section has no END line",
        pem::Error::IllegalSectionStart { .. } => "malformed PEM: a malformed BEGIN line",
        pem::Error::Base64Decode(_) => "malformed PEM: invalid base64",
        pem::Error::SectionTooLarge => "malformed PEM: a section is too large",
        _ => "malformed PEM",
    }
}

#[cfg(test)]
mod tests;
