//! Review 2026-12-07 A1 on Redis, over a real socket: a writer request
//! that hung up while it waited on a read-write key stops keeping readers
//! out at once (its intent is withdrawn), not when its 30 s wait would have
//! ended. The app and the scenario are `rw_hang_up`'s, shared with the
//! PostgreSQL file.

mod rw_hang_up;

use dlock_core::backend::redis::RedisBackend;
use dlock_core::Locker;
use dlock_testing::RedisServer;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writer_request_that_hung_up_does_not_keep_readers_out() {
    let redis = RedisServer::start();
    let backend = RedisBackend::connect(&redis.url(), "dlock").await.expect("connect to the test redis-server");
    rw_hang_up::a_writer_request_that_hung_up_does_not_keep_readers_out(Locker::new(backend)).await;
}
