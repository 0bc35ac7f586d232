//! The behavioural suite of the primitives beyond the exclusive lock:
//! read-write locks, semaphores and multi-key locks. Every backend that
//! keeps them expands [`primitives_suite!`](crate::primitives_suite) with
//! its [`Harness`]; [`PermitOfOne`] runs the exclusive suite itself over a
//! semaphore of one permit ("as a mutex").

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use dlock_core::backend::{
    AcquireRequest, Backend, BoxFuture, Grant, Holder, KeyPage, ListQuery, LockMode, LockState, Release, Renewal,
};

use dlock_core::{AcquireOptions, Error, ForceUnlock, LockKey, Locker, Owner, Result};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::{until_no_lock_keys, until_parked, Harness};

fn key(locker: &Locker, name: &str) -> LockKey {
    locker.key(name).part(1).build().expect("short key")
}

fn shared() -> AcquireOptions {
    AcquireOptions::new().with_mode(LockMode::Shared)
}

fn permit(limit: u32) -> AcquireOptions {
    AcquireOptions::new().with_mode(LockMode::permits(limit))
}

/// Readers hold a key together; a writer is refused while any of them
/// holds it, and gets it once they are gone.
pub(crate) async fn readers_share_and_exclude_a_writer<H: Harness>(h: &H) {
    let (a, b, c) = (h.client().await, h.client().await, h.client().await);
    let k = key(&a, "rw-share");
    let r1 = a.acquire(&k, shared()).await.expect("first reader");
    let r2 = b.acquire(&k, shared()).await.expect("a second reader shares it");
    assert_ne!(r1.fencing_token(), r2.fencing_token(), "every grant has its own token");
    let last = r1.fencing_token().max(r2.fencing_token());
    let err = c.try_acquire(&k).await.expect_err("a writer is excluded by readers");
    assert!(err.is_contention(), "{err:?}");
    assert!(r1.release().await.expect("release"));
    assert!(c.try_acquire(&k).await.is_err(), "one reader is enough to exclude a writer");
    assert!(r2.release().await.expect("release"));
    let w = c.try_acquire(&k).await.expect("free of readers");
    assert!(w.fencing_token() > last, "tokens grow across modes");
    let err = a.acquire(&k, shared()).await.expect_err("a reader is excluded by a writer");
    assert!(err.is_contention(), "{err:?}");
    assert!(w.release().await.expect("release"));
    assert_eq!(h.lock_keys_left().await, 0);
}

