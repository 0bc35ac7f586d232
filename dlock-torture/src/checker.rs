//! The checker: reads the merged history and the resource's final state and
//! computes C1 (overlapping believed holds), C2 (lost updates on the fenced
//! register and on the unfenced control), C4 (fencing, judged from the
//! tokens the clients were handed and the answers they got, independently
//! of the register: see [`fencing`]), C3 (set-full: every op id whose write
//! to a set register was acknowledged must be in the final set) and C5
//! (wait times, orphan recovery).
//! C6 (residue) needs the lock servers and is measured by the scenarios.

use std::collections::{HashMap, HashSet};

use crate::history::Event;

/// What a history shows.
#[derive(Debug, Clone, Default)]
pub(crate) struct Findings {
    pub(crate) acquisitions: u64,
    pub(crate) acq_failures: u64,
    pub(crate) acq_unavailable: u64,
    /// Holds that began while another owner still believed it held the key.
    pub(crate) overlaps: u64,
    pub(crate) lost_updates: u64,
    /// Fenced writes whose outcome is unknown (crash or error mid-write).
    pub(crate) indeterminate: u64,
    pub(crate) stale_refused: u64,
    /// C4 on the register's answers: fenced writes acknowledged although a
    /// write with a higher token had been acknowledged before they began.
    pub(crate) stale_accepted: u64,
    /// C4 on what dlock hands out: grants whose token is not above every
    /// token granted on the key before this grant's acquire began, or
    /// above the token of every exclusive hold of another owner believed
    /// before this one's was (see [`held_order`]).
    pub(crate) token_regressions: u64,
    /// The first such grant, for the report.
    pub(crate) token_regression_example: Option<String>,
    pub(crate) unfenced_lost: u64,
    pub(crate) lost_signals: u64,
    /// Holds refused by fencing, and how many of them had seen their lost
    /// signal by their first refused access.
    pub(crate) stale_holds: u64,
    pub(crate) stale_holds_signalled: u64,
    /// Releases answered "not held" (`release()` = false: the lease had
    /// run out, and maybe another owner held the key): T6c's typed result.
    pub(crate) released_not_held: u64,
    /// How long each acquire took to answer "unavailable" (T5b: a typed
    /// error within a bound, not a hang).
    pub(crate) unavailable_ns: Vec<u64>,
    pub(crate) waits_ns: Vec<u64>,
    /// C3: op ids acknowledged on the fenced set (accepted, then the
    /// section ended), and those of them missing from the final set, key
    /// by key in acknowledgement order.
    pub(crate) set_acked: u64,
    pub(crate) set_missing: Vec<String>,
    /// C3 on the unfenced set control.
    pub(crate) unfenced_set_acked: u64,
    pub(crate) unfenced_set_missing: Vec<String>,
    /// From the first acquire call to the last release answer, ns.
    pub(crate) span_ns: u64,
    /// What the workers' in-process tables held at their end (`residue`
    /// events), when the backend is in-process.
    pub(crate) residue: Option<u64>,
    /// Grants that logged their validity left on return (`left_us`), and
    /// how many of them had none left (R3: never return an expired guard).
    pub(crate) validity_logged: u64,
    pub(crate) expired_on_return: u64,
    /// The smallest validity left on return, µs.
    pub(crate) min_left_us: Option<i64>,
    /// For every killed holder: kill → next grant of its key, ns.
    pub(crate) recoveries_ns: Vec<u64>,
    /// The most holders of other owners believed at once on one key, the
    /// new one included: what a semaphore scenario must have reached for
    /// its limit to have been tested.
    pub(crate) most_holders: u64,
}

impl Findings {
    pub(crate) fn wait_percentile_ms(&self, p: f64) -> f64 {
        percentile_ms(&self.waits_ns, p)
    }
}

/// [`dlock_testing::percentile`] of nanoseconds, in ms; 0 when empty.
pub(crate) fn percentile_ms(values_ns: &[u64], p: f64) -> f64 {
    dlock_testing::percentile(values_ns, p).map_or(0.0, |ns| ns as f64 / 1e6)
}

#[derive(Debug, Clone)]
struct Interval {
    owner: String,
    start: u64,
    end: u64,
    lost_at: Option<u64>,
    first_stale: Option<u64>,
    /// How it was held: `None` exclusive, `s` shared, `p<N>` one of N permits.
    mode: Option<String>,
    token: Option<u64>,
}

