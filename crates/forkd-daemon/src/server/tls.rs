//! The TCP listener's TLS (rustls with the ring provider).

use crate::config::TlsFiles;
use anyhow::{Context, Result};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use std::sync::Arc;

/// A TLS acceptor from PEM certificate-chain and key files.
pub fn acceptor(files: &TlsFiles) -> Result<tokio_rustls::TlsAcceptor> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&files.cert)
        .with_context(|| format!("reading {}", files.cert.display()))?
        .collect::<Result<_, _>>()
        .with_context(|| format!("{} is not a PEM certificate chain", files.cert.display()))?;
    if certs.is_empty() {
        anyhow::bail!("{} holds no certificate", files.cert.display());
    }
    let key = PrivateKeyDer::from_pem_file(&files.key)
        .with_context(|| format!("{} is not a PEM private key", files.key.display()))?;
    let config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .context("TLS protocol versions")?
    .with_no_client_auth()
    .with_single_cert(certs, key)
    .context("the TLS certificate and key do not make a usable pair")?;
    Ok(tokio_rustls::TlsAcceptor::from(Arc::new(config)))
}
