//! ZooKeeper digest credentials: what `DLOCK_ZOOKEEPER_AUTH` holds.
//!
//! Not behind the `zookeeper` feature, unlike the backend that uses them:
//! the configuration reads and checks the variable in every build, and both
//! it and the backend take the type from here, so the backend never imports
//! the configuration.

use crate::error::{Error, Result};

/// Digest credentials for ZooKeeper (`DLOCK_ZOOKEEPER_AUTH=user:password`).
///
/// With them the ZooKeeper backend authenticates every session and creates
/// its nodes with the ACL "all rights to the creator's identity, none to
/// anyone else" (ZooKeeper's `CREATOR_ALL_ACL`), so a client without the
/// same credentials can neither delete a lock node (freeing a lock someone
/// holds) nor create or change one. Every instance sharing the locks must
/// use the same user and password. Its `Debug` hides the password.
///
/// ```
/// use dlock_core::ZooKeeperAuth;
/// let auth: ZooKeeperAuth = "orders:s3cret".parse().unwrap();
/// assert_eq!(auth.user(), "orders");
/// // The identity ZooKeeper puts in the nodes' ACLs (`digest` scheme).
/// assert_eq!(auth.digest_id(), "orders:JzXBb2C5hwnsnX7m8cr2OK2VyUI=");
/// assert!(!format!("{auth:?}").contains("s3cret"));
/// assert!("no-password".parse::<ZooKeeperAuth>().is_err());
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct ZooKeeperAuth {
    user: String,
    password: String,
}

impl ZooKeeperAuth {
    /// Credentials for ZooKeeper's `digest` scheme.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] naming `DLOCK_ZOOKEEPER_AUTH` when the user is empty
    /// or contains `:` (the digest scheme splits on the first one), or the
    /// password is empty.
    pub fn digest(user: impl Into<String>, password: impl Into<String>) -> Result<Self> {
        let (user, password) = (user.into(), password.into());
        if user.is_empty() || user.contains(':') {
            return Err(Error::config(AUTH_VAR, "needs `user:password` with a non-empty user (no `:` in it)"));
        }
        if password.is_empty() {
            return Err(Error::config(AUTH_VAR, "needs `user:password` with a non-empty password"));
        }
        Ok(ZooKeeperAuth { user, password })
    }

    /// The user name.
    pub fn user(&self) -> &str {
        &self.user
    }

    /// `user:password`, the bytes the `digest` scheme sends to the server.
    #[cfg_attr(not(feature = "zookeeper"), allow(dead_code))]
    pub(crate) fn credentials(&self) -> String {
        format!("{}:{}", self.user, self.password)
    }

    /// The identity the server derives from these credentials and lists in
    /// ACLs: `user:base64(sha1(user:password))`. An operator grants it with
    /// `setAcl /path digest:<this>:cdrwa`; it does not reveal the password
    /// (beyond allowing a guess to be checked offline).
    pub fn digest_id(&self) -> String {
        let hash = sha1_smol::Sha1::from(self.credentials()).digest().bytes();
        format!("{}:{}", self.user, base64(&hash))
    }
}

impl std::str::FromStr for ZooKeeperAuth {
    type Err = Error;

    /// Parses `user:password` (the password may contain `:`).
    fn from_str(s: &str) -> Result<Self> {
        match s.split_once(':') {
            Some((user, password)) => ZooKeeperAuth::digest(user, password),
            None => Err(Error::config(AUTH_VAR, "needs `user:password`")),
        }
    }
}

impl std::fmt::Debug for ZooKeeperAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ZooKeeperAuth")
            .field("scheme", &"digest")
            .field("user", &self.user)
            .field("password", &"***")
            .finish()
    }
}

pub(crate) const AUTH_VAR: &str = "DLOCK_ZOOKEEPER_AUTH";

/// Standard base64 with padding, for the 20-byte digest of a ZooKeeper
/// identity (not worth a dependency).
fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let n = chunk.iter().enumerate().fold(0u32, |n, (i, b)| n | u32::from(*b) << (16 - 8 * i));
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(char::from(ALPHABET[(n >> (18 - 6 * i) & 63) as usize]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// ZooKeeper's own digest (`DigestAuthenticationProvider.generateDigest`),
    /// checked against values computed outside this crate (Python's hashlib and
    /// base64); `zookeeper_acl.rs` checks it against a real server.
    #[test]
    fn digest_id_is_zookeepers() {
        let id = |s: &str| s.parse::<ZooKeeperAuth>().expect("valid").digest_id();
        assert_eq!(id("orders:s3cret"), "orders:JzXBb2C5hwnsnX7m8cr2OK2VyUI=");
        assert_eq!(id("super:adminsecret"), "super:GcMT0ijsx21yLyTWAWMqFV/azZE=");
        assert_eq!(base64(b""), "");
        assert_eq!(base64(b"f"), "Zg==");
        assert_eq!(base64(b"fo"), "Zm8=");
        assert_eq!(base64(b"foo"), "Zm9v");
    }
}
