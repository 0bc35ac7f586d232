//! Owner tokens: who holds a lock.

use std::cell::RefCell;
use std::fmt;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::error::{Error, Result};

/// The identity of a lock holder: 128 bits from a CSPRNG, written as 32 hex
/// digits.
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
pub struct Owner(
    // The digits themselves, not a pointer to them: an owner is copied into
    // the guard, the watchdog and the backend's table for every acquire, and
    // a copy of 32 bytes costs less than an allocation and a shared count.
    [u8; 32],
);

impl Owner {
    /// A fresh owner from a CSPRNG (ChaCha12 per thread, seeded and reseeded
    /// from the operating system's random source).
    ///
    /// # Errors
    ///
    /// [`Error::Backend`] when the OS random source fails (it does not on any
    /// supported platform, but a lock must never fall back to weak tokens).
    pub fn random() -> Result<Self> {
        let mut digits = [0u8; 32];
        write_hex(&random_bytes::<16>()?, &mut digits);
        Ok(Owner(digits))
    }

    /// The owner whose token a backend stored as `text` (32 hex digits),
    /// for an operator's forced release; `None` for any other text.
    #[cfg_attr(not(any(feature = "redis", feature = "postgres")), allow(dead_code))]
    pub(crate) fn from_token(text: &str) -> Option<Owner> {
        let digits: [u8; 32] = text.as_bytes().try_into().ok()?;
        digits.iter().all(u8::is_ascii_hexdigit).then_some(Owner(digits))
    }

    /// The token as sent to the backend.
    pub fn as_str(&self) -> &str {
        // Only ASCII hex digits are ever stored, so this never falls back.
        std::str::from_utf8(&self.0).unwrap_or_default()
    }
}

/// Draws per thread between reseeds from the OS (`docs/performance.md`).
const RESEED_AFTER: u32 = 4096;

thread_local! {
    static RNG: RefCell<Option<(StdRng, u32)>> = const { RefCell::new(None) };
}

/// `N` random bytes from a per-thread ChaCha12 CSPRNG seeded from the OS,
/// as lower-case hex. (A forked child would share the stream, but a tokio
/// runtime does not survive a fork.)
pub(crate) fn random_hex<const N: usize>() -> Result<String> {
    let bytes = random_bytes::<N>()?;
    let mut digits = vec![0u8; 2 * N];
    write_hex(&bytes, &mut digits);
    String::from_utf8(digits).map_err(|e| Error::backend("os-random", e.to_string()))
}

/// `N` bytes from the per-thread CSPRNG of [`random_hex`].
fn random_bytes<const N: usize>() -> Result<[u8; N]> {
    let mut bytes = [0u8; N];
    RNG.with(|cell| {
        let mut slot = cell.borrow_mut();
        let rng = match slot.as_mut() {
            Some((rng, draws)) if *draws < RESEED_AFTER => {
                *draws += 1;
                rng
            }
            _ => {
                let mut seed = [0u8; 32];
                getrandom::fill(&mut seed)
                    .map_err(|e| Error::backend("os-random", format!("OS random source failed: {e}")))?;
                &mut slot.insert((StdRng::from_seed(seed), 1)).0
            }
        };
        rng.fill_bytes(&mut bytes);
        Ok::<_, Error>(())
    })?;
    Ok(bytes)
}

/// Writes `bytes` as lower-case hex digits, two per byte, into `out`
/// (twice as long).
fn write_hex(bytes: &[u8], out: &mut [u8]) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    for (pair, b) in out.chunks_exact_mut(2).zip(bytes) {
        pair[0] = DIGITS[usize::from(b >> 4)];
        pair[1] = DIGITS[usize::from(b & 0xf)];
    }
}

impl fmt::Display for Owner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl fmt::Debug for Owner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Only a prefix: the full token lets anyone holding it release the lock.
        write!(f, "Owner({}…)", &self.as_str()[..8])
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::{random_hex, RESEED_AFTER};

    /// Across reseeds and threads no token repeats (each thread's generator
    /// has its own OS seed).
    #[test]
    fn tokens_do_not_repeat_across_reseeds_and_threads() {
        let draws = RESEED_AFTER as usize * 2 + 10;
        let per_thread = move |_| (0..draws).map(|_| random_hex::<16>().expect("random")).collect::<Vec<_>>();
        let threads: Vec<_> = (0..4).map(|i| std::thread::spawn(move || per_thread(i))).collect();
        let mut seen = HashSet::new();
        for t in threads {
            for token in t.join().expect("thread") {
                assert_eq!(token.len(), 32);
                assert!(seen.insert(token), "a token repeated");
            }
        }
        assert_eq!(seen.len(), draws * 4);
    }
}