/// How many holders of `mode` a key admits beside `others` (the modes of
/// the holds of other owners that are still believed): C1 generalised to
/// read-write locks and semaphores. An exclusive hold admits nobody; a
/// shared one other shared ones; a permit of N at most N − 1 other permits
/// of N.
fn admits(mode: Option<&str>, others: &[Option<&str>]) -> bool {
    match mode {
        None => others.is_empty(),
        Some("s") => others.iter().all(|o| *o == Some("s")),
        Some(permit) => {
            let limit: usize = permit.strip_prefix('p').and_then(|n| n.parse().ok()).unwrap_or(1);
            others.iter().all(|o| *o == Some(permit)) && others.len() < limit
        }
    }
}

/// The final state of one key on the resource.
#[derive(Debug, Clone, Default)]
pub(crate) struct KeyState {
    pub(crate) fenced: i64,
    pub(crate) unfenced: i64,
    /// The fenced set's and the unfenced set control's final op ids.
    pub(crate) set: HashSet<String>,
    pub(crate) unfenced_set: HashSet<String>,
}

#[derive(Default)]
struct PerKey {
    acked_f: i64,
    indet_f: i64,
    acked_u: i64,
    /// Op ids whose set write was acknowledged: (fenced set?, id).
    acked_sets: Vec<(bool, String)>,
    intervals: Vec<Interval>,
    grants: Vec<Grant>,
    /// Fenced writes acknowledged: (invoked, answered, token).
    accepted_f: Vec<(u64, u64, u64)>,
}

/// One grant, as its client saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Grant {
    /// When its acquire was called, and when it returned the grant.
    pub(crate) invoked: u64,
    pub(crate) granted: u64,
    pub(crate) token: u64,
    pub(crate) owner: String,
}

/// A set write accepted by the resource: (key, to the fenced set?, op id).
type SetWrite = (u32, bool, String);

