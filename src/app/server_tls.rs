//! TLS of both servers: the files the `--tls-*` flags name, checked for
//! consistency and loaded, their reloads counted. Invariant: a flag that
//! asks for TLS (or client certificates) that cannot be given stops the
//! start; nothing is served in plain text instead.

use std::sync::Arc;

use crate::metrics::Metrics;
use crate::transport::tls::{Tls, TlsFiles};

use super::{Aborted, TlsFlags};

/// The TLS files the flags name; `None` without TLS. A key without a
/// certificate (or the reverse), or a client CA without both, is refused.
pub(super) fn tls_files(flags: &TlsFlags) -> Result<Option<TlsFiles>, String> {
    let (cert, key) = match (&flags.cert, &flags.key) {
        (Some(cert), Some(key)) => (cert.clone(), key.clone()),
        (Some(_), None) => return Err("--tls-cert needs --tls-key (its private key)".to_owned()),
        (None, Some(_)) => return Err("--tls-key needs --tls-cert (its certificate)".to_owned()),
        (None, None) => {
            if flags.client_ca.is_some() || flags.client_san.is_some() {
                return Err(
                    "--tls-client-ca and --tls-client-san need --tls-cert and --tls-key: \
                     client certificates are asked for only over TLS"
                        .to_owned(),
                );
            }
            return Ok(None);
        }
    };
    if flags.client_san.is_some() && flags.client_ca.is_none() {
        return Err(
            "--tls-client-san needs --tls-client-ca: only a verified client certificate's \
             names can be trusted"
                .to_owned(),
        );
    }
    Ok(Some(TlsFiles {
        cert,
        key,
        client_ca: flags.client_ca.clone(),
        client_san: flags.client_san.clone(),
    }))
}

/// Loads the TLS files (an error names the file); their reloads are counted
/// in `metrics`.
pub(super) fn load_tls(files: TlsFiles, metrics: &Arc<Metrics>) -> Result<Arc<Tls>, Aborted> {
    let tls = Tls::load(files).map_err(|err| Aborted::Failed(format!("tls: {err}")))?;
    metrics.enable_tls_reloads();
    let metrics = metrics.clone();
    Ok(Arc::new(
        tls.with_observer(move |ok| metrics.record_tls_reload(ok)),
    ))
}
