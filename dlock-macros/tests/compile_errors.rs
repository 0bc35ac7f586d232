//! The compile errors of `#[lockable]`, each pointing at the offending
//! token, each alone: the handler is emitted unchanged beside the error, so
//! nothing else fails. And handlers that use it well compile.
//!
//! The `.stderr` files hold only dlock's own messages and their spans (no
//! warnings, no notes of rustc's lints, whose wording changes between
//! toolchains), so they hold on every stable toolchain CI uses.
//!
//! Here rather than in dlock-axum: trybuild builds the crate under test with
//! the features of the test run, and `--all-features` on dlock-axum would
//! build every backend's client (sqlx, ZooKeeper, TLS) once more for it.
//! This crate has no features; its cases use dlock-axum's defaults.

#[test]
fn attribute_misuse_is_a_compile_error() {
    let t = trybuild::TestCases::new();
    t.pass("tests/ui/pass/*.rs");
    t.compile_fail("tests/ui/fail/*.rs");
}
