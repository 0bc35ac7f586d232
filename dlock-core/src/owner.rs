//! Owner tokens: who holds a lock.

use std::fmt;

use crate::error::{Error, Result};

/// The identity of a lock holder: 128 bits from the operating system's CSPRNG,
/// written as 32 hex digits.
///
/// Every acquire without an explicit owner gets a fresh one. Pass the same
/// owner to nested acquires of the same key to make them reentrant (the HTTP
/// layer uses one owner per request).
///
/// ```
/// use dlock_core::Owner;
/// let a = Owner::random().unwrap();
/// let b = Owner::random().unwrap();
/// assert_ne!(a, b);
/// assert_eq!(a.as_str().len(), 32);
/// ```
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Owner(String);

impl Owner {
    /// A fresh owner from the OS random source.
    ///
    /// # Errors
    ///
    /// [`Error::Backend`] when the OS random source fails (it does not on any
    /// supported platform, but a lock must never fall back to weak tokens).
    pub fn random() -> Result<Self> {
        Ok(Owner(random_hex::<16>()?))
    }

    /// The token as sent to the backend.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// `N` random bytes from the OS CSPRNG as lower-case hex.
pub(crate) fn random_hex<const N: usize>() -> Result<String> {
    let mut bytes = [0u8; N];
    getrandom::fill(&mut bytes)
        .map_err(|e| Error::backend("os-random", format!("OS random source failed: {e}")))?;
    let mut s = String::with_capacity(N * 2);
    for b in bytes {
        s.push(hex(b >> 4));
        s.push(hex(b & 0xf));
    }
    Ok(s)
}

fn hex(n: u8) -> char {
    char::from(if n < 10 { b'0' + n } else { b'a' + n - 10 })
}

impl fmt::Display for Owner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for Owner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Only a prefix: the full token lets anyone holding it release the lock.
        write!(f, "Owner({}…)", &self.0[..8.min(self.0.len())])
    }
}