/// A writer that waits for readers is not starved by readers that keep
/// coming: once it waits, a new reader waits behind it (writer preference).
pub(crate) async fn a_waiting_writer_is_not_starved_by_new_readers<H: Harness>(h: &H) {
    let (a, b, c) = (h.client().await, h.client().await, h.client().await);
    let k = key(&a, "rw-starve");
    let reader = a.acquire(&k, shared().with_lease(Duration::from_secs(30))).await.expect("reader");
    let (b2, k2) = (b.clone(), k.clone());
    let writer = tokio::spawn(async move {
        let opts = AcquireOptions::new().with_wait(Duration::from_secs(10)).with_lease(Duration::from_secs(30));
        b2.acquire(&k2, opts).await
    });
    until_parked(h, &k).await;
    // A writer that parked claims the key on its next try (on Redis the
    // try after its subscription); from then on new readers queue behind
    // it. Readers let in before that claim landed go at once.
    let claimed_by = Instant::now() + Duration::from_secs(5);
    loop {
        match c.acquire(&k, shared()).await {
            Err(e) if e.is_contention() => break,
            Err(e) => panic!("a new reader: {e:?}"),
            Ok(early) => {
                early.release().await.expect("release");
                assert!(Instant::now() < claimed_by, "new readers keep passing a waiting writer");
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    }
    let released_at = Instant::now();
    assert!(reader.release().await.expect("release"));
    let w = writer.await.expect("writer task").expect("the writer gets it when the readers go");
    assert!(released_at.elapsed() < Duration::from_secs(5), "woken by the release, not a lease");
    let (c2, k3) = (c.clone(), k.clone());
    let late_reader = tokio::spawn(async move { c2.acquire(&k3, shared().with_wait(Duration::from_secs(10))).await });
    until_parked(h, &k).await;
    assert!(w.release().await.expect("release"));
    late_reader.await.expect("reader task").expect("readers go after the writer").release().await.expect("release");
}

/// A writer that gave up waiting lets the readers it held back in.
pub(crate) async fn a_writer_that_gives_up_lets_readers_in<H: Harness>(h: &H) {
    let (a, b, c) = (h.client().await, h.client().await, h.client().await);
    let k = key(&a, "rw-give-up");
    let reader = a.acquire(&k, shared().with_lease(Duration::from_secs(30))).await.expect("reader");
    let err = b
        .acquire(&k, AcquireOptions::new().with_wait(Duration::from_millis(300)))
        .await
        .expect_err("readers hold it past the writer's wait");
    assert!(err.is_contention(), "{err:?}");
    let r2 = c
        .acquire(&k, shared().with_wait(Duration::from_secs(5)))
        .await
        .expect("the writer is gone: readers share again");
    r2.release().await.expect("release");
    reader.release().await.expect("release");
}

/// Review 2026-12-07 A1: a waiting writer keeps new readers out; when its
/// caller goes (a request that hung up: its acquire future is dropped) it
/// takes that back at once. A reader that waits behind it is let in
/// within moments, not when the writer's wait (30 s) would have ended,
/// and nothing of the writer is left on the service.
///
/// Not in [`primitives_suite!`](crate::primitives_suite): a backend's file
/// expands it once the backend withdraws (`primitives_suite!(@tests ..;
/// a_writer_that_hangs_up_lets_readers_in)`).
pub(crate) async fn a_writer_that_hangs_up_lets_readers_in<H: Harness>(h: &H) {
    const WRITER_WAIT: Duration = Duration::from_secs(30);
    let clients = [h.client().await, h.client().await, h.client().await, h.client().await];
    let [holder, writing, newcomer, waiting] = &clients;
    let k = key(holder, "rw-hang-up");
    let long = || shared().with_lease(Duration::from_secs(30));
    let reader = holder.acquire(&k, long()).await.expect("reader");
    let writer = {
        let (writing, k) = (writing.clone(), k.clone());
        tokio::spawn(async move {
            let opts = AcquireOptions::new().with_wait(WRITER_WAIT).with_lease(Duration::from_secs(30));
            writing.acquire(&k, opts).await
        })
    };
    until_parked(h, &k).await;
    // Control: once the writer's claim landed (the try after it parked),
    // a new reader is refused. Readers let in before that go at once.
    let claimed_by = Instant::now() + Duration::from_secs(5);
    loop {
        match newcomer.acquire(&k, shared()).await {
            Err(e) if e.is_contention() => break,
            Err(e) => panic!("a new reader: {e:?}"),
            Ok(early) => {
                early.release().await.expect("release");
                assert!(Instant::now() < claimed_by, "the waiting writer never kept a reader out");
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    }
    // A reader that waits parks behind the writer.
    let parked = h.parked(&k).await;
    let late_reader = {
        let (waiting, k) = (waiting.clone(), k.clone());
        tokio::spawn(async move { waiting.acquire(&k, long().with_wait(Duration::from_secs(20))).await })
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while h.parked(&k).await <= parked {
        assert!(Instant::now() < deadline, "the late reader never parked");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let err = newcomer.acquire(&k, shared()).await.expect_err("still kept out while the writer waits");
    assert!(err.is_contention(), "{err:?}");

    // The writer's caller goes: its acquire future is dropped mid-wait.
    let hung_up = Instant::now();
    writer.abort();
    assert!(writer.await.expect_err("aborted").is_cancelled(), "the writer was still waiting");
    let late = tokio::time::timeout(Duration::from_secs(5), late_reader)
        .await
        .unwrap_or_else(|_| {
            panic!("the waiting reader was still kept out 5 s after the writer left (its wait: {WRITER_WAIT:?})")
        })
        .expect("reader task")
        .expect("the waiting reader is let in");
    let waited = hung_up.elapsed();
    assert!(waited < Duration::from_secs(3), "let in {waited:?} after the writer left");
    newcomer.acquire(&k, shared()).await.expect("new readers share again").release().await.expect("release");
    assert!(late.release().await.expect("release") && reader.release().await.expect("release"));
    until_no_lock_keys(h).await;
}

/// A holder of a shared lock may not turn it into an exclusive one (two
/// readers doing so would wait for each other); a writer may read.
pub(crate) async fn an_upgrade_is_refused_and_a_writer_may_read<H: Harness>(h: &H) {
    let a = h.client().await;
    let k = key(&a, "rw-upgrade");
    let me = Owner::random().expect("owner");
    let read = a.acquire(&k, shared().with_owner(me.clone())).await.expect("reader");
    let err = a.acquire(&k, AcquireOptions::new().with_owner(me.clone())).await.expect_err("no upgrade");
    assert!(matches!(err, Error::ModeConflict { .. }), "{err:?}");
    read.release().await.expect("release");
    let write = a.acquire(&k, AcquireOptions::new().with_owner(me.clone())).await.expect("writer");
    let inner = a.acquire(&k, shared().with_owner(me.clone())).await.expect("a writer reads under its own lock");
    assert_eq!(inner.fencing_token(), write.fencing_token(), "one hold");
    inner.release().await.expect("release");
    write.release().await.expect("release");
    assert_eq!(h.lock_keys_left().await, 0);
}

/// `limit` permits and no more; a freed permit goes to a waiter, woken by
/// the release.
pub(crate) async fn a_semaphore_admits_its_limit_and_wakes_a_waiter<H: Harness>(h: &H) {
    let clients = [h.client().await, h.client().await, h.client().await, h.client().await];
    let k = key(&clients[0], "sem-limit");
    let mut held = Vec::new();
    for c in &clients[..3] {
        held.push(c.acquire(&k, permit(3)).await.expect("a free permit"));
    }
    let mut tokens: Vec<u64> = held.iter().map(|g| g.fencing_token()).collect();
    tokens.dedup();
    assert_eq!(tokens.len(), 3, "each permit has its own token");
    let err = clients[3].acquire(&k, permit(3)).await.expect_err("all three permits are taken");
    assert!(err.is_contention(), "{err:?}");
    let (d, k2) = (clients[3].clone(), k.clone());
    let waiter = tokio::spawn(async move { d.acquire(&k2, permit(3).with_wait(Duration::from_secs(10))).await });
    until_parked(h, &k).await;
    let released_at = Instant::now();
    assert!(held.pop().expect("a permit").release().await.expect("release"));
    let g = waiter.await.expect("waiter task").expect("the freed permit");
    assert!(released_at.elapsed() < Duration::from_secs(2), "woken by the release");
    assert!(g.fencing_token() > *tokens.iter().max().expect("tokens"), "tokens grow");
    g.release().await.expect("release");
    for g in held {
        g.release().await.expect("release");
    }
    assert_eq!(h.lock_keys_left().await, 0);
}

/// The first holder fixes the number of permits; another number is a
/// mistake of the program, said as such, not contention. So is an
/// exclusive lock on a semaphore's key.
pub(crate) async fn a_semaphore_keeps_its_limit<H: Harness>(h: &H) {
    let (a, b) = (h.client().await, h.client().await);
    let k = key(&a, "sem-mismatch");
    let g = a.acquire(&k, permit(2)).await.expect("permit");
    let err = b.acquire(&k, permit(5)).await.expect_err("another limit");
    assert!(matches!(err, Error::ModeConflict { .. }), "{err:?}");
    let err = b.try_acquire(&k).await.expect_err("exclusive on a semaphore");
    assert!(matches!(err, Error::ModeConflict { .. }) || err.is_contention(), "{err:?}");
    let err = b.acquire(&k, shared()).await.expect_err("shared on a semaphore");
    assert!(matches!(err, Error::ModeConflict { .. }), "{err:?}");
    let err = b.acquire(&k, permit(0)).await.expect_err("no permits");
    assert!(matches!(err, Error::InvalidArgument { .. }), "{err:?}");
    g.release().await.expect("release");
    b.acquire(&k, permit(5)).await.expect("nobody holds it: a new limit").release().await.expect("release");
}

/// Issue 38 item 5 (review 2026-12-07 D4): a semaphore's limit is fixed
/// while anyone holds *or waits for* its key. A waiter for one of 2 permits
/// keeps the key a semaphore of 2 once its holders are gone: a newcomer
/// asking for one of 3, or for the key exclusive, is told so
/// (`ModeConflict`), and the waiter gets its permit. (Without a waiter's
/// place, the key was free once the holders left: the newcomer took it as a
/// semaphore of 3, and the waiter was told that *its* limit did not fit.) A
/// waiter that gives up takes its place back: then the next holder fixes a
/// new limit.
///
/// The waiter runs on a runtime of its own that the test stops polling
/// ([`Frozen`]) while the holders leave and the newcomer comes, so the
/// waiter cannot take the freed permit first, whatever the scheduling; the
/// harness's [`parked`](Harness::parked) must count it once its place is
/// recorded (the try after it parked).
///
/// Not in [`primitives_suite!`](crate::primitives_suite): a backend's file
/// expands it once the backend keeps a waiter's limit (`primitives_suite!(@tests ..;
/// a_waiting_semaphore_keeps_its_limit_against_a_newcomer)`).
pub(crate) async fn a_waiting_semaphore_keeps_its_limit_against_a_newcomer<H: Harness>(h: &H) {
    let (holders, waiting, newcomer) = (h.client().await, h.client().await, h.client().await);
    let k = key(&holders, "sem-waiter");
    let two = || permit(2).with_lease(Duration::from_secs(30));
    let three = || permit(3).with_lease(Duration::from_secs(30));

    let (p1, p2) = (holders.acquire(&k, two()).await.expect("free"), holders.acquire(&k, two()).await.expect("second"));
    let waiter = {
        let (waiting, k) = (waiting.clone(), k.clone());
        Frozen::spawn(async move {
            let g = waiting.acquire(&k, two().with_wait(Duration::from_secs(20))).await?;
            g.release().await.map(|_| ())
        })
    };
    until_parked(h, &k).await;
    waiter.freeze();
    assert!(p1.release().await.expect("release") && p2.release().await.expect("release"));
    let taken = newcomer.acquire(&k, three()).await;
    let exclusive = newcomer.try_acquire(&k).await;
    waiter.thaw();
    match taken {
        Err(Error::ModeConflict { .. }) => {}
        other => panic!("newcomer (3 permits) while a waiter for one of 2 waits: {other:?}"),
    }
    match exclusive {
        Err(Error::ModeConflict { .. }) => {}
        other => panic!("newcomer (exclusive) while a waiter for one of 2 waits: {other:?}"),
    }
    waiter.join().expect("the waiter keeps its limit and gets its permit");

    // A waiter that gives up takes its place back with it.
    let (p1, p2) = (holders.acquire(&k, two()).await.expect("free"), holders.acquire(&k, two()).await.expect("second"));
    let waiter = {
        let (waiting, k) = (waiting.clone(), k.clone());
        tokio::spawn(async move { waiting.acquire(&k, two().with_wait(Duration::from_secs(20))).await })
    };
    until_parked(h, &k).await;
    let gave_up = Instant::now();
    waiter.abort();
    assert!(waiter.await.expect_err("aborted").is_cancelled(), "the waiter was still waiting");
    assert!(p1.release().await.expect("release") && p2.release().await.expect("release"));
    let g = loop {
        match newcomer.acquire(&k, three()).await {
            Ok(g) => break g,
            Err(Error::ModeConflict { .. }) if gave_up.elapsed() < Duration::from_secs(3) => {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            Err(e) => panic!("{:?} after the waiter gave up (its wait: 20 s): {e:?}", gave_up.elapsed()),
        }
    };
    assert!(g.release().await.expect("release"));
    until_no_lock_keys(h).await;
}

/// A future run on a current-thread runtime of its own, on a thread of its
/// own, which the test can stop polling: [`freeze`](Self::freeze) blocks
/// that thread with a task of the same runtime (so it returns once the
/// future is idle between two polls), [`thaw`](Self::thaw) lets it go on.
/// A waiter frozen this way hears of no release until thawed.
struct Frozen {
    runtime: tokio::runtime::Handle,
    thread: std::thread::JoinHandle<Result<()>>,
    thaw: std::sync::Mutex<Option<std::sync::mpsc::Sender<()>>>,
}

impl Frozen {
    fn spawn(task: impl std::future::Future<Output = Result<()>> + Send + 'static) -> Self {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a runtime");
        let handle = runtime.handle().clone();
        let thread = std::thread::spawn(move || runtime.block_on(task));
        Frozen { runtime: handle, thread, thaw: std::sync::Mutex::new(None) }
    }

    fn freeze(&self) {
        let (frozen_tx, frozen) = std::sync::mpsc::channel();
        let (thaw, thawed) = std::sync::mpsc::channel::<()>();
        self.runtime.spawn(async move {
            let _ = frozen_tx.send(());
            let _ = thawed.recv();
        });
        frozen.recv_timeout(Duration::from_secs(10)).expect("the waiter's runtime never went idle");
        *self.thaw.lock().expect("thaw") = Some(thaw);
    }

    fn thaw(&self) {
        drop(self.thaw.lock().expect("thaw").take());
    }

    fn join(self) -> Result<()> {
        self.thaw();
        self.thread.join().expect("the waiter's thread")
    }
}

/// A permit whose holder vanished comes back when its lease runs out.
pub(crate) async fn a_lost_holders_permit_comes_back_after_its_lease<H: Harness>(h: &H) {
    let (a, b) = (h.client().await, h.client().await);
    let k = key(&a, "sem-expire");
    let crashed = a.acquire(&k, permit(1).with_lease(Duration::from_millis(300))).await.expect("permit");
    std::mem::forget(crashed);
    let started = Instant::now();
    let g = b.acquire(&k, permit(1).with_wait(Duration::from_secs(5))).await.expect("the permit came back");
    let waited = started.elapsed();
    assert!(waited >= Duration::from_millis(200) && waited < Duration::from_secs(3), "{waited:?}");
    g.release().await.expect("release");
}

/// Many clients contend for 3 permits: never more than 3 hold at once,
/// and 3 do.
pub(crate) async fn never_more_than_the_limit_under_contention<H: Harness>(h: &H) {
    const LIMIT: usize = 3;
    let clients = [h.client().await, h.client().await, h.client().await];
    let k = key(&clients[0], "sem-contention");
    let inside = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for t in 0..12 {
        let locker = clients[t % clients.len()].clone();
        let (k, inside, most) = (k.clone(), inside.clone(), most.clone());
        tasks.push(tokio::spawn(async move {
            for _ in 0..10 {
                let opts = permit(LIMIT as u32).with_wait(Duration::from_secs(30));
                let g = locker.acquire(&k, opts).await.expect("a permit within the wait");
                let now = inside.fetch_add(1, Ordering::SeqCst) + 1;
                most.fetch_max(now, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(2)).await;
                inside.fetch_sub(1, Ordering::SeqCst);
                g.release().await.expect("release");
            }
        }));
    }
    for t in tasks {
        t.await.expect("task");
    }
    let most = most.load(Ordering::SeqCst);
    assert!(most <= LIMIT, "{most} holders of {LIMIT} permits");
    assert_eq!(most, LIMIT, "the contention reached the limit");
    assert_eq!(h.lock_keys_left().await, 0);
}

/// Readers and writers contend: a writer is always alone, and readers did
/// share at some point.
pub(crate) async fn readers_and_writers_never_overlap<H: Harness>(h: &H) {
    let clients = [h.client().await, h.client().await];
    let k = key(&clients[0], "rw-contention");
    let readers = Arc::new(AtomicUsize::new(0));
    let writing = Arc::new(AtomicBool::new(false));
    let shared_seen = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for t in 0..10 {
        let locker = clients[t % 2].clone();
        let (k, readers, writing, shared_seen) = (k.clone(), readers.clone(), writing.clone(), shared_seen.clone());
        tasks.push(tokio::spawn(async move {
            for i in 0..10 {
                let write = (t + i) % 4 == 0;
                let mode = if write { LockMode::Exclusive } else { LockMode::Shared };
                let opts = AcquireOptions::new().with_mode(mode).with_wait(Duration::from_secs(30));
                let g = locker.acquire(&k, opts).await.expect("within the wait");
                if write {
                    assert!(!writing.swap(true, Ordering::SeqCst), "two writers");
                    assert_eq!(readers.load(Ordering::SeqCst), 0, "a writer beside readers");
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    writing.store(false, Ordering::SeqCst);
                } else {
                    let now = readers.fetch_add(1, Ordering::SeqCst) + 1;
                    shared_seen.fetch_max(now, Ordering::SeqCst);
                    assert!(!writing.load(Ordering::SeqCst), "a reader beside a writer");
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    readers.fetch_sub(1, Ordering::SeqCst);
                }
                g.release().await.expect("release");
            }
        }));
    }
    for t in tasks {
        t.await.expect("task");
    }
    assert!(shared_seen.load(Ordering::SeqCst) >= 2, "readers never shared the key");
    assert_eq!(h.lock_keys_left().await, 0);
}

/// All or nothing: a set with one busy key takes none of them.
pub(crate) async fn a_multi_key_lock_takes_all_or_none<H: Harness>(h: &H) {
    let (a, b) = (h.client().await, h.client().await);
    let (k1, k2, k3) = (key(&a, "multi-1"), key(&a, "multi-2"), key(&a, "multi-3"));
    let busy = b.try_acquire(&k2).await.expect("k2");
    let set = [(&k1, LockMode::Exclusive), (&k2, LockMode::Exclusive), (&k3, LockMode::Shared)];
    let err = a.acquire_all(set, AcquireOptions::new()).await.expect_err("k2 is busy");
    assert!(err.is_contention(), "{err:?}");
    b.try_acquire(&k1).await.expect("k1 was given back").release().await.expect("release");
    b.try_acquire(&k3).await.expect("k3 was never kept").release().await.expect("release");
    let (a2, set2) = (
        a.clone(),
        [(k1.clone(), LockMode::Exclusive), (k2.clone(), LockMode::Exclusive), (k3.clone(), LockMode::Shared)],
    );
    let waiter = tokio::spawn(async move {
        let set = set2.iter().map(|(k, m)| (k, *m));
        a2.acquire_all(set, AcquireOptions::new().with_wait(Duration::from_secs(10))).await
    });
    until_parked(h, &k2).await;
    busy.release().await.expect("release");
    let all = waiter.await.expect("task").expect("all three once k2 is free");
    assert_eq!(all.guards().len(), 3);
    for k in [&k1, &k2] {
        assert!(b.try_acquire(k).await.is_err(), "{k} is held by the set");
    }
    b.acquire(&k3, shared()).await.expect("k3 is shared").release().await.expect("release");
    assert!(all.release().await.expect("release"));
    assert_eq!(h.lock_keys_left().await, 0);
}

/// Callers asking for overlapping sets in opposite orders never wait for
/// each other in a cycle, and each set is exclusive while held.
pub(crate) async fn overlapping_sets_in_opposite_orders_do_not_deadlock<H: Harness>(h: &H) {
    let clients = [h.client().await, h.client().await];
    let keys: Vec<LockKey> = (0..3).map(|i| clients[0].key("multi-order").part(i).build().expect("key")).collect();
    let inside = Arc::new(AtomicUsize::new(0));
    // Holds keys 0 and 2 in turn, so that a set often takes its first key
    // and then waits for its second: the moment a cycle would form.
    let stop = Arc::new(AtomicBool::new(false));
    let blocker = {
        let (locker, keys, stop) = (clients[0].clone(), keys.clone(), stop.clone());
        tokio::spawn(async move {
            let mut i = 0;
            while !stop.load(Ordering::SeqCst) {
                let opts = AcquireOptions::new().with_wait(Duration::from_secs(10));
                let g = locker.acquire(&keys[i % 2 * 2], opts).await.expect("the blocker's key");
                tokio::time::sleep(Duration::from_millis(3)).await;
                g.release().await.expect("release");
                i += 1;
            }
        })
    };
    let mut tasks = Vec::new();
    for t in 0..6usize {
        let locker = clients[t % 2].clone();
        let (keys, inside) = (keys.clone(), inside.clone());
        tasks.push(tokio::spawn(async move {
            for i in 0..10usize {
                // Always key 1, plus 0 or 2, named in either order.
                let other = &keys[if (t + i) % 2 == 0 { 0 } else { 2 }];
                let set = if t % 2 == 0 {
                    [(&keys[1], LockMode::Exclusive), (other, LockMode::Exclusive)]
                } else {
                    [(other, LockMode::Exclusive), (&keys[1], LockMode::Exclusive)]
                };
                let all = locker
                    .acquire_all(set, AcquireOptions::new().with_wait(Duration::from_secs(10)))
                    .await
                    .expect("no deadlock: every set within the wait");
                assert_eq!(inside.fetch_add(1, Ordering::SeqCst), 0, "two sets sharing key 1 at once");
                tokio::time::sleep(Duration::from_millis(1)).await;
                inside.fetch_sub(1, Ordering::SeqCst);
                all.release().await.expect("release");
            }
        }));
    }
    let all = async {
        for t in tasks {
            t.await.expect("task");
        }
    };
    tokio::time::timeout(Duration::from_secs(60), all).await.expect("no deadlock");
    stop.store(true, Ordering::SeqCst);
    blocker.await.expect("blocker task");
    assert_eq!(h.lock_keys_left().await, 0);
}

/// Multi-key acquires cancelled at random points leave no key held.
pub(crate) async fn cancelled_multi_key_acquires_leave_nothing_behind<H: Harness>(h: &H, iterations: u64) {
    let lockers = [h.client().await, h.client().await];
    let keys: Vec<LockKey> = (0..4).map(|i| lockers[0].key("multi-cancel").part(i).build().expect("key")).collect();
    let (acquired, cancelled) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    // Budgets around what a set really costs here and now (as in the
    // exclusive suite), so a loaded machine still sees both outcomes.
    let mut measured = 2 * h.typical_acquire();
    for _ in 0..5 {
        let started = Instant::now();
        let set = [(&keys[0], LockMode::Exclusive), (&keys[1], LockMode::Shared)];
        lockers[0].acquire_all(set, AcquireOptions::new()).await.expect("free").release().await.expect("release");
        measured = measured.max(started.elapsed());
    }
    let max_budget_us = 2 * measured.as_micros().max(1) as u64;
    let mut tasks = Vec::new();
    for t in 0..8u64 {
        let locker = lockers[(t % 2) as usize].clone();
        let keys = keys.clone();
        let (acquired, cancelled) = (acquired.clone(), cancelled.clone());
        tasks.push(tokio::spawn(async move {
            let mut rng = 0x2545_F491_4F6C_DD1Du64 ^ (t + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            for _ in 0..iterations / 8 {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                let (i, j) = ((rng % 4) as usize, ((rng >> 8) % 4) as usize);
                let mode = if rng & 32 == 0 { LockMode::Shared } else { LockMode::Exclusive };
                let set = [(&keys[i], LockMode::Exclusive), (&keys[(i + 1 + j % 3) % 4], mode)];
                let opts = AcquireOptions::new().with_wait(Duration::from_millis(3));
                let budget = Duration::from_micros(rng % max_budget_us);
                match tokio::time::timeout(budget, locker.acquire_all(set, opts)).await {
                    Ok(Ok(all)) => {
                        acquired.fetch_add(1, Ordering::Relaxed);
                        tokio::task::yield_now().await;
                        if rng & 64 == 0 {
                            drop(all);
                        } else {
                            drop(all.release().await);
                        }
                    }
                    Ok(Err(_)) => {}
                    Err(_) => {
                        cancelled.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        }));
    }
    for t in tasks {
        t.await.expect("task");
    }
    let (acquired, cancelled) = (acquired.load(Ordering::Relaxed), cancelled.load(Ordering::Relaxed));
    eprintln!("{iterations} multi-key iterations: {acquired} acquired, {cancelled} cancelled mid-acquire");
    assert!(acquired > 0 && cancelled > 0, "the test must exercise both paths");
    until_no_lock_keys(h).await;
    let set = keys.iter().map(|k| (k, LockMode::Exclusive));
    lockers[0]
        .acquire_all(set, AcquireOptions::new())
        .await
        .expect("every key is free")
        .release()
        .await
        .expect("release");
}

/// A backend that asks its inner backend for one permit of a semaphore
/// wherever it is asked for an exclusive lock: the exclusive suite run over
/// it is the semaphore's "as a mutex" suite.
#[derive(Debug)]
pub(crate) struct PermitOfOneBackend(pub(crate) Arc<dyn Backend>);

impl PermitOfOneBackend {
    fn rewrite(req: &AcquireRequest) -> AcquireRequest {
        match req.mode {
            LockMode::Exclusive => req.clone().with_mode(LockMode::permits(1)),
            _ => req.clone(),
        }
    }
}

impl Backend for PermitOfOneBackend {
    fn name(&self) -> &'static str {
        self.0.name()
    }
    fn acquire<'a>(&'a self, req: &'a AcquireRequest, cancel: &'a CancellationToken) -> BoxFuture<'a, Result<Grant>> {
        Box::pin(async move { self.0.acquire(&Self::rewrite(req), cancel).await })
    }
    fn renew<'a>(&'a self, key: &'a LockKey, owner: &'a Owner, lease: Duration) -> BoxFuture<'a, Result<Renewal>> {
        self.0.renew(key, owner, lease)
    }
    fn release<'a>(&'a self, key: &'a LockKey, owner: &'a Owner) -> BoxFuture<'a, Result<Release>> {
        self.0.release(key, owner)
    }
    fn ready(&self) -> BoxFuture<'_, Result<()>> {
        self.0.ready()
    }
    fn try_acquire_now(&self, req: &AcquireRequest) -> Option<Result<Grant>> {
        self.0.try_acquire_now(&Self::rewrite(req))
    }
    fn prefix(&self) -> Option<&str> {
        self.0.prefix()
    }
    fn release_now(&self, key: &LockKey, owner: &Owner) -> Option<Result<Release>> {
        self.0.release_now(key, owner)
    }
    fn withdraw<'a>(&'a self, req: &'a AcquireRequest) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move { self.0.withdraw(&Self::rewrite(req)).await })
    }
    fn inspect<'a>(&'a self, key: &'a LockKey) -> BoxFuture<'a, Result<LockState>> {
        self.0.inspect(key)
    }
    fn list<'a>(&'a self, query: &'a ListQuery) -> BoxFuture<'a, Result<KeyPage>> {
        self.0.list(query)
    }
    fn force_unlock<'a>(&'a self, key: &'a LockKey, holder: &'a Holder) -> BoxFuture<'a, Result<Release>> {
        self.0.force_unlock(key, holder)
    }
}

