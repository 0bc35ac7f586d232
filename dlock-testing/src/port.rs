//! Free loopback ports for servers started in other processes.

use std::net::TcpListener;

/// A free TCP port on loopback, for a server started in another process.
///
/// The port comes from below the kernel's ephemeral range
/// (`net.ipv4.ip_local_port_range`). A port from inside that range, bound
/// and released, can be handed out again as the source port of any outgoing
/// connection (another test's client) in the second before the server binds
/// it, and the server then fails to start; a port below the range is never
/// handed out that way. Calls in one process never return the same port (nor
/// a port another call reserved as a cluster bus port), and each candidate is
/// checked with a bind first.
///
/// ```no_run
/// let port = dlock_testing::free_port();
/// assert!(std::net::TcpListener::bind(("127.0.0.1", port)).is_ok());
/// ```
pub fn free_port() -> u16 {
    pick_port(0)
}

/// A free port whose `port + offset` is free too (Redis Cluster's bus port
/// is the client port + 10000), both below the ephemeral range.
fn pick_port(offset: u16) -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::OnceLock;
    static RANGE: OnceLock<Option<(u16, u16)>> = OnceLock::new();
    static NEXT: OnceLock<AtomicU32> = OnceLock::new();
    let Some((low, high)) = *RANGE.get_or_init(ports_outside_the_ephemeral_range) else {
        return kernel_port(offset);
    };
    let span = u32::from(high.saturating_sub(offset).saturating_sub(low));
    if span < 1000 {
        return kernel_port(offset);
    }
    // A different starting point per process, so two test processes on one
    // machine rarely try the same ports.
    let next = NEXT.get_or_init(|| {
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
        AtomicU32::new(nanos ^ std::process::id().wrapping_mul(2_654_435_761))
    });
    // Every port handed out in this process, a cluster node's bus port
    // included: the counter alone kept candidates apart, not a bus port
    // (candidate + 10000) from a later plain candidate, which then found its
    // port taken once the cluster started.
    static HANDED: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    for _ in 0..span {
        let candidate = low + u16::try_from(next.fetch_add(1, Ordering::Relaxed) % span).unwrap_or(0);
        let mut handed = HANDED.lock().unwrap_or_else(|p| p.into_inner());
        let free = |p: u16| !handed.contains(&p) && TcpListener::bind(("127.0.0.1", p)).is_ok();
        if free(candidate) && (offset == 0 || free(candidate + offset)) {
            handed.push(candidate);
            if offset != 0 {
                handed.push(candidate + offset);
            }
            return candidate;
        }
    }
    panic!("no free loopback port between {low} and {}", high - offset)
}

/// The ports from 10000 up to the start of the ephemeral range, or above
/// its end when it starts too low; `None` when neither leaves room (or the
/// range cannot be read), and ports then come from the kernel.
fn ports_outside_the_ephemeral_range() -> Option<(u16, u16)> {
    let text = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").ok()?;
    let mut bounds = text.split_whitespace().map(str::parse::<u16>);
    let (Some(Ok(first)), Some(Ok(last))) = (bounds.next(), bounds.next()) else { return None };
    if first >= 21_000 {
        Some((10_000, first))
    } else if last <= 54_000 {
        Some((last + 1, u16::MAX))
    } else {
        None
    }
}

/// A port the kernel picks (bound to 0, then released): the fallback when
/// no ports lie outside the ephemeral range.
fn kernel_port(offset: u16) -> u16 {
    loop {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0 to find a free port");
        let port = listener.local_addr().expect("local address of a bound listener").port();
        if offset == 0 || port.checked_add(offset).is_some_and(|p| TcpListener::bind(("127.0.0.1", p)).is_ok()) {
            return port;
        }
    }
}

/// A free port whose cluster-bus port (+10000) is free too.
pub(crate) fn free_cluster_port() -> u16 {
    pick_port(10_000)
}

/// Held by the unit tests of this crate that start a server, and by the
/// test of [`free_port`]: a ZooKeeper starting beside that test was seen to
/// take one of the ports it had just been handed, between the bind that
/// found it free and the test's own.
#[cfg(test)]
pub(crate) static SERVERS_STARTING: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[cfg(test)]
mod tests {
    #[test]
    fn free_ports_are_distinct_bindable_and_outside_the_ephemeral_range() {
        let _alone = super::SERVERS_STARTING.lock().unwrap_or_else(|p| p.into_inner());
        let range =
            std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").expect("read the ephemeral range");
        let bounds: Vec<u16> = range.split_whitespace().map(|b| b.parse().expect("a port")).collect();
        let outside = |p: u16| p < bounds[0] || p > bounds[1];
        // Each port is bindable when it is handed out; checked at once, not
        // after all 200, when a server of another test process may have
        // taken one since (as the servers the ports are for do).
        let ports: Vec<u16> = (0..200)
            .map(|_| {
                let p = super::free_port();
                assert!(std::net::TcpListener::bind(("127.0.0.1", p)).is_ok(), "{p} is free");
                p
            })
            .collect();
        let mut distinct = ports.clone();
        distinct.sort_unstable();
        distinct.dedup();
        assert_eq!(distinct.len(), ports.len(), "no port handed out twice");
        for p in ports {
            assert!(outside(p), "{p} lies in the ephemeral range {range}");
        }
        let cluster = super::free_cluster_port();
        assert!(outside(cluster) && outside(cluster + 10_000), "{cluster} and its bus port lie outside {range}");
    }
}
