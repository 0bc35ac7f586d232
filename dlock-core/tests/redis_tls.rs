//! `rediss://` against a real redis-server with TLS (feature `tls`):
//! certificates are made at test time (dlock-testing's `TestCertificates`),
//! and every connection is configured the way a service is, through
//! `Config::from_lookup` and the `DLOCK_*` variables.

mod tokens;
use tokens::Consume;

use std::collections::HashMap;
use std::time::Duration;

use dlock_core::{AcquireOptions, Config, Error, Owner};
use dlock_testing::TlsRedisServer;
use tokio::time::Instant;

fn config(vars: &[(&str, String)]) -> dlock_core::Result<Config> {
    let vars: HashMap<String, String> = vars.iter().map(|(k, v)| (k.to_string(), v.clone())).collect();
    Config::from_lookup(move |k| vars.get(k).cloned())
}

fn path(p: std::path::PathBuf) -> String {
    p.to_string_lossy().into_owned()
}

/// Builds the engine, bounded: a TLS failure must come back as an error in
/// a few seconds, never as a hang.
async fn build_within(cfg: &Config, limit: Duration) -> dlock_core::Result<dlock_core::Locker> {
    let runtime = tokio::time::timeout(limit, cfg.build()).await.expect("connecting over TLS hung")?;
    Ok(runtime.locker().clone())
}

/// Take, re-enter, wait (woken by the release announcement, which travels
/// over the TLS subscriber connection), release — with the CA from
/// `DLOCK_REDIS_CA_FILE`. Every dlock connection came in on the TLS port.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn locks_work_over_tls_with_the_right_ca() {
    let server = TlsRedisServer::start();
    let cfg = config(&[
        ("DLOCK_BACKEND", "redis".into()),
        ("DLOCK_REDIS_URL", server.tls_url()),
        ("DLOCK_REDIS_CA_FILE", path(server.certs().ca_cert())),
    ])
    .expect("valid configuration");
    let (a, b) = (
        build_within(&cfg, Duration::from_secs(5)).await.expect("connect over TLS"),
        build_within(&cfg, Duration::from_secs(5)).await.expect("connect over TLS"),
    );
    let key = a.key("tls").part("order-1").build().expect("key");

    let owner = Owner::random().expect("OS randomness");
    let opts = AcquireOptions::new().with_lease(Duration::from_secs(10)).with_owner(owner.clone());
    let first = a.acquire(&key, opts.clone()).await.expect("take over TLS");
    let again = a.acquire(&key, opts).await.expect("re-enter over TLS");
    assert_eq!(again.fencing_token(), first.fencing_token(), "a re-entry keeps its token");
    assert!(again.release().await.expect("inner release"), "still held after the inner release");

    let waiter = {
        let (b, key) = (b.clone(), key.clone());
        tokio::spawn(async move {
            let opts = AcquireOptions::new().with_lease(Duration::from_secs(10)).with_wait(Duration::from_secs(8));
            let g = b.acquire(&key, opts).await?;
            Ok::<_, Error>((Instant::now(), g))
        })
    };
    // Let the waiter find the lock held and park on the announcement.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiter.is_finished(), "the waiter must wait while the lock is held");
    let first_token = first.fencing_token();
    let released = Instant::now();
    assert!(first.release().await.expect("outer release"), "we held it");
    let (woken, g) = waiter.await.expect("task").expect("the waiter gets the lock");
    assert!(
        woken.duration_since(released) < Duration::from_secs(2),
        "woken by the release announcement, not by the 10 s lease running out"
    );
    assert!(g.fencing_token() > first_token, "a new grant gets a greater token");
    assert!(g.release().await.expect("release"));

    let ports = server.client_listener_ports();
    let over_tls = ports.iter().filter(|p| **p == server.tls_port()).count();
    // Two lockers: one command and one subscriber connection each.
    assert!(over_tls >= 4, "dlock's connections should all be on the TLS port, listener ports: {ports:?}");
    assert_eq!(ports.len() - over_tls, 1, "only the test's own assertion connection is plain text: {ports:?}");
}

