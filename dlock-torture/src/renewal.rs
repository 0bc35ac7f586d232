//! `renewal-failure` (reliability.md T6a, requirement R4): a watchdog
//! holder loses its connection for two leases, then gets it back.
//!
//! The holder (in the harness process, so its signal is timed on the same
//! clock as the server probes) reaches Redis through a [`FaultProxy`] that
//! *holds* bytes during the cut ([`FaultProxy::hold`]) rather than closing
//! the line: the renewals sent into the cut land after the heal, which is
//! exactly when a renewal without an owner check would resurrect the lock.
//! A second client and a probe connection reach Redis directly.
//!
//! Per episode: the holder takes the key (watchdog lease 300 ms, renewed
//! every 100 ms) and holds it a while; the cut starts; the probe polls
//! `PEXPIRETIME` every 2 ms until the key is gone on the server, then the other
//! client takes it; the heal comes 2 × lease after the cut; for 300 ms
//! after, the probe reads the key's owner every 5 ms.
//!
//! Checked per episode: the holder's `lost()` fired if the key expired (a
//! silent loss otherwise); the owner never went back to the old holder
//! after another took the key (a resurrection); the other client was not
//! granted the key before the holder's own validity ended (an overlap).
//! The LockLost latency is measured from the lease's end as the *server*
//! kept it: the key's `PEXPIRETIME` (absolute Unix ms, read every 2 ms
//! during the cut, the latest value: a renewal sent just before the cut may
//! still land), against the wall-clock moment the holder saw `lost` — one
//! machine, one clock, ms resolution. That is the moment another client can
//! take the key, and it does not move with the harness's own scheduling
//! (a stall of this process delays the signal and shows in the figure).
//! The note also gives it from the end of the validity the holder could
//! vouch for (its last successful renewal's send + lease).

use std::sync::Arc;
use std::time::Duration;

use dlock_core::backend::redis::{RedisBackend, RedisOptions};
use dlock_core::{AcquireOptions, LockGuard, Locker, LockerOptions};
use dlock_testing::{percentile, FaultProxy, RedisServer};
use tokio::time::{sleep, sleep_until, timeout_at, Instant};

use crate::harness::Report;
use crate::rng::Rng;
use crate::scenario::Size;

const LEASE: Duration = Duration::from_millis(300);
/// How long after the heal the owner is watched: three renewal intervals,
/// more than enough for every held renewal to land.
const WATCH_AFTER_HEAL: Duration = Duration::from_millis(300);

/// What one episode showed.
#[derive(Debug, Default)]
struct Episode {
    /// The key vanished on the server during the cut (`PEXPIRETIME` = -2).
    gone_at: Option<Instant>,
    /// The other client's grant.
    taken_at: Option<Instant>,
    /// The holder's lost signal, and the validity end it knew then.
    lost_at: Option<Instant>,
    valid_until: Option<Instant>,
    /// The lease's end as the server kept it (`PEXPIRETIME`, Unix ms, the
    /// latest read during the cut), and the lost signal on the same clock.
    server_end_ms: Option<i64>,
    lost_wall_ms: Option<f64>,
    /// Owner reads after the heal that named the old holder again, after
    /// the key had expired on the server.
    resurrections: u64,
    /// The holder's release after the heal: `Ok(false)` = "not held".
    released_held: Option<bool>,
    release_error: bool,
}

async fn locker(url: &str) -> Result<Locker, String> {
    // The workers' response timeout (lease / 3): a renewal stuck in the cut
    // errors and is retried rather than waited on for a second.
    let options =
        RedisOptions::default().with_connect_timeout(Duration::from_millis(200)).with_response_timeout(LEASE / 3);
    let backend = RedisBackend::connect_with(url, "torture", options).await.map_err(|e| e.to_string())?;
    Locker::with_options(Arc::new(backend), LockerOptions::default().with_prefix("torture").with_watchdog_lease(LEASE))
        .map_err(|e| e.to_string())
}