/// Checks `events` (sorted by time) against the resource's final state.
/// `run_end` closes holds that never released.
pub(crate) fn check(events: &[Event], finals: &HashMap<u32, KeyState>, run_end: u64) -> Findings {
    let mut f = Findings::default();
    let mut keys: HashMap<u32, PerKey> = HashMap::new();
    // (pid, task) -> (key, interval) of the open hold
    let mut open: HashMap<(u32, u32), (u32, Interval)> = HashMap::new();
    let mut invoked: HashMap<(u32, u32), u64> = HashMap::new();
    // A write invoked and never answered (its process died): indeterminate.
    let mut pending_w: HashMap<(u32, u32, String), (u32, u64)> = HashMap::new();
    let mut kills: Vec<(u64, u32, Vec<u32>)> = Vec::new();
    // Set writes accepted in the current section of (pid, task): they count
    // as acknowledged once its `cs_exit` is logged.
    let mut set_written: HashMap<(u32, u32), Vec<SetWrite>> = HashMap::new();
    let (mut first_invoke, mut last_answer) = (None, 0u64);

    for e in events {
        let id = (e.pid, e.task);
        match e.op.as_str() {
            "acq_invoke" => {
                invoked.insert(id, e.t);
                first_invoke.get_or_insert(e.t);
            }
            "rel_ok" | "rel_err" => {
                last_answer = last_answer.max(e.t);
                if e.res.as_deref() == Some("not_held") {
                    f.released_not_held += 1;
                }
            }
            "cs_enter" => {
                set_written.remove(&id);
            }
            "cs_exit" => {
                for (key, fenced, op) in set_written.remove(&id).unwrap_or_default() {
                    keys.entry(key).or_default().acked_sets.push((fenced, op));
                }
            }
            "residue" => *f.residue.get_or_insert(0) += u64::try_from(e.val.unwrap_or(0)).unwrap_or(0),
            "acq_ok" => {
                f.acquisitions += 1;
                if let Some(left) = e.left_us {
                    f.validity_logged += 1;
                    f.expired_on_return += u64::from(left <= 0);
                    f.min_left_us = Some(f.min_left_us.map_or(left, |m| m.min(left)));
                }
                let asked = invoked.remove(&id);
                if let Some(t0) = asked {
                    f.waits_ns.push(e.t.saturating_sub(t0));
                }
                let key = e.key.unwrap_or(0);
                if let Some(token) = e.token {
                    keys.entry(key).or_default().grants.push(Grant {
                        // Not knowing when it was asked for, take the
                        // grant's own time: every earlier grant then counts.
                        invoked: asked.unwrap_or(e.t),
                        granted: e.t,
                        token,
                        owner: e.owner.clone().unwrap_or_default(),
                    });
                }
                let iv = Interval {
                    owner: e.owner.clone().unwrap_or_default(),
                    start: e.t,
                    end: e.vu.unwrap_or(u64::MAX),
                    lost_at: None,
                    first_stale: None,
                    mode: e.mode.clone(),
                    token: e.token,
                };
                if let Some((k, old)) = open.insert(id, (key, iv)) {
                    keys.entry(k).or_default().intervals.push(old);
                }
            }
            "acq_fail" => {
                let asked = invoked.remove(&id);
                f.acq_failures += 1;
                if e.res.as_deref().is_some_and(|r| r == "quorum_unavailable" || r == "backend") {
                    f.acq_unavailable += 1;
                    if let Some(t0) = asked {
                        f.unavailable_ns.push(e.t.saturating_sub(t0));
                    }
                }
            }
            "lost" => {
                f.lost_signals += 1;
                if let Some((_, iv)) = open.get_mut(&id) {
                    let end = e.vu.map_or(e.t, |vu| vu.min(e.t));
                    iv.end = iv.end.min(end);
                    iv.lost_at.get_or_insert(e.t);
                }
            }
            "rel_invoke" => {
                if let Some((k, mut iv)) = open.remove(&id) {
                    iv.end = iv.end.min(e.t);
                    keys.entry(k).or_default().intervals.push(iv);
                }
            }
            "w_invoke" => {
                pending_w.insert((e.pid, e.task, e.reg.clone().unwrap_or_default()), (e.key.unwrap_or(0), e.t));
            }
            "write" => {
                let reg = e.reg.clone().unwrap_or_default();
                let asked = pending_w.remove(&(e.pid, e.task, reg.clone())).map(|(_, t)| t);
                let k = keys.entry(e.key.unwrap_or(0)).or_default();
                match (reg.as_str(), e.res.as_deref()) {
                    ("f", Some("ok")) => {
                        k.acked_f += 1;
                        if let Some(token) = e.token {
                            k.accepted_f.push((asked.unwrap_or(e.t), e.t, token));
                        }
                    }
                    ("f", Some("stale")) => {
                        f.stale_refused += 1;
                        if let Some((_, iv)) = open.get_mut(&id) {
                            iv.first_stale.get_or_insert(e.t);
                        }
                    }
                    ("f", Some("error")) => k.indet_f += 1,
                    ("u", Some("ok")) => k.acked_u += 1,
                    (set @ ("s" | "us"), Some("ok")) => {
                        if let Some(op) = e.id.clone() {
                            set_written.entry(id).or_default().push((e.key.unwrap_or(0), set == "s", op));
                        }
                    }
                    _ => {}
                }
            }
            "kill" => {
                let target = e.target.unwrap_or(0);
                let mut held = Vec::new();
                let ids: Vec<(u32, u32)> = open.keys().filter(|(pid, _)| *pid == target).copied().collect();
                for id in ids {
                    if let Some((k, mut iv)) = open.remove(&id) {
                        iv.end = iv.end.min(e.t);
                        held.push(k);
                        keys.entry(k).or_default().intervals.push(iv);
                    }
                }
                kills.push((e.t, target, held));
            }
            _ => {}
        }
    }
    for ((_, _, reg), (key, _)) in pending_w {
        if reg == "f" {
            keys.entry(key).or_default().indet_f += 1;
        }
    }
    for (_, (k, mut iv)) in open.drain() {
        iv.end = iv.end.min(run_end);
        keys.entry(k).or_default().intervals.push(iv);
    }

    f.span_ns = first_invoke.map_or(0, |t0| last_answer.saturating_sub(t0));
    let mut key_order: Vec<u32> = keys.keys().copied().collect();
    key_order.sort_unstable();
    for key in &key_order {
        let Some(pk) = keys.get(key) else { continue };
        let state = finals.get(key);
        // C3: an acknowledged id absent from the final set was lost.
        for (fenced, op) in &pk.acked_sets {
            let (acked, missing, set) = if *fenced {
                (&mut f.set_acked, &mut f.set_missing, state.map(|s| &s.set))
            } else {
                (&mut f.unfenced_set_acked, &mut f.unfenced_set_missing, state.map(|s| &s.unfenced_set))
            };
            *acked += 1;
            if !set.is_some_and(|s| s.contains(op)) {
                missing.push(op.clone());
            }
        }
    }

    for (key, pk) in &mut keys {
        let state = finals.get(key).cloned().unwrap_or_default();
        // C2 on the fenced register: final must lie in [A, A + I].
        let lost = (pk.acked_f - state.fenced).max(0);
        f.lost_updates += u64::try_from(lost).unwrap_or(0);
        f.indeterminate += u64::try_from(pk.indet_f).unwrap_or(0);
        f.unfenced_lost += u64::try_from((pk.acked_u - state.unfenced).max(0)).unwrap_or(0);
        // C4 from the clients' side, not from the register's own log.
        let regressions = fencing(&pk.grants);
        let out_of_order = held_order(&pk.intervals);
        // A grant both rules find counts once.
        let mut found: HashSet<(&str, u64)> = regressions.iter().map(|(g, _)| (g.owner.as_str(), g.token)).collect();
        found.extend(out_of_order.iter().map(|(later, _)| (later.owner.as_str(), later.token.unwrap_or(0))));
        f.token_regressions += found.len() as u64;
        if f.token_regression_example.is_none() {
            if let Some((g, before)) = regressions.first() {
                f.token_regression_example = Some(format!(
                    "key {key}: {} was granted token {} although {} had been granted token {} before it asked",
                    g.owner, g.token, before.owner, before.token
                ));
            } else if let Some((later, before)) = out_of_order.first() {
                f.token_regression_example = Some(format!(
                    "key {key}: {} held it with token {} after {} had held it with token {}",
                    later.owner,
                    later.token.unwrap_or(0),
                    before.owner,
                    before.token.unwrap_or(0)
                ));
            }
        }
        f.stale_accepted += stale_accepted(&pk.accepted_f);
        // C1: a hold that starts before an earlier hold of another owner ended.
        pk.intervals.sort_by_key(|iv| iv.start);
        let mut active: Vec<&Interval> = Vec::new();
        for iv in &pk.intervals {
            active.retain(|a| a.end > iv.start);
            // A hold whose known validity had ended before its grant was even
            // logged (its process was paused between the two) was never
            // believed at any moment the history can place; its true belief
            // preceded the pause and the next grant.
            let believed = iv.end > iv.start;
            let others: Vec<Option<&str>> =
                active.iter().filter(|a| a.owner != iv.owner).map(|a| a.mode.as_deref()).collect();
            if believed && !admits(iv.mode.as_deref(), &others) {
                f.overlaps += 1;
            }
            if believed {
                f.most_holders = f.most_holders.max(others.len() as u64 + 1);
            }
            if believed {
                active.push(iv);
            }
            if let Some(stale_t) = iv.first_stale {
                f.stale_holds += 1;
                if iv.lost_at.is_some_and(|l| l <= stale_t) {
                    f.stale_holds_signalled += 1;
                }
            }
        }
    }
    // Orphan recovery: kill → the next grant of a key the victim held.
    for (t, _, held) in kills {
        for k in held {
            let next =
                keys.get(&k).and_then(|pk| pk.intervals.iter().filter(|iv| iv.start > t).map(|iv| iv.start).min());
            if let Some(next) = next {
                f.recoveries_ns.push(next - t);
            }
        }
    }
    f
}

