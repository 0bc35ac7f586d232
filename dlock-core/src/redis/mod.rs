//! The Redis client layer: how dlock talks to Redis, whoever asks. The
//! lock backend (`backend/redis/`), RedLock (`backend/redlock.rs`) and the
//! idempotency store (`idempotency/redis.rs`) sit on it; it imports none of
//! them.
//!
//! * [`Client`] (`client.rs`): every command goes through it, the restart
//!   quarantine (`restart.rs`) inside, so no command path can forget to
//!   report a failure to it;
//! * the healing connections (`connection.rs`): one server kept up by a
//!   background task, the master the Sentinels name, a cluster;
//! * `connect.rs`: how a URL becomes a checked connection, and a client;
//! * [`RedisOptions`] (`options.rs`) and [`RedisTls`] (`tls.rs`);
//! * [`ScriptCall`] (`script.rs`): a script called by its SHA1;
//! * `scan.rs`: one page of a `SCAN` over every master, for listings;
//! * `error.rs`: Redis's errors as dlock's.
//!
//! `docs/redis-design.md` has the reasons.

mod client;
mod connect;
mod connection;
mod error;
mod options;
mod restart;
mod scan;
mod script;
pub(crate) mod tls;

pub(crate) use client::Client;
pub(crate) use connect::{client, connect, Connected};
pub(crate) use error::redis_error;
pub use options::RedisOptions;
pub(crate) use scan::starts_with_glob;
pub(crate) use script::{lease_ms, ScriptCall};
pub use tls::RedisTls;