/// A TLS server that dies under a holder: commands fail with a backend
/// error within the response timeout, no hang, no panic.
#[tokio::test]
async fn a_dead_tls_server_is_a_bounded_backend_error() {
    let mut server = TlsRedisServer::start();
    let cfg = config(&[
        ("DLOCK_BACKEND", "redis".into()),
        ("DLOCK_REDIS_URL", server.tls_url()),
        ("DLOCK_REDIS_CA_FILE", path(server.certs().ca_cert())),
    ])
    .expect("valid");
    let locker = build_within(&cfg, Duration::from_secs(5)).await.expect("connect");
    let key = locker.key("dead").part(1).build().expect("key");
    let g = locker.acquire(&key, AcquireOptions::new().with_lease(Duration::from_secs(5))).await.expect("take");
    server.kill();
    let started = Instant::now();
    let other = locker.key("dead").part(2).build().expect("key");
    let err = tokio::time::timeout(Duration::from_secs(10), locker.acquire(&other, AcquireOptions::new()))
        .await
        .expect("no hang")
        .expect_err("the server is gone");
    assert!(err.is_unavailable(), "{err:?}");
    assert!(started.elapsed() < Duration::from_secs(5), "took {:?}", started.elapsed());
    let released = tokio::time::timeout(Duration::from_secs(10), g.release()).await.expect("no hang");
    assert!(released.is_err_and(|e| e.is_unavailable()));
}

/// Trusting the wrong CA (or only the system store, which does not know the
/// test CA) is a typed configuration error within a bounded time that says
/// it is a TLS certificate problem and names the variable to fix.
#[tokio::test]
async fn a_wrong_ca_is_a_clean_tls_error() {
    let server = TlsRedisServer::start();
    let wrong = config(&[
        ("DLOCK_BACKEND", "redis".into()),
        ("DLOCK_REDIS_URL", server.tls_url()),
        ("DLOCK_REDIS_CA_FILE", path(server.certs().other_ca_cert())),
    ])
    .expect("the file itself is a valid CA");
    let system_store =
        config(&[("DLOCK_BACKEND", "redis".into()), ("DLOCK_REDIS_URL", server.tls_url())]).expect("valid");
    for cfg in [wrong, system_store] {
        let started = Instant::now();
        let err = build_within(&cfg, Duration::from_secs(10)).await.expect_err("an untrusted server certificate");
        assert!(started.elapsed() < Duration::from_secs(5), "took {:?}", started.elapsed());
        assert!(err.is_misconfigured(), "{err:?}");
        let text = err.to_string();
        assert!(text.contains("TLS") && text.contains("certificate"), "{text}");
        assert!(text.contains("DLOCK_REDIS_CA_FILE"), "{text}");
    }
    // The server is fine: the right CA gets in.
    let right = config(&[
        ("DLOCK_BACKEND", "redis".into()),
        ("DLOCK_REDIS_URL", server.tls_url()),
        ("DLOCK_REDIS_CA_FILE", path(server.certs().ca_cert())),
    ])
    .expect("valid");
    build_within(&right, Duration::from_secs(5)).await.expect("the right CA");
}

/// `tls-auth-clients yes`: without a client certificate the connection is
/// refused with an error naming the client certificate variable; with the
/// certificate and key from the variables it works.
#[tokio::test]
async fn a_server_that_wants_client_certificates_gets_them_from_the_variables() {
    let server = TlsRedisServer::start_with_client_auth(true);
    let ca = path(server.certs().ca_cert());
    let without = config(&[
        ("DLOCK_BACKEND", "redis".into()),
        ("DLOCK_REDIS_URL", server.tls_url()),
        ("DLOCK_REDIS_CA_FILE", ca.clone()),
    ])
    .expect("valid");
    let started = Instant::now();
    let err = build_within(&without, Duration::from_secs(10)).await.expect_err("no client certificate");
    assert!(started.elapsed() < Duration::from_secs(5), "took {:?}", started.elapsed());
    // TLS 1.3: the server's "certificate required" alert is lost in its
    // reset, so this is a backend error whose message gives the likely cause.
    let text = err.to_string();
    assert!(text.contains("TLS") && text.contains("DLOCK_REDIS_CLIENT_CERT_FILE"), "{text}");

    let with = config(&[
        ("DLOCK_BACKEND", "redis".into()),
        ("DLOCK_REDIS_URL", server.tls_url()),
        ("DLOCK_REDIS_CA_FILE", ca),
        ("DLOCK_REDIS_CLIENT_CERT_FILE", path(server.certs().client_cert())),
        ("DLOCK_REDIS_CLIENT_KEY_FILE", path(server.certs().client_key())),
    ])
    .expect("valid");
    let locker = build_within(&with, Duration::from_secs(5)).await.expect("connect with a client certificate");
    let key = locker.key("mtls").part(1).build().expect("key");
    let g = locker.acquire(&key, AcquireOptions::new().with_lease(Duration::from_secs(5))).await.expect("take");
    assert!(g.release().await.expect("release"));
}