pub(crate) async fn run(size: Size, seed: u64) -> Result<Report, String> {
    let lock = RedisServer::start();
    let proxy = Arc::new(FaultProxy::try_start(lock.port()).map_err(|e| e.to_string())?);
    let holder = locker(&format!("redis://127.0.0.1:{}", proxy.port())).await?;
    let other = locker(&lock.url()).await?;
    let mut probe = redis::Client::open(lock.url())
        .map_err(|e| e.to_string())?
        .get_multiplexed_async_connection()
        .await
        .map_err(|e| e.to_string())?;
    let key = holder.key("renewal").part(0u32).build().map_err(|e| e.to_string())?;
    let episodes = size.pick(12u64, 200);
    let mut rng = Rng::new(seed);

    let mut r = Report::new("renewal-failure", "redis (watchdog, lease 300 ms, renew every 100 ms)", seed);
    r.expected_safe = true;
    r.processes = 1;
    r.tasks = 2;
    r.keys = 1;
    r.lease_ms = 300;
    r.fault_kind = "blackhole the holder's connection 2 × lease (bytes held, delivered at the heal)".into();
    let mut results = Vec::new();
    let mut no_grant = 0u64;
    for _ in 0..episodes {
        // The holder's connection may still be reconnecting after the last
        // heal; a holder that cannot take a free key within 3 s is a bug.
        let ga = match holder.acquire(&key, AcquireOptions::new().with_wait(Duration::from_secs(3))).await {
            Ok(g) => g,
            Err(e) => {
                no_grant += 1;
                r.note(format!("the holder could not take the free key after a heal: {e}"));
                continue;
            }
        };
        r.operations += 1;
        // Cut at a random phase of the renewal cycle.
        sleep(Duration::from_millis(150 + rng.below(100))).await;
        let e = episode(&proxy, &other, &mut probe, ga, &mut r).await?;
        r.faults += 1;
        results.push(e);
        sleep(Duration::from_millis(20)).await;
    }

    let expired: Vec<&Episode> = results.iter().filter(|e| e.gone_at.is_some() || e.taken_at.is_some()).collect();
    let silent = expired.iter().filter(|e| e.lost_at.is_none()).count() as u64;
    let resurrections: u64 = results.iter().map(|e| e.resurrections).sum();
    let overlaps =
        results.iter().filter(|e| matches!((e.taken_at, e.valid_until), (Some(t), Some(vu)) if t < vu)).count() as u64;
    let signalled_after_grant = results
        .iter()
        .filter(|e| match (e.taken_at, e.lost_at) {
            (Some(t), Some(l)) => t < l,
            (Some(_), None) => true,
            _ => false,
        })
        .count();
    let ms = |a: Instant, b: Instant| if a >= b { (a - b).as_secs_f64() * 1e3 } else { -((b - a).as_secs_f64() * 1e3) };
    // Redis counts a key expired once its clock's ms is past PEXPIRETIME.
    let from_server: Vec<f64> =
        results.iter().filter_map(|e| Some(e.lost_wall_ms? - (e.server_end_ms? + 1) as f64)).collect();
    let from_client: Vec<f64> = results.iter().filter_map(|e| Some(ms(e.lost_at?, e.valid_until?))).collect();
    let not_held = results.iter().filter(|e| e.released_held == Some(false)).count();
    let release_errors = results.iter().filter(|e| e.release_error).count();

    r.lost_signals = results.iter().filter(|e| e.lost_at.is_some()).count() as u64;
    r.overlaps = overlaps;
    r.silent_losses = Some(silent);
    r.resurrections = Some(resurrections);
    r.lost_latency_p50_ms = percentile(&from_server, 0.5);
    r.lost_latency_p99_ms = percentile(&from_server, 0.99);
    r.note(format!(
        "silent lease losses: {silent}/{}; LockLost latency from the lease's end on the server (PEXPIRETIME, ms \
         resolution) p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms (negative: signalled before the key was free)",
        expired.len(),
        percentile(&from_server, 0.5).unwrap_or(0.0),
        percentile(&from_server, 0.99).unwrap_or(0.0),
        percentile(&from_server, 1.0).unwrap_or(0.0),
    ));
    r.note(format!(
        "from the holder's own lease end (last successful renewal's send + lease) p50 {:.1} ms, p99 {:.1} ms",
        percentile(&from_client, 0.5).unwrap_or(0.0),
        percentile(&from_client, 0.99).unwrap_or(0.0),
    ));
    r.note(format!(
        "resurrections after the heal: {resurrections}; the other client took the key in {}/{} episodes, {signalled_after_grant} \
         of them before the holder's signal; the holder's release after the heal answered `not held` {not_held}, errors {release_errors}",
        results.iter().filter(|e| e.taken_at.is_some()).count(),
        results.len()
    ));
    if expired.len() < results.len() {
        r.note(format!("episodes where the key outlived the cut: {}", results.len() - expired.len()));
    }
    if silent > 0 {
        r.fail(format!("{silent} lease(s) expired on the server without the holder's lost signal"));
    }
    if resurrections > 0 {
        r.fail("a late renewal gave the key back to its old holder while another owner held it");
    }
    if no_grant > 0 {
        r.fail(format!("{no_grant} episode(s) could not start: the holder did not get a free key back"));
    }
    if overlaps > 0 {
        r.fail("the other client was granted the key before the holder's validity ended");
    }
    Ok(r)
}

