//! The one error type of a benchmark run.

use std::fmt;

/// Everything that can stop a benchmark run.
#[derive(Debug)]
pub(crate) enum BenchError {
    /// Bad command line.
    Usage(String),
    /// The Redis server used by the baselines or the command counter failed.
    Redis(redis::RedisError),
    /// The engine under test failed.
    Lock(dlock_core::Error),
    /// The benchmark's own redis-server could not be started.
    Server(String),
    /// Something that must not happen in the scenario did: an uncontended
    /// acquire was refused, a release found the lock gone, tasks hung.
    Invariant(String),
}

impl fmt::Display for BenchError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BenchError::Usage(m) => f.write_str(m),
            BenchError::Redis(e) => write!(f, "redis: {e}"),
            BenchError::Lock(e) => write!(f, "dlock: {e}"),
            BenchError::Server(m) => write!(f, "redis-server: {m}"),
            BenchError::Invariant(m) => write!(f, "benchmark invariant broken: {m}"),
        }
    }
}

impl std::error::Error for BenchError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            BenchError::Redis(e) => Some(e),
            BenchError::Lock(e) => Some(e),
            _ => None,
        }
    }
}

impl From<redis::RedisError> for BenchError {
    fn from(e: redis::RedisError) -> Self {
        BenchError::Redis(e)
    }
}

impl From<dlock_core::Error> for BenchError {
    fn from(e: dlock_core::Error) -> Self {
        BenchError::Lock(e)
    }
}

pub(crate) type Result<T, E = BenchError> = std::result::Result<T, E>;