/// C4 on what the lock hands out: every grant's token must be above the
/// token of every grant of the same key that was returned before this
/// grant's acquire was called (earlier in real time; grants whose acquires
/// overlap are not ordered, and C1 judges them). Returns each grant that is
/// not, with the earlier grant of the highest token. This needs nothing
/// from the register: a lock that hands a new holder a lower (or the same)
/// token fails here even though the register then refuses the new holder
/// and accepts the stale one.
pub(crate) fn fencing(grants: &[Grant]) -> Vec<(&Grant, &Grant)> {
    let mut by_invoke: Vec<&Grant> = grants.iter().collect();
    by_invoke.sort_by_key(|g| g.invoked);
    let mut by_grant: Vec<&Grant> = grants.iter().collect();
    by_grant.sort_by_key(|g| g.granted);
    let mut done = by_grant.into_iter().peekable();
    // The grant of the highest token among those returned so far.
    let mut highest: Option<&Grant> = None;
    let mut bad = Vec::new();
    for g in by_invoke {
        while let Some(h) = done.next_if(|h| h.granted < g.invoked) {
            if highest.is_none_or(|m| h.token > m.token) {
                highest = Some(h);
            }
        }
        if let Some(h) = highest
            && h.token >= g.token
        {
            bad.push((g, h));
        }
    }
    bad
}

