//! Writer preference and withdrawn intents of a read-write lock, judged
//! from a `rw` row's history (`primitives`).
//!
//! The workers log the mode each acquire asks for (`acq_invoke`, `x` a
//! writer, `s` a reader), and how it ended: granted (`acq_ok`), refused at
//! the end of its wait (`acq_fail` `timeout`) or given up mid-wait
//! (`acq_fail` `cancelled`, its future dropped, `cancel_writers`).
//!
//! * Writer preference (`LockMode::Shared`'s docs): once a writer waits
//!   behind readers, no reader that asked after that is granted before
//!   some writer is granted or gives up. A writer *waits behind readers*
//!   from the first moment of its wait at which a reader holds the key;
//!   it recorded its intent at its first try then, so [`MARGIN`] later
//!   every new reader must wait. The window closes, with [`MARGIN`] to
//!   spare, at the first grant or give-up of *any* writer of the key
//!   after that: a backend records one intent at a time, and once that
//!   writer is granted or gone the next records its own only on its next
//!   try. A killed writer's intent and hold outlive it (see [`check`]).
//! * A withdrawn intent: a writer given up mid-wait, behind readers, takes
//!   its intent back at once, so no reader waiting then waits on for more
//!   than [`PROMPT`] of the time no other writer waited for the key or
//!   held it (their intents and holds keep readers out by right; each is
//!   given [`MARGIN`] more for the wake-up after it).
//!
//! A row where no writer waited behind readers, or where no give-up was
//! checked, judged nothing: [`judge`] fails it.

use std::collections::HashMap;

use crate::harness::Report;
use crate::history::Event;

/// Slack for a try in flight: a writer's intent lands this long after the
/// moment it starts waiting behind readers at the latest.
pub(crate) const MARGIN: u64 = 100_000_000;
/// How soon the readers a given-up writer kept out must be granted.
pub(crate) const PROMPT: u64 = 500_000_000;

/// One acquire of one task: who asked, as what, and how it ended.
#[derive(Debug, Clone)]
struct Attempt {
    key: u32,
    writer: bool,
    invoked: u64,
    granted: Option<u64>,
    /// Given up or refused: the time, and whether it was given up mid-wait.
    failed: Option<(u64, bool)>,
    released: Option<u64>,
    /// When its process was killed, if that ended it.
    killed: Option<u64>,
}

impl Attempt {
    /// When its wait ended, if it did (a killed waiter's did not).
    fn wait_end(&self) -> Option<u64> {
        self.granted.or(self.failed.map(|(t, _)| t))
    }
}

/// How long what a killed process left on the server keeps others out.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Afterlife {
    /// The acquires' wait: a killed waiter's intent lives until its wait
    /// would have ended (its intent's own expiry on Redis and PostgreSQL).
    pub(crate) wait_ns: u64,
    /// The acquires' lease: a killed holder's hold ends by its grant and
    /// this (its sections end inside a lease, so nothing renewed it).
    pub(crate) lease_ns: u64,
    /// On ZooKeeper, how long past the kill its nodes may live: the
    /// session's timeout and the server's tick (a node goes when its
    /// session expires, whatever its lease or wait).
    pub(crate) session_ns: Option<u64>,
}

/// What [`check`] found.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Preference {
    /// Writers that waited behind readers, with a window left to judge.
    pub(crate) writers_waited: u64,
    /// Readers granted although they asked after a writer waited behind
    /// readers, before any writer was granted or gave up.
    pub(crate) readers_passed: u64,
    /// Writers given up mid-wait behind readers, with readers waiting then:
    /// each a withdrawal judged.
    pub(crate) withdrawals: u64,
    /// Readers waiting when such a writer gave up that waited on for more
    /// than [`PROMPT`] of the time no other writer waited or held.
    pub(crate) readers_kept_out: u64,
}

/// Judges `events`. A killed process's hold and intent last as `after`
/// says (on ZooKeeper a session past the kill): counted shorter than the
/// server keeps them, the readers they rightly keep out would be "kept
/// out"; counted longer, a reader let in once they went would have
/// "passed" a writer. So the window in which readers may not pass closes
/// with the lower bound of a killed writer's wait (its wait's end), and
/// what keeps readers out by right lasts its upper bound.
pub(crate) fn check(events: &[Event], after: Afterlife) -> Preference {
    let mut open: HashMap<(u32, u32), usize> = HashMap::new();
    let mut all: Vec<Attempt> = Vec::new();
    for e in events {
        if e.op == "kill" {
            // Every event of the victim precedes its `kill` (logged once reaped).
            let Some(victim) = e.target else { continue };
            open.retain(|&(pid, _), &mut i| {
                let mine = pid == victim;
                if mine {
                    all[i].killed = Some(e.t);
                }
                !mine
            });
            continue;
        }
        let id = (e.pid, e.task);
        match e.op.as_str() {
            "acq_invoke" => {
                let Some(mode) = e.mode.as_deref() else { continue };
                let writer = match mode {
                    "x" => true,
                    "s" => false,
                    _ => continue,
                };
                open.insert(id, all.len());
                let key = e.key.unwrap_or(0);
                all.push(Attempt {
                    key,
                    writer,
                    invoked: e.t,
                    granted: None,
                    failed: None,
                    released: None,
                    killed: None,
                });
            }
            "acq_ok" => {
                if let Some(&i) = open.get(&id) {
                    all[i].granted = Some(e.t);
                }
            }
            "acq_fail" => {
                if let Some(i) = open.remove(&id) {
                    all[i].failed = Some((e.t, e.res.as_deref() == Some("cancelled")));
                }
            }
            "rel_invoke" | "rel_ok" | "rel_err" => {
                if let Some(i) = open.remove(&id) {
                    all[i].released = Some(e.t);
                }
            }
            _ => {}
        }
    }
    let mut by_key: HashMap<u32, Vec<&Attempt>> = HashMap::new();
    for a in &all {
        by_key.entry(a.key).or_default().push(a);
    }
    let mut p = Preference::default();
    for attempts in by_key.values() {
        judge_key(attempts, after, &mut p);
    }
    p
}

