//! Lock keys that cannot collide: `prefix:{name:part1:part2…}`, every part
//! escaped, so `("a:b", "c")` and `("a", "b:c")` differ. The braces are a
//! Redis Cluster hash tag, keeping a lock's companion keys in its slot.

use std::fmt;

use crate::error::{Error, Result};

/// The longest key dlock builds, in bytes. Longer keys are refused rather than
/// hashed, so two keys are equal exactly when their inputs are.
pub const MAX_KEY_LEN: usize = 1024;

/// Text for `None`: a `%` without two hex digits, which escaping never
/// produces, so it equals no string.
const NONE_PART: &str = "%N";

/// A fully built, escaped lock key.
///
/// ```
/// use dlock_core::LockKey;
/// let key = LockKey::builder("dlock", "order.create").part(42).part("tok:1").build().unwrap();
/// assert_eq!(key.as_str(), "dlock:{order.create:42:tok%3A1}");
/// ```
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LockKey {
    // Shared: a key is cloned several times per acquire.
    full: std::sync::Arc<str>,
}

impl LockKey {
    /// Starts a key under `prefix` (the namespace, `DLOCK_PREFIX`) for the lock
    /// called `name`.
    pub fn builder(prefix: &str, name: &str) -> KeyBuilder {
        let mut full = BUFFER.try_with(|b| std::mem::take(&mut *b.borrow_mut())).unwrap_or_default();
        full.clear();
        full.reserve(prefix.len() + name.len() + 16);
        full.push_str(prefix);
        full.push_str(":{");
        escape_into(name, &mut full);
        KeyBuilder { full }
    }

    /// A key from the text a backend stores it as (`prefix:{name:parts}`,
    /// as [`as_str`](Self::as_str) writes it and a listing returns it), for
    /// an operator who copied it from one.
    ///
    /// ```
    /// use dlock_core::LockKey;
    /// let key = LockKey::builder("dlock", "order.create").part("a:b").build()?;
    /// assert_eq!(LockKey::parse(key.as_str())?, key);
    /// assert!(LockKey::parse("dlock:order.create").is_err(), "no braces");
    /// # Ok::<(), dlock_core::Error>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::InvalidKey`] for text no builder makes.
    pub fn parse(text: &str) -> Result<LockKey> {
        let invalid = |why: &str| Error::InvalidKey(format!("`{}` is no lock key: {why}", KeyLogId(text)));
        if text.len() > MAX_KEY_LEN {
            return Err(invalid("longer than MAX_KEY_LEN"));
        }
        let (prefix, rest) = text.split_once(":{").ok_or_else(|| invalid("it has no `:{`"))?;
        validate_prefix(prefix).map_err(|e| invalid(&e.to_string()))?;
        let inner = rest.strip_suffix('}').ok_or_else(|| invalid("it does not end with `}`"))?;
        if inner.is_empty() || inner.contains(['{', '}']) || inner.starts_with(':') {
            return Err(invalid("its name is empty or holds a brace"));
        }
        Ok(LockKey { full: text.into() })
    }

    /// The key as stored in the backend.
    pub fn as_str(&self) -> &str {
        &self.full
    }

    /// The lock's name, as escaped in the key: `order.create` for
    /// `dlock:{order.create:42}`. Metrics label by it, never by the parts.
    ///
    /// ```
    /// use dlock_core::LockKey;
    /// let key = LockKey::builder("dlock", "order.create").part(42).build().unwrap();
    /// assert_eq!(key.name(), "order.create");
    /// ```
    pub fn name(&self) -> &str {
        name_of(&self.full)
    }

    /// The key as logs write it: the lock's name and a short hash of the
    /// whole key (`order.create#1a2b3c4d5e6f`), since parts are often
    /// request values. The hash is the same in every process; a guessable
    /// value (a small id) can still be found by hashing candidates.
    ///
    /// ```
    /// use dlock_core::LockKey;
    /// let key = LockKey::builder("dlock", "order.create").part("tok-secret").build().unwrap();
    /// let id = key.log_id().to_string();
    /// assert!(id.starts_with("order.create#") && !id.contains("secret"));
    /// assert_eq!(id.len(), "order.create#".len() + 12);
    /// ```
    pub fn log_id(&self) -> KeyLogId<'_> {
        KeyLogId(&self.full)
    }
}