/// C4 by the order of holds: pairs (later, earlier) of exclusive holds of
/// two owners, each believed for a while (its interval is not empty), the
/// later believed from a later moment, whose tokens do not grow. A hold
/// believed at a moment held the key on the server then (the clients'
/// validity is a bound from below on the server's lease), and exclusive
/// holds of a key are apart on the server, so the one believed first was
/// granted first, however its acquire and the other's overlapped: this
/// judges grants [`fencing`] leaves alone, those of acquires asked at
/// once, as on a contended key.
fn held_order(intervals: &[Interval]) -> Vec<(&Interval, &Interval)> {
    let mut held: Vec<&Interval> =
        intervals.iter().filter(|iv| iv.mode.is_none() && iv.token.is_some() && iv.end > iv.start).collect();
    held.sort_by_key(|iv| iv.start);
    // The earlier hold of the highest token, and the highest of another
    // owner than that one's: whoever comes next is judged against the
    // highest token of an owner other than itself.
    let (mut best, mut other): (Option<&Interval>, Option<&Interval>) = (None, None);
    let mut bad = Vec::new();
    for iv in held {
        let against = if best.is_some_and(|b| b.owner == iv.owner) { other } else { best };
        if let Some(before) = against.filter(|b| b.token >= iv.token) {
            bad.push((iv, before));
        }
        if best.is_none_or(|b| iv.token > b.token) {
            if best.is_some_and(|b| b.owner != iv.owner) {
                other = best;
            }
            best = Some(iv);
        } else if best.is_some_and(|b| b.owner != iv.owner) && other.is_none_or(|o| iv.token > o.token) {
            other = Some(iv);
        }
    }
    bad
}

/// C4 on the register's answers: fenced writes (invoked, answered, token)
/// acknowledged although a write with a higher token had been acknowledged
/// before they were invoked. The harness's register refuses those, so this
/// is a check of the harness's own fencing, judged from the clients.
fn stale_accepted(writes: &[(u64, u64, u64)]) -> u64 {
    let mut by_invoke: Vec<&(u64, u64, u64)> = writes.iter().collect();
    by_invoke.sort_by_key(|w| w.0);
    let mut by_answer: Vec<&(u64, u64, u64)> = writes.iter().collect();
    by_answer.sort_by_key(|w| w.1);
    let mut done = by_answer.into_iter().peekable();
    let mut max = None;
    let mut stale = 0;
    for w in by_invoke {
        while let Some(d) = done.next_if(|d| d.1 < w.0) {
            max = max.max(Some(d.2));
        }
        if max.is_some_and(|m| m > w.2) {
            stale += 1;
        }
    }
    stale
}

#[cfg(test)]
mod tests {
    use super::*;

    fn e(t: u64, pid: u32, op: &str, owner: &str) -> Event {
        Event { t, pid, op: op.into(), key: Some(0), owner: Some(owner.into()), token: Some(t), ..Event::default() }
    }

    fn moded(t: u64, pid: u32, op: &str, owner: &str, mode: Option<&str>) -> Event {
        Event { mode: mode.map(str::to_owned), ..e(t, pid, op, owner) }
    }