fn judge_key(attempts: &[&Attempt], after: Afterlife, p: &mut Preference) {
    // On ZooKeeper, how long a killed process's nodes outlive it.
    let outlived = |a: &Attempt| after.session_ns.zip(a.killed).map(|(s, k)| k + s);
    // Holds: [granted, released), a killed holder's until its lease ran
    // out, or on ZooKeeper its session.
    let hold = |a: &Attempt| {
        a.granted.map(|g| (g, a.released.unwrap_or_else(|| (g + after.lease_ns).max(outlived(a).unwrap_or(0)))))
    };
    // A wait's end; a killed waiter's when its wait would have ended.
    let wait_end = |a: &Attempt| a.wait_end().unwrap_or(a.invoked + after.wait_ns);
    // What a killed waiter's intent keeps out by right, at most: on
    // ZooKeeper its node lives until its session expires.
    let intent_end = |a: &Attempt| a.wait_end().unwrap_or_else(|| wait_end(a).max(outlived(a).unwrap_or(0)));
    let readers: Vec<&Attempt> = attempts.iter().copied().filter(|a| !a.writer).collect();
    let writers: Vec<&Attempt> = attempts.iter().copied().filter(|a| a.writer).collect();
    // Every writer's grant or give-up (a killed waiter's when its wait
    // would have ended).
    let mut writer_ends: Vec<u64> = writers.iter().map(|w| wait_end(w)).collect();
    writer_ends.sort_unstable();
    for w in &writers {
        let Some(end) = w.wait_end() else { continue };
        // The first moment of its wait at which a reader held the key.
        let behind = readers
            .iter()
            .filter_map(|r| hold(r))
            .filter(|&(g, rel)| g < end && rel > w.invoked)
            .map(|(g, _)| g.max(w.invoked))
            .min();
        let Some(behind) = behind else { continue };
        let close = writer_ends.iter().copied().find(|&t| t > behind).unwrap_or(end).min(end);
        if close > behind + 2 * MARGIN {
            p.writers_waited += 1;
            p.readers_passed += readers
                .iter()
                .filter(|r| r.invoked >= behind + MARGIN && r.granted.is_some_and(|g| g + MARGIN < close))
                .count() as u64;
        }
        // Given up mid-wait behind readers: its intent must go at once.
        let Some((gave_up, true)) = w.failed else { continue };
        if behind >= gave_up {
            continue;
        }
        let waiting: Vec<&&Attempt> =
            readers.iter().filter(|r| r.invoked < gave_up && r.wait_end().is_some_and(|t| t > gave_up)).collect();
        if waiting.is_empty() {
            continue;
        }
        p.withdrawals += 1;
        // What kept readers out by right after it left: another writer's
        // wait (its intent) or hold, each [`MARGIN`] longer for the wake-up.
        let mut busy: Vec<(u64, u64)> = writers
            .iter()
            .filter(|o| !std::ptr::eq(**o, *w))
            .flat_map(|o| {
                let wait = (o.invoked, intent_end(o));
                [Some(wait), hold(o)]
            })
            .flatten()
            .map(|(a, b)| (a, b + MARGIN))
            .collect();
        busy.sort_unstable();
        p.readers_kept_out +=
            waiting.iter().filter(|r| r.wait_end().is_some_and(|end| free_time(&busy, gave_up, end) > PROMPT)).count()
                as u64;
    }
}

/// How much of `from..to` no interval of `busy` (sorted by start) covers.
fn free_time(busy: &[(u64, u64)], from: u64, to: u64) -> u64 {
    let (mut free, mut at) = (0, from);
    for &(a, b) in busy {
        if a >= to {
            break;
        }
        if a > at {
            free += a - at;
        }
        at = at.max(b);
        if at >= to {
            return free;
        }
    }
    free + to.saturating_sub(at)
}

