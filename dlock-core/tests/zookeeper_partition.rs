//! T8e (reliability.md §9): the leader (or a follower) of a 3-server
//! ensemble isolated from its peers while its clients can still reach it,
//! without network namespaces: every peer connection goes through a
//! `FaultProxy` (`ZooKeeperEnsemble::start_partitionable`), and isolating a
//! member cuts every proxy to and from it. A holder whose session lives on
//! the isolated member must count its lock lost before the majority grants
//! it to anyone else; and, the other side of that, a holder that stays
//! connected must not.

use std::sync::Arc;
use std::time::Duration;

use dlock_core::backend::zookeeper::{ConnectionState, ZooKeeperBackend, ZooKeeperOptions};
use dlock_core::backend::Backend;
use dlock_core::{AcquireOptions, LockGuard, Locker, LockerOptions};
use dlock_testing::ZooKeeperEnsemble;
use tokio::sync::{watch, Mutex};
use tokio::time::Instant;

/// One test of this file at a time: each starts JVMs (a 3-server ensemble,
/// or a server), and seven JVMs starting at once on a 2-core CI runner took
/// more than 30 s to answer, and the timing these tests check stretches
/// with the load.
static ONE_AT_A_TIME: Mutex<()> = Mutex::const_new(());

fn locker(backend: ZooKeeperBackend, watchdog_lease: Duration) -> Locker {
    let opts = LockerOptions::default().with_watchdog_lease(watchdog_lease);
    Locker::with_options(Arc::new(backend) as Arc<dyn Backend>, opts).expect("valid options")
}

async fn connect(port: u16, session: Duration) -> ZooKeeperBackend {
    ZooKeeperBackend::connect_with(
        &format!("127.0.0.1:{port}"),
        "dlock",
        ZooKeeperOptions::default().with_session_timeout(session),
    )
    .await
    .expect("connect to one member")
}

/// A backend whose session may live on any member but `isolated`.
async fn connect_majority(ensemble: &ZooKeeperEnsemble, isolated: usize, session: Duration) -> ZooKeeperBackend {
    let hosts: Vec<String> =
        (0..3).filter(|i| *i != isolated).map(|i| format!("127.0.0.1:{}", ensemble.port(i))).collect();
    ZooKeeperBackend::connect_with(&hosts.join(","), "dlock", ZooKeeperOptions::default().with_session_timeout(session))
        .await
        .expect("connect to the majority")
}

/// How long after `t0` the state first was `want` (`None` if not within 60 s).
async fn first(mut state: watch::Receiver<ConnectionState>, want: ConnectionState, t0: Instant) -> Option<Duration> {
    tokio::time::timeout(Duration::from_secs(60), state.wait_for(|s| *s == want)).await.ok()?.ok()?;
    Some(t0.elapsed())
}

/// Takes the lock from `locker`, retrying errors (the waiter's own member
/// loses the leader too and reconnects), until `within`; or says why not.
async fn acquire_retrying(
    locker: &Locker,
    key: &dlock_core::LockKey,
    within: Duration,
) -> Result<(LockGuard, u32), String> {
    let deadline = Instant::now() + within;
    let mut errors = 0;
    let mut last = String::new();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(format!("the waiter was not granted within {within:?} ({errors} errors, the last: {last})"));
        }
        match locker.acquire(key, AcquireOptions::new().with_wait(left)).await {
            Ok(g) => return Ok((g, errors)),
            Err(e) => {
                assert!(e.is_unavailable() || e.is_contention(), "unexpected error: {e}");
                errors += 1;
                last = e.to_string();
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// Every change of `state`, with when it came after `t0`, as it happens.
fn record(
    mut state: watch::Receiver<ConnectionState>,
    t0: Instant,
) -> Arc<std::sync::Mutex<Vec<(Duration, ConnectionState)>>> {
    let seen = Arc::new(std::sync::Mutex::new(vec![(t0.elapsed(), *state.borrow_and_update())]));
    let log = seen.clone();
    tokio::spawn(async move {
        while state.changed().await.is_ok() {
            let now = *state.borrow_and_update();
            log.lock().unwrap_or_else(|p| p.into_inner()).push((t0.elapsed(), now));
        }
    });
    seen
}

/// The leader, cut off from both followers: they elect a new leader and
/// expire the sessions of the old leader's clients.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_isolated_leader_loses_its_holders_lock_before_anyone_else_gets_it() {
    let _turn = ONE_AT_A_TIME.lock().await;
    partitions(true).await;
}

/// A follower, cut off from the leader and the other follower (a minority
/// of one): the majority keeps its leader and expires the sessions of the
/// isolated follower's clients.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_isolated_follower_loses_its_holders_lock_before_anyone_else_gets_it() {
    let _turn = ONE_AT_A_TIME.lock().await;
    partitions(false).await;
}

