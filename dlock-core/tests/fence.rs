//! Fencing checked by the storage (`dlock_core::fence`), on a real
//! PostgreSQL cluster and a real redis-server: a newer token wins, an older
//! one is refused with `Error::StaleToken` and writes nothing, the same
//! token passes twice, and two transactions of an old and a new holder are
//! ordered by the fence so that no update is lost.

use std::time::Duration;

use dlock_core::fence::postgres::Fences;
use dlock_core::fence::redis as fenced;
use dlock_core::Error;
use dlock_testing::{PostgresServer, RedisServer};
use sqlx::postgres::{PgPool, PgPoolOptions};
use sqlx::{Connection as _, PgConnection};

async fn pool(server: &PostgresServer) -> PgPool {
    PgPoolOptions::new().max_connections(8).connect(&server.url()).await.expect("connect to the test PostgreSQL")
}

/// A fences table and a `stock` table with one row, 10 units.
async fn shop(server: &PostgresServer, prefix: &str) -> (PgPool, Fences) {
    let pool = pool(server).await;
    let fences = Fences::new(prefix).expect("prefix");
    fences.create(&pool).await.expect("create the fences table");
    sqlx::raw_sql(&format!(
        "CREATE TABLE {prefix}_stock (id int PRIMARY KEY, qty bigint NOT NULL); INSERT INTO {prefix}_stock VALUES (1, 10)"
    ))
    .execute(&pool)
    .await
    .expect("stock table");
    (pool, fences)
}

async fn qty(pool: &PgPool, prefix: &str) -> i64 {
    sqlx::query_scalar(&format!("SELECT qty FROM {prefix}_stock WHERE id = 1")).fetch_one(pool).await.expect("qty")
}

