//! Redis's errors as dlock's: [`redis_error`] for a command that failed
//! (marked "may have run" when it was sent and its answer lost),
//! [`lost_connection`] for a connection that broke, and [`connect_error`]
//! for a start-up that failed (refused credentials and TLS trouble are the
//! configuration's).

use super::options::RedisOptions;
use super::tls::{is_tls_url, RedisTls, CA_FILE_VAR, CLIENT_CERT_VAR};
use crate::error::Error;
use crate::redact::redact;

/// A wrong user or password is a configuration error naming the variable
/// (never the password); anything else as [`redis_error`].
pub(super) fn connect_error(url: &str, e: redis::RedisError, options: &RedisOptions) -> Error {
    if e.kind() == redis::ErrorKind::AuthenticationFailed || e.code() == Some("WRONGPASS") {
        return Error::config(
            "DLOCK_REDIS_URL",
            format!("Redis at {} refused the user or password in the URL ({:?})", redact(url), e.kind()),
        );
    }
    if is_tls_url(url) {
        if let Some(failure) = tls_failure(&e) {
            let (var, hint) = match failure {
                TlsFailure::Untrusted => (
                    CA_FILE_VAR,
                    "the server's certificate is not trusted or does not name this host: \
                     point DLOCK_REDIS_CA_FILE at the CA that signed it",
                ),
                TlsFailure::ClientCertificate => (
                    CLIENT_CERT_VAR,
                    "the server refused this client's certificate or wants one (`tls-auth-clients yes`): \
                     set DLOCK_REDIS_CLIENT_CERT_FILE and DLOCK_REDIS_CLIENT_KEY_FILE",
                ),
                TlsFailure::Other => (CA_FILE_VAR, "check the TLS set-up of client and server"),
            };
            return Error::config(var, format!("TLS handshake with {} failed: {hint} ({e})", redact(url)));
        }
        // With TLS 1.3 the server checks the client certificate after the
        // client considers the handshake done, and its alert is lost when it
        // resets the connection: all the client sees is the reset.
        let has_client_cert = options.custom_tls().is_some_and(RedisTls::has_client_certificate);
        if e.is_connection_dropped() && !e.is_connection_refusal() && !has_client_cert {
            return Error::Backend {
                backend: "redis",
                message: format!(
                    "{} closed the TLS connection right after the handshake; a server with `tls-auth-clients yes` does \
                     this to a client without a certificate: set DLOCK_REDIS_CLIENT_CERT_FILE and \
                     DLOCK_REDIS_CLIENT_KEY_FILE ({e})",
                    redact(url)
                ),
                source: Some(Box::new(e)),
            };
        }
    }
    redis_error(e)
}

enum TlsFailure {
    Untrusted,
    ClientCertificate,
    Other,
}

/// Sorts a TLS failure out of a connection error by its OpenSSL text (redis-rs
/// wraps the native-tls error without a kind of its own).
fn tls_failure(e: &redis::RedisError) -> Option<TlsFailure> {
    let text = e.to_string().to_ascii_lowercase();
    if text.contains("certificate verify failed")
        || text.contains("unable to get local issuer")
        || text.contains("self-signed certificate")
        || text.contains("hostname mismatch")
        || text.contains("ip address mismatch")
    {
        Some(TlsFailure::Untrusted)
    } else if text.contains("certificate required") || text.contains("bad certificate") || text.contains("unknown ca") {
        Some(TlsFailure::ClientCertificate)
    } else if text.contains("ssl") || text.contains("tls") || text.contains("handshake") {
        Some(TlsFailure::Other)
    } else {
        None
    }
}

/// The connection broke, refused or timed out (rather than the server
/// answering with an error): the server may be gone, restarted or failed over.
pub(crate) fn lost_connection(e: &redis::RedisError) -> bool {
    e.is_io_error() || e.is_connection_refusal() || e.is_connection_dropped() || e.is_timeout()
}

/// Whether a command that failed may still have run on the server: it was
/// sent and its answer was lost (a response timeout, a connection that
/// broke while it was in flight). Refused, or down before it was sent (the
/// link is reconnecting), it ran nothing.
fn may_have_run(e: &redis::RedisError) -> bool {
    let io = std::error::Error::source(e).and_then(|source| source.downcast_ref::<std::io::Error>());
    e.is_timeout()
        || io.is_some_and(|io| {
            matches!(
                io.kind(),
                std::io::ErrorKind::BrokenPipe
                    | std::io::ErrorKind::ConnectionReset
                    | std::io::ErrorKind::ConnectionAborted
                    | std::io::ErrorKind::UnexpectedEof
                    | std::io::ErrorKind::TimedOut
            )
        })
}

pub(crate) fn redis_error(e: redis::RedisError) -> Error {
    let message = if e.code() == Some("OOM") || e.to_string().contains("OOM command not allowed") {
        format!(
            "Redis is out of memory (maxmemory reached under `noeviction`): no new locks until memory is freed; \
             held locks stay held and can be released: {e}"
        )
    } else if e.is_timeout() {
        format!("Redis did not answer in time: {e}")
    } else if lost_connection(&e) {
        format!("cannot reach Redis: {e}")
    } else {
        e.to_string()
    };
    let unanswered = may_have_run(&e);
    let error = Error::Backend { backend: "redis", message, source: Some(Box::new(e)) };
    match unanswered {
        true => error.may_have_run(),
        false => error,
    }
}