/// A [`LockKey`] as logs write it; see [`LockKey::log_id`].
#[derive(Clone, Copy)]
pub struct KeyLogId<'a>(&'a str);

impl fmt::Display for KeyLogId<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = name_of(self.0);
        let digest = sha1_smol::Sha1::from(self.0).digest().to_string();
        write!(f, "{name}#{}", &digest[..12])
    }
}

/// The escaped name of a full key: from the first `{` to the first `:` or `}`.
fn name_of(full: &str) -> &str {
    let inner = full.split_once('{').map_or(full, |(_, rest)| rest);
    inner.split([':', '}']).next().unwrap_or_default()
}

impl fmt::Debug for KeyLogId<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never the key itself, whichever way it is formatted.
        fmt::Display::fmt(self, f)
    }
}

impl fmt::Display for LockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.full)
    }
}

impl fmt::Debug for LockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.full, f)
    }
}

/// Builds a [`LockKey`] part by part.
///
/// ```
/// use dlock_core::LockKey;
/// let none: Option<u32> = None;
/// let a = LockKey::builder("p", "n").part(none).build().unwrap();
/// let b = LockKey::builder("p", "n").part("None").build().unwrap();
/// assert_ne!(a, b);
/// ```
#[derive(Debug, Clone)]
pub struct KeyBuilder {
    full: String,
}

impl KeyBuilder {
    /// Appends one part.
    pub fn part(mut self, part: impl KeyPart) -> Self {
        self.push(part);
        self
    }

    /// Appends one part in place.
    pub fn push(&mut self, part: impl KeyPart) {
        self.full.push(':');
        part.write_part(&mut self.full);
    }

    /// Finishes the key.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidKey`] when the key is longer than [`MAX_KEY_LEN`] bytes.
    pub fn build(mut self) -> Result<LockKey> {
        self.full.push('}');
        if self.full.len() > MAX_KEY_LEN {
            return Err(Error::InvalidKey(format!(
                "key is {} bytes long, at most {MAX_KEY_LEN} are allowed",
                self.full.len()
            )));
        }
        Ok(LockKey { full: self.full.as_str().into() })
    }
}

thread_local! {
    /// The last key's text buffer on this thread, kept: one allocation a key.
    static BUFFER: std::cell::RefCell<String> = const { std::cell::RefCell::new(String::new()) };
}

/// Buffers longer than this are freed rather than kept.
const KEEP_BUFFER: usize = 4 * MAX_KEY_LEN;

impl Drop for KeyBuilder {
    fn drop(&mut self) {
        if self.full.capacity() <= KEEP_BUFFER {
            let full = std::mem::take(&mut self.full);
            // At thread exit the slot is gone; the buffer is then just freed.
            let _ = BUFFER.try_with(|b| {
                let mut kept = b.borrow_mut();
                if kept.capacity() < full.capacity() {
                    *kept = full;
                }
            });
        }
    }
}

/// A value that can be one part of a lock key.
///
/// Written as escaped text, for strings, integers, `bool`, `char`, IP
/// addresses, `uuid::Uuid` (feature `uuid`), references and smart pointers
/// to these, and `Option<T>` (`None` equals no string, not even `"None"`).
/// Equal texts are one part: `7` and `"7"` are the same. Implement it for
/// your own ids through [`escape_into`].
///
/// ```
/// use dlock_core::{KeyPart, escape_into};
/// struct Sku(String);
/// impl KeyPart for Sku {
///     fn write_part(&self, out: &mut String) { escape_into(&self.0, out) }
/// }
/// ```
pub trait KeyPart {
    /// Appends the escaped text of this part to `out`.
    fn write_part(&self, out: &mut String);
}

/// Appends `raw` to `out`, escaping `%`, `:`, `{`, `}`, `/` and control
/// characters as `%XX`. The mapping is injective and its output never
/// contains the separator.
pub fn escape_into(raw: &str, out: &mut String) {
    // Escaped characters are ASCII, so runs between them copy as slices.
    let mut start = 0;
    for (i, &b) in raw.as_bytes().iter().enumerate() {
        if matches!(b, b'%' | b':' | b'{' | b'}' | b'/' | 0..=0x1f | 0x7f) {
            out.push_str(&raw[start..i]);
            out.push('%');
            out.push(char::from(HEX_UPPER[usize::from(b >> 4)]));
            out.push(char::from(HEX_UPPER[usize::from(b & 0xf)]));
            start = i + 1;
        }
    }
    out.push_str(&raw[start..]);
}

