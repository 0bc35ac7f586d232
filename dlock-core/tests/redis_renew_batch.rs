//! The watchdog's renewals reach Redis many locks per script call: those
//! queued behind a call in flight go out together in the next one.

use std::sync::Arc;
use std::time::Duration;

use dlock_core::backend::redis::RedisBackend;
use dlock_core::backend::Backend;
use dlock_core::{AcquireOptions, Locker, LockerOptions};
use dlock_testing::RedisServer;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewals_of_many_holds_share_script_calls() {
    let server = RedisServer::start();
    let backend = RedisBackend::connect(&server.url(), "dlock").await.expect("connect to the test redis-server");
    let opts = LockerOptions::default().with_watchdog_lease(Duration::from_millis(300));
    let locker = Locker::with_options(Arc::new(backend) as Arc<dyn Backend>, opts).expect("valid options");
    let holds = 100;
    let mut guards = Vec::new();
    for i in 0..holds {
        let k = locker.key("batch").part(i).build().expect("key");
        guards.push(locker.acquire(&k, AcquireOptions::new()).await.expect("free"));
    }
    server.reset_stats();
    // Three leases: every hold is renewed about ten times.
    tokio::time::sleep(Duration::from_millis(900)).await;
    let calls = server.command_calls("evalsha");
    let pexpires = server.command_calls("pexpire");
    for g in &guards {
        assert!(!g.is_lost(), "{} renewed", g.key());
    }
    assert!(pexpires >= 5 * holds, "{pexpires} lease extensions for {holds} holds in 900 ms");
    // One call per renewal would be about 1,000.
    assert!(calls * 4 <= pexpires, "{calls} script calls carried {pexpires} renewals");
    for g in guards {
        assert!(g.release().await.expect("release"));
    }
}