/// One fenced sale in its own transaction: check, read, write, commit.
async fn sell(pool: &PgPool, fences: &Fences, prefix: &str, token: u64) -> Result<(), Error> {
    let mut tx = pool.begin().await.expect("begin");
    fences.check(&mut tx, "stock:1", token).await?;
    let q: i64 = sqlx::query_scalar(&format!("SELECT qty FROM {prefix}_stock WHERE id = 1"))
        .fetch_one(&mut *tx)
        .await
        .expect("read");
    sqlx::query(&format!("UPDATE {prefix}_stock SET qty = $1 WHERE id = 1"))
        .bind(q - 1)
        .execute(&mut *tx)
        .await
        .expect("write");
    tx.commit().await.expect("commit");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_newer_wins_older_is_refused_and_writes_nothing_equal_passes() {
    let server = PostgresServer::start();
    let (pool, fences) = shop(&server, "a").await;
    sell(&pool, &fences, "a", 5).await.expect("first holder");
    sell(&pool, &fences, "a", 7).await.expect("a newer holder");
    // The same holder writes twice.
    sell(&pool, &fences, "a", 7).await.expect("the same token again");
    assert_eq!(qty(&pool, "a").await, 7);
    match sell(&pool, &fences, "a", 6).await {
        Err(Error::StaleToken { resource, token, newest }) => {
            assert_eq!((resource.as_str(), token, newest), ("stock:1", 6, 7));
        }
        other => panic!("an older token must be refused: {other:?}"),
    }
    assert_eq!(qty(&pool, "a").await, 7, "nothing written by the stale holder");
    let err = sell(&pool, &fences, "a", 1).await.expect_err("refused");
    assert!(err.is_stale(), "{err:?}");
    // Another resource has its own fence.
    let mut tx = pool.begin().await.expect("begin");
    fences.check(&mut tx, "stock:2", 1).await.expect("another resource");
    tx.rollback().await.expect("rollback");
    // A rolled-back check leaves no trace.
    let mut tx = pool.begin().await.expect("begin");
    fences.check(&mut tx, "stock:1", 100).await.expect("newest");
    tx.rollback().await.expect("rollback");
    sell(&pool, &fences, "a", 8).await.expect("the rolled-back 100 was never recorded");
}

/// The new holder (6) checks first: the old one (5) waits on the fence's
/// row lock until the new one commits, then is refused. They cannot both
/// commit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_an_old_holder_behind_a_new_one_cannot_commit() {
    let server = PostgresServer::start();
    let (pool, fences) = shop(&server, "b").await;
    sell(&pool, &fences, "b", 4).await.expect("seed the fence");

    let mut new = pool.begin().await.expect("begin");
    fences.check(&mut new, "stock:1", 6).await.expect("new holder");
    let old = tokio::spawn({
        let (pool, fences) = (pool.clone(), fences.clone());
        async move { sell(&pool, &fences, "b", 5).await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!old.is_finished(), "the old holder's check waits for the new holder's transaction");
    let q: i64 = sqlx::query_scalar("SELECT qty FROM b_stock WHERE id = 1").fetch_one(&mut *new).await.expect("read");
    sqlx::query("UPDATE b_stock SET qty = $1 WHERE id = 1").bind(q - 1).execute(&mut *new).await.expect("write");
    new.commit().await.expect("commit");
    let err = tokio::time::timeout(Duration::from_secs(10), old).await.expect("answered").expect("join");
    assert!(matches!(err, Err(Error::StaleToken { token: 5, newest: 6, .. })), "{err:?}");
    assert_eq!(qty(&pool, "b").await, 8, "two sales, the new one's only");
}

/// The old holder (5) checks first: the new one (6) waits until the old one
/// commits, then reads what it wrote. Both sales count: none is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_new_holder_behind_an_old_one_reads_its_write() {
    let server = PostgresServer::start();
    let (pool, fences) = shop(&server, "c").await;

    let mut old = pool.begin().await.expect("begin");
    fences.check(&mut old, "stock:1", 5).await.expect("old holder first");
    let q: i64 = sqlx::query_scalar("SELECT qty FROM c_stock WHERE id = 1").fetch_one(&mut *old).await.expect("read");
    let new = tokio::spawn({
        let (pool, fences) = (pool.clone(), fences.clone());
        async move { sell(&pool, &fences, "c", 6).await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!new.is_finished(), "the new holder's check waits for the old holder's transaction");
    sqlx::query("UPDATE c_stock SET qty = $1 WHERE id = 1").bind(q - 1).execute(&mut *old).await.expect("write");
    old.commit().await.expect("commit");
    tokio::time::timeout(Duration::from_secs(10), new).await.expect("answered").expect("join").expect("new sells");
    assert_eq!(qty(&pool, "c").await, 8, "both sales count");
}

/// The negative control of the two tests above: the same interleaving
/// without the fence loses an update, so the interleaving is a real race.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_without_the_fence_the_same_interleaving_loses_a_sale() {
    let server = PostgresServer::start();
    let (pool, _) = shop(&server, "d").await;
    let mut old = pool.begin().await.expect("begin");
    let mut new = pool.begin().await.expect("begin");
    let read = "SELECT qty FROM d_stock WHERE id = 1";
    let q_old: i64 = sqlx::query_scalar(read).fetch_one(&mut *old).await.expect("read");
    let q_new: i64 = sqlx::query_scalar(read).fetch_one(&mut *new).await.expect("read");
    sqlx::query("UPDATE d_stock SET qty = $1 WHERE id = 1").bind(q_new - 1).execute(&mut *new).await.expect("write");
    new.commit().await.expect("commit");
    sqlx::query("UPDATE d_stock SET qty = $1 WHERE id = 1").bind(q_old - 1).execute(&mut *old).await.expect("write");
    old.commit().await.expect("commit");
    assert_eq!(qty(&pool, "d").await, 9, "two sales, one unit taken: the lost update the fence prevents");
}

/// Many processes starting at once create the table once, without errors.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_the_table_is_created_once_by_processes_starting_at_once() {
    let server = PostgresServer::start();
    let url = server.url();
    let starts = (0..8).map(|_| {
        let url = url.clone();
        tokio::spawn(async move {
            // A pool each, as separate processes would have.
            let pool = PgPoolOptions::new().max_connections(1).connect(&url).await.expect("connect");
            Fences::new("race").expect("prefix").create(&pool).await
        })
    });
    for start in futures_util::future::join_all(starts).await {
        start.expect("join").expect("create");
    }
    let mut conn = PgConnection::connect(&url).await.expect("connect");
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_class WHERE relname = 'race_fences'")
        .fetch_one(&mut conn)
        .await
        .expect("catalog");
    assert_eq!(n, 1);
    // And again, on a table that exists.
    Fences::new("race").expect("prefix").create(&pool(&server).await).await.expect("idempotent");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_refuses_a_token_it_cannot_store_and_a_bad_prefix() {
    let server = PostgresServer::start();
    let (pool, fences) = shop(&server, "e").await;
    let mut tx = pool.begin().await.expect("begin");
    let err = fences.check(&mut tx, "stock:1", u64::MAX).await.expect_err("too large");
    assert!(matches!(err, Error::InvalidArgument { name: "token", .. }), "{err:?}");
    let err = Fences::new("bad\"prefix").expect_err("refused");
    assert!(err.to_string().contains("DLOCK_PREFIX"), "{err}");
}

async fn redis_conn(server: &RedisServer) -> redis::aio::MultiplexedConnection {
    let client = redis::Client::open(server.url()).expect("url");
    client.get_multiplexed_async_connection().await.expect("connect to the test redis-server")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_newer_wins_older_is_refused_and_writes_nothing_equal_passes() {
    let server = RedisServer::start();
    let mut c = redis_conn(&server).await;
    let key = "shop:{product:1}";
    fenced::set(&mut c, key, 10, 5).await.expect("first holder");
    fenced::set(&mut c, key, 9, 7).await.expect("newer holder");
    fenced::set(&mut c, key, 8, 7).await.expect("the same holder again");
    match fenced::set(&mut c, key, 100, 6).await {
        Err(Error::StaleToken { resource, token, newest }) => {
            assert_eq!((resource.as_str(), token, newest), (key, 6, 7))
        }
        other => panic!("an older token must be refused: {other:?}"),
    }
    assert_eq!(fenced::get(&mut c, key, 7).await.expect("read").as_deref(), Some("8"), "nothing written");
    let err = fenced::get(&mut c, key, 6).await.expect_err("a stale read is refused too");
    assert!(err.is_stale(), "{err:?}");
    assert_eq!(fenced::get(&mut c, "shop:{product:2}", 1).await.expect("missing"), None);
}

/// A read raises the mark: once the new holder has read, the stale
/// holder's write (computed from an earlier read) is refused, so the new
/// holder's read-modify-write loses nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_a_fenced_read_refuses_the_stale_write_that_would_follow_it() {
    let server = RedisServer::start();
    let mut c = redis_conn(&server).await;
    let key = "stock";
    fenced::set(&mut c, key, 10, 1).await.expect("seed");
    let old = fenced::get(&mut c, key, 5).await.expect("old reads").unwrap_or_default();
    let new = fenced::get(&mut c, key, 6).await.expect("new reads").unwrap_or_default();
    let err = fenced::set(&mut c, key, old.parse::<i64>().expect("number") - 1, 5).await.expect_err("stale");
    assert!(matches!(err, Error::StaleToken { token: 5, newest: 6, .. }), "{err:?}");
    fenced::set(&mut c, key, new.parse::<i64>().expect("number") - 1, 6).await.expect("new writes");
    assert_eq!(fenced::get(&mut c, key, 6).await.expect("read").as_deref(), Some("9"));
}

/// Tokens compare exactly across the whole u64 range (Lua's numbers are
/// doubles: 2^53 + 1 and 2^53 are one number to them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_tokens_compare_exactly_beyond_doubles() {
    let server = RedisServer::start();
    let mut c = redis_conn(&server).await;
    let big = 1u64 << 53;
    fenced::set(&mut c, "k", "a", big + 1).await.expect("first");
    let err = fenced::set(&mut c, "k", "b", big).await.expect_err("2^53 < 2^53 + 1");
    assert!(err.is_stale(), "{err:?}");
    fenced::set(&mut c, "k", "c", 10_000_000_000_000_000_000).await.expect("a longer token");
    let err = fenced::set(&mut c, "k", "d", 9_999_999_999_999_999_999).await.expect_err("a shorter one");
    assert!(err.is_stale(), "{err:?}");
    fenced::set(&mut c, "k", "e", u64::MAX).await.expect("the largest");
}
