//! Runtime support for `#[lockable]`; not a public API.