/// An operator frees one named permit of a semaphore: that holder alone
/// learns of its loss, the other keeps its permit, and a newcomer gets the
/// one freed.
pub(crate) async fn an_operator_frees_one_named_permit<H: Harness>(h: &H) {
    let (a, b, c, op) = (h.client().await, h.client().await, h.client().await, h.client().await);
    let k = key(&a, "permit-freed");
    let first = a.acquire(&k, permit(2)).await.expect("a permit");
    let second = b.acquire(&k, permit(2)).await.expect("the other permit");
    let state = op.inspect(&k).await.expect("inspect");
    assert_eq!((state.holders.len(), state.limit()), (2, Some(2)), "{state:?}");
    let victim = state
        .holders
        .iter()
        .find(|h| h.fencing_token == first.fencing_token())
        .expect("the first holder shown with its token")
        .id();
    let freed =
        op.force_unlock(&k, ForceUnlock::holder(victim.as_str(), "test: a leaked permit")).await.expect("forced");
    assert_eq!(freed.len(), 1);
    assert_eq!(freed[0].id(), victim);
    let third = c.acquire(&k, permit(2).with_wait(Duration::from_secs(5))).await.expect("the freed permit");
    tokio::time::timeout(Duration::from_secs(5), first.lost()).await.expect("the freed holder learns of it");
    assert!(!second.is_lost(), "the other permit is untouched");
    let left = op.inspect(&k).await.expect("inspect");
    assert_eq!(left.holders.len(), 2, "{left:?}");
    assert!(left.holder(victim.as_str()).is_none());
    for g in [second, third] {
        assert!(g.release().await.expect("release"));
    }
    let _ = first.release().await;
}

