//! Real servers (Redis, ZooKeeper, PostgreSQL) for dlock's tests and benchmarks, started on free loopback
//! ports and stopped when dropped; the fault proxies that stand between a
//! client and them ([`FaultProxy`] cuts, holds or slows a line,
//! [`ZooKeeperProxy`] loses chosen ZooKeeper replies); and the
//! [`percentile`] the torture harness and the benchmark both report.
//!
//! A missing server binary is a test failure with instructions, never a
//! skip: the README's test command installs what is needed.
//!
//! ```no_run
//! let redis = dlock_testing::RedisServer::start();
//! let url = redis.url();
//! // ... point the code under test at `url` ...
//! assert!(redis.command_calls("evalsha") == 0);
//! ```

mod accept;
mod announce;
mod ensemble;
mod http;
mod logs;
pub mod metrics;
mod pgbouncer;
mod port;
mod postgres;
mod proxy;
mod redis;
mod stats;
mod tls;
mod zk_proxy;
mod zookeeper;

pub use announce::announced_address;
pub use ensemble::ZooKeeperEnsemble;
pub use http::{read_http_answer, HttpAnswer};
pub use logs::{capture_logs, set_scoped, LogCapture};
pub use pgbouncer::PgBouncer;
pub use port::free_port;
pub use postgres::PostgresServer;
pub use proxy::FaultProxy;
pub use redis::{parse_command_stats, RedisCluster, RedisSentinel, RedisServer};
pub use stats::percentile;
pub use tls::{TestCertificates, TlsRedisServer};
pub use zk_proxy::{Hangup, ZooKeeperProxy, CREATE_CONTAINER, CREATE_OP_CODES, DELETE, GET_CHILDREN, GET_CHILDREN2};
pub use zookeeper::{parse_mntr, watches_fired, ZooKeeperServer};