/// RedLock masters and the idempotency store take `rediss://` URLs and the
/// same CA.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_and_the_idempotency_store_work_over_tls() {
    let servers: Vec<TlsRedisServer> = (0..3).map(|_| TlsRedisServer::start()).collect();
    // Each server has its own CA; one CA file may hold several certificates.
    let bundle = servers[0].certs().dir().join("bundle.pem");
    let mut pem = Vec::new();
    for s in &servers {
        pem.extend(std::fs::read(s.certs().ca_cert()).expect("read CA"));
    }
    std::fs::write(&bundle, pem).expect("write the CA bundle");
    let urls: Vec<String> = servers.iter().map(TlsRedisServer::tls_url).collect();
    let cfg = config(&[
        ("DLOCK_BACKEND", "redlock".into()),
        ("DLOCK_REDLOCK_URLS", urls.join(",")),
        ("DLOCK_IDEMPOTENCY_REDIS_URL", urls[0].clone()),
        ("DLOCK_REDIS_CA_FILE", path(bundle)),
    ])
    .expect("valid configuration");
    let locker = build_within(&cfg, Duration::from_secs(5)).await.expect("connect to every master over TLS");
    let key = locker.key("redlock-tls").part(7).build().expect("key");
    let g =
        locker.acquire(&key, AcquireOptions::new().with_lease(Duration::from_secs(5))).await.expect("quorum over TLS");
    let busy = locker.acquire(&key, AcquireOptions::new().with_lease(Duration::from_secs(5))).await;
    assert!(busy.as_ref().is_err_and(Error::is_contention), "{busy:?}");
    assert!(g.release().await.expect("release"));
    for s in &servers {
        assert!(s.client_listener_ports().contains(&s.tls_port()), "master {} reached over TLS", s.tls_url());
    }

    let runtime = tokio::time::timeout(Duration::from_secs(5), cfg.build()).await.expect("no hang").expect("over TLS");
    let store = runtime.idempotency_store().expect("idempotency store over TLS");
    assert_eq!(store.name(), "redis");
    let token = store.issue_token(None, Duration::from_secs(60)).await.expect("issue");
    assert!(store.consume(&token).await.expect("consume"), "first use");
    assert!(!store.consume(&token).await.expect("consume"), "second use refused");
}

/// The TLS files are read when the configuration is: a missing or
/// malformed file, or half a client pair, is an error naming its variable.
#[test]
fn bad_tls_files_are_configuration_errors_naming_the_variable() {
    let certs = dlock_testing::TestCertificates::generate();
    let junk = certs.dir().join("junk.pem");
    std::fs::write(&junk, "this is not a certificate\n").expect("write junk");
    let base = |extra: &[(&str, String)]| {
        let mut vars = vec![("DLOCK_BACKEND", "redis".to_string()), ("DLOCK_REDIS_URL", "rediss://127.0.0.1:1".into())];
        vars.extend(extra.iter().cloned());
        config(&vars)
    };
    let cases = [
        ("DLOCK_REDIS_CA_FILE", vec![("DLOCK_REDIS_CA_FILE", "/nonexistent/ca.pem".to_string())]),
        ("DLOCK_REDIS_CA_FILE", vec![("DLOCK_REDIS_CA_FILE", path(junk.clone()))]),
        ("DLOCK_REDIS_CLIENT_KEY_FILE", vec![("DLOCK_REDIS_CLIENT_CERT_FILE", path(certs.client_cert()))]),
        ("DLOCK_REDIS_CLIENT_CERT_FILE", vec![("DLOCK_REDIS_CLIENT_KEY_FILE", path(certs.client_key()))]),
        (
            "DLOCK_REDIS_CLIENT_KEY_FILE",
            vec![
                ("DLOCK_REDIS_CLIENT_CERT_FILE", path(certs.client_cert())),
                ("DLOCK_REDIS_CLIENT_KEY_FILE", path(junk.clone())),
            ],
        ),
        (
            "DLOCK_REDIS_CLIENT_CERT_FILE",
            vec![
                ("DLOCK_REDIS_CLIENT_CERT_FILE", path(junk.clone())),
                ("DLOCK_REDIS_CLIENT_KEY_FILE", path(certs.client_key())),
            ],
        ),
    ];
    for (var, vars) in cases {
        let err = base(&vars).expect_err(var);
        assert!(err.is_misconfigured(), "{err}");
        assert!(err.to_string().contains(var), "{err} should name {var}");
    }
    let ok = base(&[
        ("DLOCK_REDIS_CA_FILE", path(certs.ca_cert())),
        ("DLOCK_REDIS_CLIENT_CERT_FILE", path(certs.client_cert())),
        ("DLOCK_REDIS_CLIENT_KEY_FILE", path(certs.client_key())),
    ])
    .expect("good files");
    assert!(ok.redis_tls.is_some_and(|t| t.is_custom()));
}
