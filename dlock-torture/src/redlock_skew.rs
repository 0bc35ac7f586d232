//! `redlock-skew`: RedLock tokens with one master's high-water mark (as a
//! clock running ahead would leave it) seconds ahead of the others, and that
//! master out of some quorums.
//!
//! Five masters (AOF always: no data is lost), each reached through a
//! [`FaultProxy`] of the harness. Before every round the harness raises
//! master 0's mark (`prefix:fence`, see
//! `dlock_core::test_support::prefix_fence_key`) to its server time plus
//! [`AHEAD`], as a clock that far ahead would; every other round its
//! replies are held back past the node timeout, so it drops out of the
//! quorums of that round (and, in the others, out of any quorum it merely
//! answers third). A token that is the maximum over its own quorum then
//! falls whenever master 0 was in one quorum and is not in the next: the
//! review's A2. dlock writes the granted token back to a quorum's marks
//! before it grants, so its tokens must grow here: C4 = 0 is enforced, and
//! 0 overlaps. The negative control, `broken-redlock-max-over-quorum` (the
//! harness's own lock with the old max-over-quorum token, see
//! [`crate::broken::Bug::RedlockMaxOverQuorum`]), runs the same workload in
//! `checker-self-test` and must show C4.

use std::time::Duration;

use dlock_testing::{FaultProxy, RedisServer};
use tokio::time::sleep;

use crate::harness::{Report, Run};
use crate::history::mono_ns;
use crate::scenario::{
    config, describe, finish, redlock_masters, resource_server, spawn_workers, workers_started, Size,
};
use crate::slow::ping_rtt;

/// How far ahead master 0's mark is kept.
const AHEAD: Duration = Duration::from_secs(5);
/// Master 0's reply delay in its slow rounds: past the 50 ms node timeout.
const SLOW: Duration = Duration::from_millis(120);
/// One round: fast, then slow, alternately.
const ROUND: Duration = Duration::from_millis(400);

pub(crate) async fn run(size: Size, seed: u64) -> Result<Vec<Report>, String> {
    Ok(vec![row("redlock-skew", "redlock", size, seed).await?])
}

