//! The start-up warning about a records' Redis without persistence, in a
//! test binary of its own: it reads what is logged, and a test running on
//! another thread of the same binary could fix a log site's interest
//! before this test's subscriber exists (tracing caches it per call site).

use std::sync::Arc;

/// Issue 24: start-up warns when the Redis that holds idempotency records
/// keeps nothing over a restart (no AOF, no RDB save points): it would come
/// back empty and run every completed key again. With `appendonly yes` it
/// does not warn.
#[tokio::test]
async fn records_on_a_redis_without_persistence_are_warned_about() {
    use std::sync::Mutex;

    #[derive(Clone, Default)]
    struct Capture(Arc<Mutex<Vec<u8>>>);
    impl std::io::Write for Capture {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().expect("capture").extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    async fn logs_of_start(url: String) -> String {
        let capture = Capture::default();
        let writer = capture.clone();
        let subscriber = tracing_subscriber::fmt().with_writer(move || writer.clone()).with_ansi(false).finish();
        let _guard = dlock_testing::set_scoped(subscriber);
        let config = dlock_core::Config::from_lookup(|var| match var {
            "DLOCK_BACKEND" => Some("redis".into()),
            "DLOCK_REDIS_URL" => Some(url.clone()),
            _ => None,
        })
        .expect("config");
        config.build().await.expect("runtime");
        let bytes = capture.0.lock().expect("capture").clone();
        String::from_utf8_lossy(&bytes).into_owned()
    }

    let forgetful = dlock_testing::RedisServer::start(); // --save '' --appendonly no
    let logs = logs_of_start(forgetful.url()).await;
    assert!(logs.contains("keeps no persistence"), "{logs}");
    let durable = dlock_testing::RedisServer::start_with(&["--appendonly", "yes"]);
    let logs = logs_of_start(durable.url()).await;
    assert!(!logs.contains("keeps no persistence"), "{logs}");
}
