//! TLS material for `rediss://` connections: a CA to trust instead of the
//! system store, and a client certificate for servers with
//! `tls-auth-clients yes`.
//!
//! The bytes are checked when they are loaded (a PEM that does not parse is
//! an error naming its variable at start-up, not a handshake failure later).
//! With the `tls` feature off, TLS is not built in: loading material is an
//! error that says which feature to enable.

use std::path::Path;

use crate::error::{Error, Result};

/// The `DLOCK_*` variable of the CA file.
pub(crate) const CA_FILE_VAR: &str = "DLOCK_REDIS_CA_FILE";
/// The `DLOCK_*` variable of the client certificate file.
pub(crate) const CLIENT_CERT_VAR: &str = "DLOCK_REDIS_CLIENT_CERT_FILE";
/// The `DLOCK_*` variable of the client key file.
pub(crate) const CLIENT_KEY_VAR: &str = "DLOCK_REDIS_CLIENT_KEY_FILE";

/// What to say when TLS is asked for but not compiled in.
#[cfg(not(feature = "tls"))]
pub(crate) const NOT_BUILT_IN: &str =
    "TLS is not built into this dlock: enable the `tls` feature of dlock-core (or of dlock-axum / dlock-examples, which forward it)";

/// TLS settings for every `rediss://` connection dlock makes (lock backend,
/// RedLock masters, idempotency store). Without them, `rediss://` verifies
/// the server against the system trust store.
///
/// ```no_run
/// # fn demo() -> dlock_core::Result<()> {
/// use dlock_core::RedisTls;
/// let tls = RedisTls::new()
///     .with_ca_file("/etc/redis/tls/ca.crt")?
///     .with_client_files("/etc/redis/tls/client.crt", "/etc/redis/tls/client.key")?;
/// # Ok(()) }
/// ```
#[derive(Clone, Default)]
pub struct RedisTls {
    ca_pem: Option<Vec<u8>>,
    client: Option<(Vec<u8>, Vec<u8>)>,
}

impl std::fmt::Debug for RedisTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print key material.
        f.debug_struct("RedisTls")
            .field("custom_ca", &self.ca_pem.is_some())
            .field("client_certificate", &self.client.is_some())
            .finish()
    }
}

impl RedisTls {
    /// No custom CA, no client certificate.
    pub fn new() -> Self {
        RedisTls::default()
    }

    /// Trusts the CA certificate(s) in this PEM (one or more `CERTIFICATE`
    /// blocks) instead of the system store.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] naming `DLOCK_REDIS_CA_FILE` when the PEM holds no
    /// certificate that parses, or when TLS is not built in.
    pub fn with_ca_pem(mut self, pem: impl Into<Vec<u8>>) -> Result<Self> {
        let pem = pem.into();
        check_ca(&pem).map_err(|reason| Error::config(CA_FILE_VAR, reason))?;
        self.ca_pem = Some(pem);
        Ok(self)
    }

    /// As [`with_ca_pem`](Self::with_ca_pem), reading the PEM from `path`.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] naming `DLOCK_REDIS_CA_FILE` when the file cannot
    /// be read or does not parse.
    pub fn with_ca_file(self, path: impl AsRef<Path>) -> Result<Self> {
        let pem = read(CA_FILE_VAR, path.as_ref())?;
        self.with_ca_pem(pem)
    }

    /// Presents this client certificate (PEM, chain allowed) and its private
    /// key (PEM, PKCS#8 `BEGIN PRIVATE KEY`) to servers that ask for one.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] naming `DLOCK_REDIS_CLIENT_KEY_FILE` when the pair
    /// does not parse, or when TLS is not built in.
    pub fn with_client_pem(mut self, cert_pem: impl Into<Vec<u8>>, key_pem: impl Into<Vec<u8>>) -> Result<Self> {
        let (cert, key) = (cert_pem.into(), key_pem.into());
        check_client(&cert, &key)?;
        self.client = Some((cert, key));
        Ok(self)
    }

    /// As [`with_client_pem`](Self::with_client_pem), reading both PEMs from files.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] naming the variable of the file that cannot be read
    /// or does not parse.
    pub fn with_client_files(self, cert: impl AsRef<Path>, key: impl AsRef<Path>) -> Result<Self> {
        let cert = read(CLIENT_CERT_VAR, cert.as_ref())?;
        let key = read(CLIENT_KEY_VAR, key.as_ref())?;
        self.with_client_pem(cert, key)
    }

    /// Whether a client certificate is set.
    pub fn has_client_certificate(&self) -> bool {
        self.client.is_some()
    }

    /// Whether a custom CA or a client certificate is set.
    pub fn is_custom(&self) -> bool {
        self.ca_pem.is_some() || self.client.is_some()
    }