const HEX_UPPER: &[u8; 16] = b"0123456789ABCDEF";

impl KeyPart for str {
    fn write_part(&self, out: &mut String) {
        escape_into(self, out)
    }
}

impl KeyPart for String {
    fn write_part(&self, out: &mut String) {
        escape_into(self, out)
    }
}

impl<T: KeyPart + ?Sized> KeyPart for &T {
    fn write_part(&self, out: &mut String) {
        (**self).write_part(out)
    }
}

impl<T: KeyPart> KeyPart for Option<T> {
    fn write_part(&self, out: &mut String) {
        match self {
            Some(v) => v.write_part(out),
            None => out.push_str(NONE_PART),
        }
    }
}

macro_rules! integer_part {
    ($($t:ty),*) => {$(
        impl KeyPart for $t {
            fn write_part(&self, out: &mut String) {
                // Digits and a sign need no escaping; itoa is `Display`'s text.
                out.push_str(itoa::Buffer::new().format(*self));
            }
        }
    )*};
}
integer_part!(u8, u16, u32, u64, u128, usize, i8, i16, i32, i64, i128, isize);

impl KeyPart for bool {
    fn write_part(&self, out: &mut String) {
        out.push_str(if *self { "true" } else { "false" });
    }
}

impl KeyPart for char {
    fn write_part(&self, out: &mut String) {
        let mut buf = [0u8; 4];
        escape_into(self.encode_utf8(&mut buf), out)
    }
}

impl KeyPart for std::borrow::Cow<'_, str> {
    fn write_part(&self, out: &mut String) {
        escape_into(self, out)
    }
}

impl<T: KeyPart + ?Sized> KeyPart for Box<T> {
    fn write_part(&self, out: &mut String) {
        (**self).write_part(out)
    }
}

impl<T: KeyPart + ?Sized> KeyPart for std::rc::Rc<T> {
    fn write_part(&self, out: &mut String) {
        (**self).write_part(out)
    }
}

impl<T: KeyPart + ?Sized> KeyPart for std::sync::Arc<T> {
    fn write_part(&self, out: &mut String) {
        (**self).write_part(out)
    }
}

macro_rules! display_part {
    ($($t:ty),*) => {$(
        impl KeyPart for $t {
            fn write_part(&self, out: &mut String) {
                // Through `escape_into`: an IPv6 address holds the separator.
                escape_into(&self.to_string(), out)
            }
        }
    )*};
}
display_part!(std::net::IpAddr, std::net::Ipv4Addr, std::net::Ipv6Addr);

/// ```
/// # #[cfg(feature = "uuid")] {
/// let id = uuid::Uuid::from_u128(0x67e55044_10b1_426f_9247_bb680e5fe0c8);
/// let key = dlock_core::LockKey::builder("dlock", "order").part(id).build().unwrap();
/// assert_eq!(key.as_str(), "dlock:{order:67e55044-10b1-426f-9247-bb680e5fe0c8}");
/// # }
/// ```
#[cfg(feature = "uuid")]
impl KeyPart for uuid::Uuid {
    fn write_part(&self, out: &mut String) {
        // Hex digits and hyphens: nothing to escape.
        out.push_str(self.hyphenated().encode_lower(&mut uuid::Uuid::encode_buffer()))
    }
}

