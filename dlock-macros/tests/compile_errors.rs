//! The compile errors of `#[lockable]`, each pointing at the offending
//! token, each alone: the handler is emitted unchanged beside the error, so
//! nothing else fails. (Handlers that use it well compile: dlock-axum's
//! `tests/lockable/shapes.rs`.)
//!
//! The `.stderr` files hold only dlock's own messages and their spans (no
//! warnings, no notes of rustc's lints, whose wording changes between
//! toolchains), so they hold on every stable toolchain CI uses.
//!
//! The cases use this crate alone, with stand-ins for the extractor types
//! the macro reads by name: trybuild builds every dependency of the crate
//! under test once more in a target directory of its own, and with
//! dlock-axum and axum as dependencies that build was the longest part of
//! the whole test run (238 s of a 2-core machine's test run, beside other
//! binaries; 8 s with syn alone).

#[test]
fn attribute_misuse_is_a_compile_error() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/fail/*.rs");
}