    /// The material in the form redis-rs takes.
    #[cfg(feature = "tls")]
    pub(crate) fn certificates(&self) -> redis::TlsCertificates {
        redis::TlsCertificates {
            client_tls: self
                .client
                .as_ref()
                .map(|(cert, key)| redis::ClientTlsConfig { client_cert: cert.clone(), client_key: key.clone() }),
            root_cert: self.ca_pem.clone(),
        }
    }
}

fn read(var: &'static str, path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|e| Error::config(var, format!("cannot read `{}`: {e}", path.display())))
}

/// redis-rs parses the material when a client is built, so building one
/// for a placeholder address checks it exactly as a real connection will.
#[cfg(feature = "tls")]
fn parse(certs: redis::TlsCertificates) -> std::result::Result<(), String> {
    redis::Client::build_with_tls("rediss://127.0.0.1:1", certs).map(drop).map_err(|e| e.to_string())
}

#[cfg(feature = "tls")]
fn check_ca(pem: &[u8]) -> std::result::Result<(), String> {
    // The native-tls parser skips text that is not a PEM block; an empty
    // or unrelated file must not pass as "trust nothing special".
    if !pem.windows(27).any(|w| w == b"-----BEGIN CERTIFICATE-----") {
        return Err("no PEM `CERTIFICATE` block found (expected the CA certificate in PEM form)".into());
    }
    parse(redis::TlsCertificates { client_tls: None, root_cert: Some(pem.to_vec()) })
        .map_err(|e| format!("not a usable PEM CA certificate: {e}"))
}

#[cfg(feature = "tls")]
fn check_client(cert: &[u8], key: &[u8]) -> Result<()> {
    if !cert.windows(27).any(|w| w == b"-----BEGIN CERTIFICATE-----") {
        return Err(Error::config(CLIENT_CERT_VAR, "no PEM `CERTIFICATE` block found"));
    }
    parse(redis::TlsCertificates {
        client_tls: Some(redis::ClientTlsConfig { client_cert: cert.to_vec(), client_key: key.to_vec() }),
        root_cert: None,
    })
    .map_err(|e| {
        Error::config(
            CLIENT_KEY_VAR,
            format!("the client certificate and key do not form a usable pair (the key must be PEM PKCS#8, `BEGIN PRIVATE KEY`): {e}"),
        )
    })
}

#[cfg(not(feature = "tls"))]
fn check_ca(_pem: &[u8]) -> std::result::Result<(), String> {
    Err(NOT_BUILT_IN.into())
}

#[cfg(not(feature = "tls"))]
fn check_client(_cert: &[u8], _key: &[u8]) -> Result<()> {
    Err(Error::config(CLIENT_CERT_VAR, NOT_BUILT_IN))
}

/// Whether `url` asks for TLS (`rediss://`, `rediss+cluster://`).
pub(crate) fn is_tls_url(url: &str) -> bool {
    url.trim_start().to_ascii_lowercase().starts_with("rediss")
}

/// Refuses a TLS URL, naming `var`, when TLS is not built in: a start-up
/// error that says what to enable, rather than a URL error from redis-rs.
pub(crate) fn check_url_supported(var: &'static str, url: &str) -> Result<()> {
    #[cfg(not(feature = "tls"))]
    if is_tls_url(url) {
        return Err(Error::config(var, format!("a `rediss://` URL asks for TLS, but {NOT_BUILT_IN}")));
    }
    #[cfg(feature = "tls")]
    let _ = (var, url);
    Ok(())
}

#[cfg(all(test, feature = "tls"))]
mod tests {
    use super::*;

    #[test]
    fn junk_is_refused_naming_the_variable() {
        for junk in [&b""[..], b"hello", b"-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n"] {
            let err = RedisTls::new().with_ca_pem(junk).expect_err("junk CA");
            assert!(err.is_misconfigured() && err.to_string().contains(CA_FILE_VAR), "{err}");
        }
        let err = RedisTls::new().with_ca_file("/nonexistent/ca.pem").expect_err("missing file");
        assert!(err.to_string().contains(CA_FILE_VAR) && err.to_string().contains("/nonexistent/ca.pem"), "{err}");
    }

    #[test]
    fn debug_shows_no_key_material() {
        let tls =
            RedisTls { ca_pem: Some(b"secret-ca".to_vec()), client: Some((b"c".to_vec(), b"secret-key".to_vec())) };
        let shown = format!("{tls:?}");
        assert!(!shown.contains("secret"), "{shown}");
    }
}

#[cfg(all(test, not(feature = "tls")))]
mod tests {
    use super::*;

    #[test]
    fn material_without_the_feature_names_the_feature() {
        let err = RedisTls::new().with_ca_pem(&b"-----BEGIN CERTIFICATE-----"[..]).expect_err("not built in");
        assert!(err.to_string().contains(CA_FILE_VAR) && err.to_string().contains("`tls` feature"), "{err}");
    }
}