/// Cuts the holder off for 2 × lease with `ga` held, and watches.
async fn episode(
    proxy: &Arc<FaultProxy>,
    other: &Locker,
    probe: &mut redis::aio::MultiplexedConnection,
    ga: LockGuard,
    r: &mut Report,
) -> Result<Episode, String> {
    let name = ga.key().as_str().to_owned();
    let old_owner = ga.owner().as_str().to_owned();
    let cut_at = Instant::now();
    proxy.hold();
    let heal_at = cut_at + LEASE * 2;
    let healer = {
        let proxy = proxy.clone();
        tokio::spawn(async move {
            sleep_until(heal_at).await;
            proxy.heal();
        })
    };
    let mut e = Episode::default();
    let signal = async {
        timeout_at(heal_at + Duration::from_millis(500), ga.lost()).await.ok().map(|_| (Instant::now(), unix_ms()))
    };
    let mut probe2 = probe.clone();
    let taker = async {
        // `PEXPIRETIME` (Unix ms; -2 once the key is gone) both finds the
        // expiry and records the lease end the server kept: the latest read,
        // since a renewal sent just before the cut may still land.
        let mut server_end = None;
        // Until the heal: after it, a key still there was renewed.
        while Instant::now() < heal_at {
            let at: i64 =
                redis::cmd("PEXPIRETIME").arg(&name).query_async(&mut probe2).await.map_err(|e| e.to_string())?;
            if at == -2 {
                let gone = Instant::now();
                let gb = other.acquire(&ga_key(other, &name)?, AcquireOptions::new().with_wait(LEASE)).await.ok();
                return Ok::<_, String>((Some(gone), server_end, gb.map(|g| (Instant::now(), g))));
            }
            if at > 0 {
                server_end = Some(server_end.map_or(at, |s: i64| s.max(at)));
            }
            sleep(Duration::from_millis(2)).await;
        }
        Ok((None, server_end, None))
    };
    let (lost, taken) = tokio::join!(signal, taker);
    let (gone_at, server_end, gb) = taken?;
    e.lost_at = lost.map(|(at, _)| at);
    e.lost_wall_ms = lost.map(|(_, wall)| wall);
    e.server_end_ms = server_end;
    e.valid_until = Some(ga.valid_until());
    e.gone_at = gone_at;
    healer.await.map_err(|e| e.to_string())?;
    let gb = gb.map(|(t, g)| {
        e.taken_at = Some(t);
        g
    });
    if gb.is_some() {
        r.operations += 1;
    }

    // The held renewals land now. Watch the owner for a while.
    let until = Instant::now() + WATCH_AFTER_HEAL;
    while Instant::now() < until {
        // A lock's value is `<token>:<w>:<owner>`.
        let value: Option<String> = redis::cmd("GET").arg(&name).query_async(probe).await.map_err(|e| e.to_string())?;
        let owner = value.as_deref().and_then(|v| v.splitn(3, ':').nth(2)).map(str::to_owned);
        if e.gone_at.is_some() && owner.as_deref() == Some(old_owner.as_str()) {
            e.resurrections += 1;
        }
        sleep(Duration::from_millis(5)).await;
    }
    if let Some(gb) = gb
        && gb.release().await.is_err()
    {
        r.note("the other client's release failed");
    }
    match ga.release().await {
        Ok(held) => e.released_held = Some(held),
        Err(_) => e.release_error = true,
    }
    Ok(e)
}

/// Now on the wall clock, in Unix ms: the clock Redis' `PEXPIRETIME`
/// answers on (one machine, one clock).
fn unix_ms() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64() * 1e3)
}

/// The same lock key, built by the other client.
fn ga_key(other: &Locker, name: &str) -> Result<dlock_core::LockKey, String> {
    let key = other.key("renewal").part(0u32).build().map_err(|e| e.to_string())?;
    if key.as_str() == name {
        Ok(key)
    } else {
        Err(format!("the two clients name the key differently: `{}` and `{name}`", key.as_str()))
    }
}