/// One row of the workload: `backend` is `redlock` (the scenario's row) or
/// the negative control (the self-test's).
pub(crate) async fn row(scenario: &str, backend: &str, size: Size, seed: u64) -> Result<Report, String> {
    let nodes = redlock_masters();
    let (res_server, resource) = resource_server().await?;
    let proxies: Vec<FaultProxy> =
        nodes.iter().map(|n| FaultProxy::try_start(n.port())).collect::<Result<_, _>>().map_err(|e| e.to_string())?;
    // dlock's mark under the workers' prefix, or the broken lock's own.
    let mark = if backend == "redlock" {
        dlock_core::test_support::prefix_fence_key("torture")
    } else {
        crate::broken::REDLOCK_MARK.to_owned()
    };
    let fast = redis::Client::open(nodes[0].url()).map_err(|e| e.to_string())?;
    let mut fast = fast.get_multiplexed_async_connection().await.map_err(|e| e.to_string())?;
    let rounds = size.pick(6u64, 40);
    let mut cfg =
        config(backend, proxies.iter().map(|p| format!("redis://127.0.0.1:{}", p.port())).collect(), &res_server, seed);
    cfg.keys = 2;
    // Fixed leases, as the broken lock has them.
    cfg.watchdog = false;
    cfg.duration_ms = rounds * u64::try_from(ROUND.as_millis()).unwrap_or(0) + 300;
    let procs = 3;
    let mut run = Run::new(&format!("{scenario}-{backend}")).map_err(|e| e.to_string())?;
    // The masters' clock (one host) against the histories' monotonic one.
    let offset_us = i128::from(server_micros(&nodes[1]).await?) - i128::from(mono_ns() / 1000);
    // Ahead before the first grant.
    let mut pushed = u64::from(push_ahead(&mut fast, &mark).await?);
    spawn_workers(&mut run, &cfg, procs)?;
    workers_started(&run, procs as usize, Duration::from_secs(5)).await?;
    let mut slowed = 0u64;
    for round in 0..rounds {
        if round > 0 {
            pushed += u64::from(push_ahead(&mut fast, &mark).await?);
        }
        if round % 2 == 1 {
            proxies[0].set_delay(SLOW);
            run.log("slow", Some(0));
            // Counted once a round trip through the proxy is seen that slow.
            if ping_rtt(proxies[0].port()).await.is_some_and(|rtt| rtt >= SLOW * 9 / 10) {
                slowed += 1;
            }
            sleep(ROUND.saturating_sub(SLOW)).await;
            proxies[0].set_delay(Duration::ZERO);
            run.log("fast", Some(0));
        } else {
            sleep(ROUND).await;
        }
    }
    let mut r = Report::new(scenario, backend, seed);
    r.expected_safe = backend == "redlock";
    r.tokens_promised = r.expected_safe;
    r.faults = slowed;
    r.fault_kind = format!(
        "master 0's mark {} s ahead; its replies {} ms late every other {} ms",
        AHEAD.as_secs(),
        SLOW.as_millis(),
        ROUND.as_millis()
    );
    describe(&mut r, procs, &cfg);
    let findings = finish(&mut run, &mut r, &resource, cfg.keys, Duration::from_secs(15)).await?;
    // Tokens from master 0's lead: half of it above the clock at the grant.
    let lead = i128::try_from(AHEAD.as_micros() / 2).unwrap_or(i128::MAX);
    let from_lead =
        |e: &crate::history::Event| e.token.is_some_and(|t| i128::from(t) > i128::from(e.t / 1000) + offset_us + lead);
    let ahead = run.events()?.iter().filter(|e| e.op == "acq_ok" && from_lead(e)).count();
    r.note(format!(
        "master 0's mark pushed {} s ahead {pushed} time(s), measured slow in {slowed} of {} slow round(s); \
         grants whose token came from master 0's lead: {ahead} of {}",
        AHEAD.as_secs(),
        rounds / 2,
        findings.acquisitions
    ));
    if pushed < rounds {
        r.fail(format!("master 0's mark was seen ahead after only {pushed} of {rounds} pushes"));
    }
    if ahead == 0 {
        r.fail("no grant took its token from master 0's lead: the skew was never exercised");
    }
    drop(proxies);
    Ok(r)
}

/// Raises `mark` on master 0 to its server time plus [`AHEAD`] (never
/// lowers it); whether it was then seen at least that far ahead.
async fn push_ahead(conn: &mut redis::aio::MultiplexedConnection, mark: &str) -> Result<bool, String> {
    const RAISE: &str = r"
local t = redis.call('TIME')
local ahead = tonumber(t[1]) * 1000000 + tonumber(t[2]) + tonumber(ARGV[1])
local mark = tonumber(redis.call('GET', KEYS[1]) or '0')
if mark < ahead then
  redis.call('SET', KEYS[1], string.format('%d', ahead))
  mark = ahead
end
return mark - ahead
";
    let micros = u64::try_from(AHEAD.as_micros()).unwrap_or(u64::MAX);
    let over: i64 =
        redis::Script::new(RAISE).key(mark).arg(micros).invoke_async(conn).await.map_err(|e| format!("mark: {e}"))?;
    Ok(over >= 0)
}

/// A master's `TIME` in µs.
async fn server_micros(node: &RedisServer) -> Result<u64, String> {
    let client = redis::Client::open(node.url()).map_err(|e| e.to_string())?;
    let mut c = client.get_multiplexed_async_connection().await.map_err(|e| e.to_string())?;
    let (s, us): (u64, u64) = redis::cmd("TIME").query_async(&mut c).await.map_err(|e| e.to_string())?;
    Ok(s * 1_000_000 + us)
}