/// Checks a key namespace (`DLOCK_PREFIX`): no braces (the hash tag) and
/// no `/` (ZooKeeper paths).
pub(crate) fn validate_prefix(prefix: &str) -> Result<()> {
    if prefix.is_empty() {
        return Err(Error::config("DLOCK_PREFIX", "must not be empty"));
    }
    if let Some(c) = prefix.chars().find(|c| matches!(c, '{' | '}' | '/') || c.is_whitespace() || c.is_control()) {
        return Err(Error::config(
            "DLOCK_PREFIX",
            format!("must not contain {c:?} (braces form the Redis hash tag, `/` separates ZooKeeper paths)"),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn foreign_parts_are_their_escaped_text() {
        let text = |p: &dyn Fn(&mut String)| {
            let mut s = String::new();
            p(&mut s);
            s
        };
        let v6: std::net::IpAddr = "::1".parse().expect("ip");
        assert_eq!(text(&|s| v6.write_part(s)), "%3A%3A1");
        assert_eq!(text(&|s| std::net::Ipv4Addr::LOCALHOST.write_part(s)), "127.0.0.1");
        assert_eq!(text(&|s| std::borrow::Cow::Borrowed("a:b").write_part(s)), "a%3Ab");
        assert_eq!(text(&|s| std::sync::Arc::<str>::from("a/b").write_part(s)), "a%2Fb");
        assert_eq!(text(&|s| Box::new(7u8).write_part(s)), "7");
        #[cfg(feature = "uuid")]
        assert_eq!(
            text(&|s| uuid::Uuid::from_u128(0x67e55044_10b1_426f_9247_bb680e5fe0c8).write_part(s)),
            "67e55044-10b1-426f-9247-bb680e5fe0c8"
        );
    }

    fn key(parts: &[Option<String>]) -> LockKey {
        let mut b = LockKey::builder("dlock", "n");
        for p in parts {
            b.push(p.as_deref());
        }
        b.build().expect("short key")
    }

    #[test]
    fn separator_in_values_does_not_collide() {
        let a = key(&[Some("a:b".into()), Some("c".into())]);
        let b = key(&[Some("a".into()), Some("b:c".into())]);
        assert_ne!(a, b);
        assert_eq!(a.as_str(), "dlock:{n:a%3Ab:c}");
    }

    #[test]
    fn none_is_not_a_string() {
        for s in ["None", "null", "", "%N", "%4E"] {
            assert_ne!(key(&[None]), key(&[Some(s.into())]), "{s}");
        }
    }

    #[test]
    fn braces_cannot_break_the_hash_tag() {
        let k = key(&[Some("}{x".into())]);
        assert_eq!(k.as_str().matches('{').count(), 1);
        assert_eq!(k.as_str().matches('}').count(), 1);
    }

    #[test]
    fn too_long_is_an_error() {
        let long = "x".repeat(MAX_KEY_LEN);
        let err = LockKey::builder("p", "n").part(long.as_str()).build().expect_err("too long");
        assert!(err.is_misconfigured());
    }

    fn parts() -> impl Strategy<Value = Vec<Option<String>>> {
        // A small alphabet full of the characters that matter makes collisions
        // likely if escaping were not injective.
        let atom = prop::option::weighted(0.85, "[:%{}/a0N\\x00é]{0,6}");
        prop::collection::vec(atom, 0..5)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(20_000))]
        #[test]
        fn distinct_tuples_give_distinct_keys(a in parts(), b in parts()) {
            prop_assume!(a != b);
            prop_assert_ne!(key(&a), key(&b));
        }

        #[test]
        fn parts_never_contain_the_separator(s in any::<String>()) {
            let mut out = String::new();
            escape_into(&s, &mut out);
            let clean = !out.contains(':') && !out.contains('{') && !out.contains('}');
            prop_assert!(clean, "escaped part {:?} contains a separator or brace", out);
        }

        /// Keys stay the same from release to release: the escaping is the
        /// character-by-character definition, whatever shortcut it takes.
        #[test]
        fn escaping_follows_its_definition(s in "[:%{}/a\\x00-\\x1f\\x7fé中]{0,12}|\\PC*") {
            let mut reference = String::new();
            for c in s.chars() {
                match c {
                    '%' | ':' | '{' | '}' | '/' | '\u{0}'..='\u{1f}' | '\u{7f}' => {
                        reference.push_str(&format!("%{:02X}", c as u32));
                    }
                    _ => reference.push(c),
                }
            }
            let mut out = String::new();
            escape_into(&s, &mut out);
            prop_assert_eq!(out, reference);
        }

        #[test]
        fn integer_parts_are_their_display_text(u in any::<u64>(), i in any::<i64>(), w in any::<i128>()) {
            let key = LockKey::builder("p", "n").part(u).part(i).part(w).part(true).build().expect("key");
            prop_assert_eq!(key.as_str(), format!("p:{{n:{u}:{i}:{w}:true}}"));
        }
    }
}
