//! The example services of dlock that are built as libraries, so their
//! tests can serve them in process (two instances over real sockets, one
//! database, one lock service); each binary only wires environment
//! variables to its library.

pub mod shutdown;
#[cfg(feature = "postgres")]
pub mod wallet;