/// `DLOCK_T8E_PARTITIONS` (default 1) partitions in a row on one ensemble,
/// each healed before the next (reliability.md's nightly size is 20).
async fn partitions(isolate_leader: bool) {
    let rounds: usize = match std::env::var("DLOCK_T8E_PARTITIONS") {
        Ok(v) => v.parse().unwrap_or_else(|_| panic!("DLOCK_T8E_PARTITIONS must be a positive integer, not `{v}`")),
        Err(_) => 1,
    };
    let ensemble = Arc::new(ZooKeeperEnsemble::start_partitionable(3));
    for round in 0..rounds {
        holder_on_an_isolated_member(&ensemble, isolate_leader, round).await;
    }
}

/// The holder's session lives on the member that is isolated (connect
/// string = that member only), the waiter's on the two others. Checks: the
/// holder is reported suspended within a third of the session timeout and
/// its guard fires `lost` within the session timeout and before the waiter
/// is granted; the waiter's fencing token is higher; after healing, every
/// member serves and the holder's backend locks again in a new session.
async fn holder_on_an_isolated_member(ensemble: &Arc<ZooKeeperEnsemble>, isolate_leader: bool, round: usize) {
    let leader = ensemble.wait_formed(Duration::from_secs(60));
    let isolated = if isolate_leader { leader } else { (leader + 1) % 3 };
    let what = if isolate_leader { "leader" } else { "follower" };
    let session = Duration::from_secs(3);

    let holder_backend = connect(ensemble.port(isolated), session).await;
    let state = holder_backend.connection_state();
    // A watchdog lease longer than the session: the guard must learn of the
    // loss from the session, not from failed renewals.
    let holder = locker(holder_backend, Duration::from_secs(30));
    // The waiter may reconnect to either member of the majority: the test
    // is about the holder, and one member may lose its leader for a while.
    let waiter_backend = connect_majority(ensemble, isolated, Duration::from_secs(10)).await;
    let waiter_states = record(waiter_backend.connection_state(), Instant::now());
    let waiter = locker(waiter_backend, Duration::from_secs(30));
    let key = holder.key("t8e").part(round).build().expect("key");
    let held = holder.acquire(&key, AcquireOptions::new()).await.expect("the key is free");
    let held_token = held.fencing_token();

    let granted = {
        let (waiter, key) = (waiter.clone(), key.clone());
        tokio::spawn(async move {
            let got = acquire_retrying(&waiter, &key, Duration::from_secs(60)).await;
            (Instant::now(), got)
        })
    };
    // The waiter is queued behind the holder before the partition.
    tokio::time::sleep(Duration::from_millis(300)).await;

    let t0 = Instant::now();
    ensemble.isolate(isolated);
    let elected = {
        let ensemble = ensemble.clone();
        tokio::task::spawn_blocking(move || {
            let deadline = Instant::now() + Duration::from_secs(60);
            while Instant::now() < deadline {
                // The majority's leader: a new one, or the same when a follower was cut off.
                if let Some(new) = ensemble.leader().filter(|l| *l != isolated) {
                    return Some((new, t0.elapsed()));
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            None
        })
    };
    let suspended = tokio::spawn(first(state.clone(), ConnectionState::Suspended, t0));
    let lost_state = tokio::spawn(first(state.clone(), ConnectionState::Lost, t0));
    let lost_guard = {
        let held = &held;
        async move { (held.lost().await, t0.elapsed()) }
    };
    let ((reason, lost_at), granted) = tokio::join!(lost_guard, granted);
    let (granted_instant, got) = granted.expect("waiter task");
    let (next, errors) = got.unwrap_or_else(|why| {
        let states = waiter_states.lock().unwrap_or_else(|p| p.into_inner()).clone();
        panic!(
            "{why}; isolated member {isolated}; the waiter's session states since it connected {states:?}\n{}",
            ensemble.report()
        )
    });
    let granted_at = granted_instant - t0;
    let suspended_at = suspended.await.expect("task");
    let lost_state_at = lost_state.await.expect("task");
    let elected = elected.await.expect("task");
    eprintln!(
        "T8e round {round}: {what} (member {isolated}) isolated (session {session:?}): majority's leader (member, after) {elected:?}; holder suspended \
         after {suspended_at:?}, guard lost after {lost_at:?} ({reason:?}), session reported lost after \
         {lost_state_at:?}; waiter granted after {granted_at:?} ({errors} errors on the way); tokens {held_token} -> {}",
        next.fencing_token()
    );
    assert!(elected.is_some(), "the majority has a leader");

    assert!(next.fencing_token() > held_token, "the waiter's token is above the isolated holder's");
    let suspended_at = suspended_at.expect("the holder is reported suspended");
    assert!(suspended_at <= session / 3, "suspended within a third of the session: {suspended_at:?}");
    assert!(held.is_lost(), "the holder knows it lost the lock");
    assert!(lost_at <= session, "the holder counts the lock lost within the session timeout: {lost_at:?}");
    assert!(
        lost_at <= granted_at,
        "mutual exclusion: the waiter was granted at {granted_at:?} while the holder believed it held until {lost_at:?}"
    );
    let next_token = next.fencing_token();
    assert!(next.release().await.expect("release"));

    // Heal: the ensemble serves again on every member, the isolated one included.
    ensemble.heal();
    let leader_after = ensemble.wait_formed(Duration::from_secs(60));
    eprintln!("T8e healed: leader {leader_after}, the isolated member {isolated} now {:?}", ensemble.mode(isolated));
    let again = locker(connect(ensemble.port(isolated), session).await, Duration::from_secs(30));
    let g = again
        .acquire(&key, AcquireOptions::new().with_wait(Duration::from_secs(10)))
        .await
        .expect("the isolated member serves again");
    assert!(g.fencing_token() > next_token);
    assert!(g.release().await.expect("release"));
    // The holder's backend opens a new session and locks again.
    let mut state = state;
    tokio::time::timeout(Duration::from_secs(30), state.wait_for(|s| *s == ConnectionState::Connected))
        .await
        .expect("a new session after the heal")
        .expect("state channel");
    let g = holder
        .acquire(&key, AcquireOptions::new().with_wait(Duration::from_secs(10)))
        .await
        .expect("the holder locks again");
    assert!(g.release().await.expect("release"));
    assert!(!held.release().await.unwrap_or(false), "the isolated holder's lock is gone");
}

/// The other side of counting the session timeout ourselves: a holder whose
/// session stays connected keeps its lock for several session timeouts (the
/// heartbeat keeps confirming it), so the early `lost` is no false alarm.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connected_holder_keeps_its_lock_past_several_session_timeouts() {
    let _turn = ONE_AT_A_TIME.lock().await;
    let server = dlock_testing::ZooKeeperServer::start();
    // Not much shorter: the JVMs of the other tests compete for the CPU,
    // and a server that cannot answer for a session timeout may expire
    // the session itself.
    let session = Duration::from_secs(2);
    let backend = ZooKeeperBackend::connect_with(
        &server.connect_string(),
        "dlock",
        ZooKeeperOptions::default().with_session_timeout(session),
    )
    .await
    .expect("connect");
    let holder = locker(backend, Duration::from_secs(30));
    let key = holder.key("t8e-healthy").part(1).build().expect("key");
    let held = holder.acquire(&key, AcquireOptions::new()).await.expect("the key is free");
    tokio::time::sleep(session * 4).await;
    assert!(!held.is_lost(), "a connected session's lock is not lost");
    assert!(held.release().await.expect("release"), "and still ours");
}