    /// Readers overlap freely, a writer beside a reader is a violation;
    /// N permit holders are fine and N + 1 are not.
    #[test]
    fn shared_holds_and_permits_overlap_only_as_their_mode_admits() {
        let readers = [
            moded(1, 1, "acq_ok", "a", Some("s")),
            moded(2, 2, "acq_ok", "b", Some("s")),
            e(5, 1, "rel_invoke", "a"),
            e(6, 2, "rel_invoke", "b"),
        ];
        assert_eq!(check(&readers, &HashMap::new(), 10).overlaps, 0);
        let writer_beside_reader = [
            moded(1, 1, "acq_ok", "a", Some("s")),
            moded(2, 2, "acq_ok", "b", None),
            e(5, 1, "rel_invoke", "a"),
            e(6, 2, "rel_invoke", "b"),
        ];
        assert_eq!(check(&writer_beside_reader, &HashMap::new(), 10).overlaps, 1);
        let permits = |n: u32| -> Vec<Event> {
            let mut events: Vec<Event> =
                (0..n).map(|i| moded(1 + u64::from(i), i + 1, "acq_ok", &format!("o{i}"), Some("p2"))).collect();
            events.extend((0..n).map(|i| e(10 + u64::from(i), i + 1, "rel_invoke", &format!("o{i}"))));
            events
        };
        let two = check(&permits(2), &HashMap::new(), 20);
        assert_eq!((two.overlaps, two.most_holders), (0, 2));
        let three = check(&permits(3), &HashMap::new(), 20);
        assert_eq!((three.overlaps, three.most_holders), (1, 3));
    }

    #[test]
    fn overlapping_holds_are_counted_and_disjoint_ones_are_not() {
        let events = vec![
            e(1, 1, "acq_ok", "a"),
            e(5, 2, "acq_ok", "b"),
            e(6, 1, "rel_invoke", "a"),
            e(7, 2, "rel_invoke", "b"),
            e(8, 3, "acq_ok", "c"),
            e(9, 3, "rel_invoke", "c"),
        ];
        let f = check(&events, &HashMap::new(), 10);
        assert_eq!(f.overlaps, 1);
        assert_eq!(f.acquisitions, 3);
    }

    /// A grant logged only after its process was resumed, with a validity
    /// that had already ended: not an overlap with the hold taken meanwhile.
    #[test]
    fn a_hold_logged_after_its_validity_is_not_an_overlap() {
        let mut lost = e(6, 2, "lost", "b");
        lost.vu = Some(3);
        let events = vec![
            e(1, 1, "acq_ok", "a"),
            e(5, 2, "acq_ok", "b"),
            lost,
            e(7, 1, "rel_invoke", "a"),
            e(8, 2, "rel_invoke", "b"),
        ];
        assert_eq!(check(&events, &HashMap::new(), 12).overlaps, 0);
        // The same hold still believed past its log time does overlap.
        let mut lost = e(6, 2, "lost", "b");
        lost.vu = Some(6);
        let events = vec![
            e(1, 1, "acq_ok", "a"),
            e(5, 2, "acq_ok", "b"),
            lost,
            e(7, 1, "rel_invoke", "a"),
            e(8, 2, "rel_invoke", "b"),
        ];
        assert_eq!(check(&events, &HashMap::new(), 12).overlaps, 1);
    }

    #[test]
    fn a_lost_signal_ends_the_belief_at_the_known_validity() {
        let mut lost = e(9, 1, "lost", "a");
        lost.vu = Some(4);
        let events = vec![
            e(1, 1, "acq_ok", "a"),
            e(5, 2, "acq_ok", "b"),
            lost,
            e(10, 1, "rel_invoke", "a"),
            e(11, 2, "rel_invoke", "b"),
        ];
        assert_eq!(check(&events, &HashMap::new(), 12).overlaps, 0);
    }

    fn set_write(t: u64, pid: u32, reg: &str, res: &str, op: &str) -> Event {
        Event { reg: Some(reg.into()), res: Some(res.into()), id: Some(op.into()), ..e(t, pid, "write", "x") }
    }