/// A harness whose clients take a permit of one wherever the suite asks for
/// an exclusive lock.
pub(crate) struct PermitOfOne<H>(pub(crate) H);

impl<H: Harness> Harness for PermitOfOne<H> {
    async fn client(&self) -> Locker {
        let options = self.0.client().await.options().clone();
        let backend = Arc::new(PermitOfOneBackend(self.0.backend().await));
        Locker::with_options(backend, options).expect("the inner client's options")
    }
    async fn backend(&self) -> Arc<dyn Backend> {
        Arc::new(PermitOfOneBackend(self.0.backend().await))
    }
    async fn delete_behind_back(&self, key: &LockKey) {
        self.0.delete_behind_back(key).await
    }
    async fn lock_keys_left(&self) -> usize {
        self.0.lock_keys_left().await
    }
    async fn parked(&self, key: &LockKey) -> usize {
        self.0.parked(key).await
    }
    fn typical_acquire(&self) -> Duration {
        self.0.typical_acquire()
    }
}

/// Expands one `#[tokio::test]` per primitive suite function for a
/// harness, and the exclusive suite over a semaphore of one permit.
#[macro_export]
macro_rules! primitives_suite {
    ($make:expr) => {
        $crate::primitives_suite!($make, one_permit_only);
        mod semaphores {
            use super::*;
            $crate::primitives_suite!(@tests $make;
                a_semaphore_admits_its_limit_and_wakes_a_waiter,
                a_semaphore_keeps_its_limit,
                never_more_than_the_limit_under_contention,
                an_operator_frees_one_named_permit,
            );
        }
    };
    // For a backend that refuses semaphores of more than one permit (RedLock).
    ($make:expr, one_permit_only) => {
        mod primitives {
            use super::*;
            $crate::primitives_suite!(@tests $make;
                readers_share_and_exclude_a_writer,
                a_waiting_writer_is_not_starved_by_new_readers,
                a_writer_that_gives_up_lets_readers_in,
                an_upgrade_is_refused_and_a_writer_may_read,
                a_lost_holders_permit_comes_back_after_its_lease,
                readers_and_writers_never_overlap,
                a_multi_key_lock_takes_all_or_none,
                overlapping_sets_in_opposite_orders_do_not_deadlock,
            );
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn cancelled_multi_key_acquires_leave_nothing_behind() {
                let h = $make.await;
                suite::primitives::cancelled_multi_key_acquires_leave_nothing_behind(&h, 2_000).await;
            }
        }
        /// The exclusive suite, each lock a semaphore of one permit.
        mod as_a_semaphore_of_one {
            use super::*;
            $crate::backend_suite!(async { suite::primitives::PermitOfOne($make.await) });
        }
    };
    (@tests $make:expr; $($name:ident),* $(,)?) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $name() {
            let h = $make.await;
            suite::primitives::$name(&h).await;
        }
    )*};
}