/// Files `found` into `r`: a reader that passed a waiting writer or was
/// kept out by a writer gone fails the row, and so does a row that judged
/// nothing (no writer waited behind readers, no give-up checked).
pub(crate) fn judge(r: &mut Report, found: &Preference) {
    r.readers_passed = Some(found.readers_passed);
    r.readers_kept_out = Some(found.readers_kept_out);
    r.note(format!(
        "writer preference: {} writer(s) waited behind readers, {} reader(s) passed one; withdrawn intents: {} \
         give-up(s) judged, {} reader(s) kept out over {} ms with no writer about",
        found.writers_waited,
        found.readers_passed,
        found.withdrawals,
        found.readers_kept_out,
        PROMPT / 1_000_000
    ));
    if !r.expected_safe {
        return;
    }
    if found.readers_passed > 0 {
        r.fail(format!("{} reader(s) granted past a writer waiting behind readers", found.readers_passed));
    }
    if found.readers_kept_out > 0 {
        r.fail(format!("{} reader(s) kept out after the writer that waited left", found.readers_kept_out));
    }
    if found.writers_waited == 0 {
        r.fail("no writer waited behind readers: writer preference was not exercised");
    }
    if found.withdrawals == 0 {
        r.fail("no writer gave up behind waiting readers: the withdrawn intent was not exercised");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;
    const AFTER: Afterlife = Afterlife { wait_ns: 3000 * MS, lease_ns: 500 * MS, session_ns: None };

    fn ev(t_ms: u64, pid: u32, op: &str, mode: Option<&str>, res: Option<&str>) -> Event {
        Event {
            t: t_ms * MS,
            pid,
            key: Some(0),
            mode: mode.map(str::to_owned),
            res: res.map(str::to_owned),
            ..Event::now(op)
        }
    }

    /// Reader 1 holds 0..2000 ms; writer 2 waits from 100 ms and gives up
    /// at 1000 ms; reader 3 asks at 500 ms and is granted at `granted`.
    fn history(granted: u64) -> Vec<Event> {
        let mut v = vec![
            ev(0, 1, "acq_invoke", Some("s"), None),
            ev(1, 1, "acq_ok", Some("s"), None),
            ev(100, 2, "acq_invoke", Some("x"), None),
            ev(500, 3, "acq_invoke", Some("s"), None),
            ev(1000, 2, "acq_fail", Some("x"), Some("cancelled")),
            ev(2000, 1, "rel_invoke", None, None),
        ];
        v.push(ev(granted, 3, "acq_ok", Some("s"), None));
        v.sort_by_key(|e| e.t);
        v
    }

    #[test]
    fn a_reader_let_in_soon_after_the_writer_left_passes() {
        let p = check(&history(1010), AFTER);
        assert_eq!(p, Preference { writers_waited: 1, readers_passed: 0, withdrawals: 1, readers_kept_out: 0 });
    }

    #[test]
    fn a_reader_passing_the_waiting_writer_is_found() {
        let p = check(&history(600), AFTER);
        assert_eq!((p.writers_waited, p.readers_passed), (1, 1));
    }

    #[test]
    fn a_reader_kept_out_after_the_writer_left_is_found() {
        let p = check(&history(3100), AFTER);
        assert_eq!((p.withdrawals, p.readers_kept_out), (1, 1));
    }

    /// `history(granted)` with writer 4 granted at 50 ms and killed, still
    /// holding, at 900 ms: with ZooKeeper its node lives on for a session.
    fn killed_writer(granted: u64) -> Vec<Event> {
        let mut v = history(granted);
        v.push(ev(40, 4, "acq_invoke", Some("x"), None));
        v.push(ev(50, 4, "acq_ok", Some("x"), None));
        let mut kill = ev(900, 0, "kill", None, None);
        kill.target = Some(4);
        v.push(kill);
        v.sort_by_key(|e| e.t);
        v
    }

    #[test]
    fn a_killed_writers_leftovers_keep_readers_out_by_right() {
        // Its node gone 1,100 ms after the kill (2,000 ms), the reader let
        // in at 2,100 ms was kept out by right, not by the writer that left.
        let zk = Afterlife { session_ns: Some(1100 * MS), ..AFTER };
        assert_eq!(check(&killed_writer(2100), zk).readers_kept_out, 0);
        // Counted as a lease from its grant (550 ms), as on Redis, the
        // same reader waited on for nothing.
        assert_eq!(check(&killed_writer(2100), AFTER).readers_kept_out, 1);
        // And the leftovers excuse no more than they cover.
        assert_eq!(check(&killed_writer(2800), zk).readers_kept_out, 1);
    }

    #[test]
    fn only_time_without_another_writer_counts_as_kept_out() {
        assert_eq!(free_time(&[], 10, 30), 20);
        assert_eq!(free_time(&[(0, 12), (15, 20), (18, 25), (40, 50)], 10, 30), 3 + 5);
        assert_eq!(free_time(&[(5, 40)], 10, 30), 0);
    }

    #[test]
    fn a_row_that_judged_nothing_fails() {
        let mut r = Report::new("primitives", "redis (rw)", 0);
        r.expected_safe = true;
        judge(&mut r, &Preference::default());
        assert!(!r.pass && r.notes.contains("not exercised"), "{}", r.notes);
    }
}