    /// C3: an id acknowledged (accepted, then `cs_exit`) but absent from the
    /// final set is missing; an id refused, or whose section never ended
    /// (its process died after the write), is not required.
    #[test]
    fn set_full_names_acknowledged_ids_missing_from_the_final_set() {
        let events = vec![
            e(1, 1, "cs_enter", "a"),
            set_write(2, 1, "s", "ok", "1-0-1"),
            set_write(3, 1, "us", "ok", "1-0-1"),
            e(4, 1, "cs_exit", "a"),
            e(5, 2, "cs_enter", "b"),
            set_write(6, 2, "s", "ok", "2-0-1"),
            set_write(7, 2, "us", "ok", "2-0-1"),
            e(8, 2, "cs_exit", "b"),
            e(9, 3, "cs_enter", "c"),
            set_write(10, 3, "s", "stale", "3-0-1"),
            e(11, 3, "cs_exit", "c"),
            e(12, 4, "cs_enter", "d"),
            set_write(13, 4, "s", "ok", "4-0-1"),
        ];
        let finals = HashMap::from([(
            0,
            KeyState {
                set: HashSet::from(["1-0-1".to_owned()]),
                unfenced_set: HashSet::from(["1-0-1".to_owned(), "2-0-1".to_owned()]),
                ..KeyState::default()
            },
        )]);
        let f = check(&events, &finals, 20);
        assert_eq!(f.set_acked, 2);
        assert_eq!(f.set_missing, vec!["2-0-1".to_owned()]);
        assert_eq!(f.unfenced_set_acked, 2);
        assert!(f.unfenced_set_missing.is_empty());
    }

    /// R3: a grant that logged no validity left is counted; one with time
    /// left is not, and grants that logged nothing are not judged.
    #[test]
    fn grants_returned_with_their_validity_over_are_counted() {
        let mut late = e(1, 1, "acq_ok", "a");
        late.left_us = Some(-300);
        let mut on_time = e(3, 2, "acq_ok", "b");
        on_time.left_us = Some(250_000);
        let unlogged = e(5, 3, "acq_ok", "c");
        let f = check(
            &[late, e(2, 1, "rel_invoke", "a"), on_time, e(4, 2, "rel_invoke", "b"), unlogged],
            &HashMap::new(),
            6,
        );
        assert_eq!(f.acquisitions, 3);
        assert_eq!(f.validity_logged, 2);
        assert_eq!(f.expired_on_return, 1);
        assert_eq!(f.min_left_us, Some(-300));
    }

    fn fenced_write(invoked: u64, answered: u64, pid: u32, token: u64) -> [Event; 2] {
        let mut w = e(invoked, pid, "w_invoke", "a");
        w.reg = Some("f".into());
        w.token = Some(token);
        let mut done = w.clone();
        done.t = answered;
        done.op = "write".into();
        done.res = Some("ok".into());
        [w, done]
    }

    #[test]
    fn lost_updates_and_stale_acceptance_are_found() {
        // Token 5 acknowledged at 3; a write with token 4 invoked at 4 and
        // acknowledged: stale. Two acknowledged increments, final 1: one lost.
        let mut events = vec![e(1, 1, "acq_ok", "a")];
        events.extend(fenced_write(2, 3, 1, 5));
        events.extend(fenced_write(4, 5, 2, 4));
        events.push(e(6, 1, "rel_invoke", "a"));
        let finals = HashMap::from([(0, KeyState { fenced: 1, unfenced: 0, ..KeyState::default() })]);
        let f = check(&events, &finals, 7);
        assert_eq!(f.lost_updates, 1);
        assert_eq!(f.stale_accepted, 1);
        // Overlapping writes are not ordered: no stale acceptance.
        let mut events = fenced_write(2, 5, 1, 5).to_vec();
        events.extend(fenced_write(4, 6, 2, 4));
        events.sort_by_key(|e| e.t);
        assert_eq!(check(&events, &HashMap::new(), 7).stale_accepted, 0);
    }

    fn grant(invoked: u64, granted: u64, token: u64, owner: &str) -> Grant {
        Grant { invoked, granted, token, owner: owner.into() }
    }

    /// C4: a grant whose token is not above a grant returned before its
    /// acquire began fails, a lower and an equal token alike; grants whose
    /// acquires overlap are not ordered.
    #[test]
    fn fencing_catches_a_token_that_does_not_grow() {
        let rising = [grant(0, 1, 10, "a"), grant(2, 3, 11, "b"), grant(4, 5, 12, "c")];
        assert!(fencing(&rising).is_empty());
        let lower = [grant(0, 1, 10, "a"), grant(2, 3, 9, "b")];
        let bad = fencing(&lower);
        assert_eq!(bad.len(), 1);
        assert_eq!((bad[0].0.owner.as_str(), bad[0].1.owner.as_str()), ("b", "a"));
        assert_eq!(fencing(&[grant(0, 1, 10, "a"), grant(2, 3, 10, "b")]).len(), 1);
        // b asked before a's grant returned: not ordered, not judged.
        assert!(fencing(&[grant(0, 2, 10, "a"), grant(1, 3, 9, "b")]).is_empty());
        // Against every earlier grant, not only the last one.
        assert_eq!(fencing(&[grant(0, 1, 20, "a"), grant(2, 3, 5, "b"), grant(4, 5, 6, "c")]).len(), 2);
    }

    /// C4 by the order of holds: two acquires asked at once, the one held
    /// later with the smaller token, is found (the rule of asking alone
    /// does not judge them); growing tokens, shared holds, a hold never
    /// believed and one owner's own holds are not faults.
    #[test]
    fn a_later_hold_with_a_smaller_token_is_found_though_asked_at_once() {
        let ok = |t: u64, pid: u32, owner: &str, token: u64, mode: Option<&str>| Event {
            token: Some(token),
            mode: mode.map(str::to_owned),
            ..e(t, pid, "acq_ok", owner)
        };
        let run = |tokens: (u64, u64), owners: (&str, &str), mode: Option<&str>| {
            let events = vec![
                e(1, 1, "acq_invoke", owners.0),
                e(2, 2, "acq_invoke", owners.1),
                ok(3, 1, owners.0, tokens.0, mode),
                e(4, 1, "rel_invoke", owners.0),
                ok(5, 2, owners.1, tokens.1, mode),
                e(6, 2, "rel_invoke", owners.1),
            ];
            check(&events, &HashMap::new(), 7)
        };
        let f = run((9, 8), ("a", "b"), None);
        assert_eq!(f.token_regressions, 1, "{f:?}");
        assert!(f.token_regression_example.as_deref().is_some_and(|x| x.contains("b held it with token 8")), "{f:?}");
        assert_eq!(run((9, 9), ("a", "b"), None).token_regressions, 1);
        assert_eq!(run((8, 9), ("a", "b"), None).token_regressions, 0);
        assert_eq!(run((9, 8), ("a", "b"), Some("s")).token_regressions, 0);
        assert_eq!(run((9, 9), ("a", "a"), None).token_regressions, 0);
        // The first hold's validity had ended before it was logged: never
        // believed, so it orders nothing.
        let mut events = vec![e(1, 1, "acq_invoke", "a"), e(2, 2, "acq_invoke", "b")];
        events.push(Event { vu: Some(2), ..ok(3, 1, "a", 9, None) });
        events.extend([e(4, 1, "rel_invoke", "a"), ok(5, 2, "b", 8, None), e(6, 2, "rel_invoke", "b")]);
        assert_eq!(check(&events, &HashMap::new(), 7).token_regressions, 0);
        // Against the highest token of another owner, not only the last
        // (asking logged by neither, so both rules judge it: counted once).
        let events = vec![
            ok(1, 1, "a", 20, None),
            e(2, 1, "rel_invoke", "a"),
            ok(3, 2, "b", 21, None),
            e(4, 2, "rel_invoke", "b"),
            ok(5, 1, "b", 22, None),
            e(6, 1, "rel_invoke", "b"),
            ok(7, 2, "c", 19, None),
            e(8, 2, "rel_invoke", "c"),
        ];
        let f = check(&events, &HashMap::new(), 9);
        assert_eq!(f.token_regressions, 1, "{f:?}");
        assert!(f.token_regression_example.as_deref().is_some_and(|x| x.contains("c was granted token 19")), "{f:?}");
    }

    /// The same through the history: acq_invoke/acq_ok pairs per key.
    #[test]
    fn token_regressions_are_found_in_the_history() {
        let ok = |t: u64, pid: u32, token: u64| Event { token: Some(token), ..e(t, pid, "acq_ok", "x") };
        let events = vec![
            e(1, 1, "acq_invoke", "a"),
            ok(2, 1, 7),
            e(3, 1, "rel_invoke", "a"),
            e(4, 2, "acq_invoke", "b"),
            ok(5, 2, 3),
            e(6, 2, "rel_invoke", "b"),
        ];
        let f = check(&events, &HashMap::new(), 7);
        assert_eq!(f.token_regressions, 1);
        assert!(f.token_regression_example.as_deref().is_some_and(|x| x.contains("token 3")), "{f:?}");
    }
}
