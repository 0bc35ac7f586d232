//! The watchdog: one task per [`Locker`](crate::Locker) renews every hold
//! kept in watchdog mode (Redisson's shared timer), sleeping until the
//! earliest instant of the schedule in `holds.rs`. Filing and unfiling a
//! hold spawns and wakes nothing. If the task stops, guards still lose
//! their locks when the leases they can vouch for end; the next hold filed
//! starts a new task. More: `docs/core-design.md`.

use std::sync::Arc;
use std::time::Duration;

use futures_util::stream::{FuturesUnordered, StreamExt};
use tokio::time::{sleep_until, Instant};

use super::holds::{Hold, HoldId, Kick, Renew, Renewing, Table};
use super::Engine;
use crate::backend::signal::{renewed_lease_expired, Expiry};
use crate::backend::{LostReason, RenewRequest, Renewal};
use crate::error::Result;
use crate::metrics::{Op, Stopwatch};

/// How early a renewal may go out with others that are due: a thirtieth
/// of its lease, and no more than this.
const RENEW_EARLY_MAX: Duration = Duration::from_millis(10);

/// Holds pending that wake the task to sort them, so `pending` stays small
/// however long the task sleeps.
const DRAIN_PENDING_AT: usize = 1024;

impl Table {
    /// A watchdog-mode guard joins hold `id` (granted at `granted_at`):
    /// renew it every lease/3 from now on, if nothing renews it yet.
    pub(super) fn renew(&mut self, id: HoldId, renew: Renew, granted_at: Instant) -> Kick {
        let Some(hold) = self.get_mut(id) else { return Kick::Nothing };
        let Some(valid_until) = hold.valid_until else { return Kick::Nothing };
        let renew_until = renew.max_hold.map(|m| granted_at + m);
        if let Some(renewing) = hold.renewing.as_mut() {
            renewing.guards += 1;
            renewing.renew_until = match (renewing.renew_until, renew_until) {
                (Some(a), Some(b)) => Some(a.max(b)),
                _ => None,
            };
            hold.watch.set_terms(valid_until, Expiry::Renewed { renew_until: renewing.renew_until });
            return Kick::Nothing;
        }
        let mut renewing = Renewing {
            lease: renew.lease,
            guards: 1,
            renew_until,
            next_renewal: granted_at + renew.lease / 3,
            in_flight: false,
            filed_at: valid_until,
            in_due: false,
        };
        renewing.filed_at = renewing.attention(valid_until);
        hold.watch.set_terms(valid_until, Expiry::Renewed { renew_until });
        let at = renewing.filed_at;
        hold.renewing = Some(renewing);
        let s = &mut self.schedule;
        s.filed += 1;
        s.pending.push(id);
        if !s.running {
            s.running = true;
            return Kick::Start;
        }
        // No deadline: the task sleeps until woken.
        let sooner = s.sleeping_until.is_none_or(|until| at < until);
        if sooner || s.pending.len() >= DRAIN_PENDING_AT {
            Kick::Wake
        } else {
            Kick::Nothing
        }
    }

    /// Files hold `id` under the instant it next needs attention, moving it
    /// from where it was filed before.
    fn file(&mut self, id: HoldId) {
        let Some(hold) = self.get_mut(id) else { return };
        let (Some(renewing), Some(valid_until)) = (hold.renewing.as_mut(), hold.valid_until) else { return };
        let old = (renewing.filed_at, renewing.in_due);
        renewing.filed_at = renewing.attention(valid_until);
        renewing.in_due = true;
        let at = renewing.filed_at;
        if old.1 {
            self.schedule.due.remove(&(old.0, id));
        }
        self.schedule.due.insert((at, id));
    }

    /// Moves the pending holds still renewed into `due`.
    fn drain_pending(&mut self) {
        for id in std::mem::take(&mut self.schedule.pending) {
            let filed = self.get_mut(id).and_then(|h| h.renewing.as_mut()).filter(|r| !r.in_due).map(|r| {
                r.in_due = true;
                r.filed_at
            });
            if let Some(at) = filed {
                self.schedule.due.insert((at, id));
            }
        }
    }

    /// Hold `id`'s lease ended unrenewed: its guards lose it.
    fn lease_ended(&mut self, id: HoldId) {
        let Some(hold) = self.get_mut(id) else { return };
        let Some(renewing) = hold.renewing.as_ref() else { return };
        let reason = match hold.valid_until {
            Some(valid_until) if !renewing.in_flight => renewed_lease_expired(renewing.renew_until, valid_until),
            _ => LostReason::RenewalFailed,
        };
        lose(hold, reason);
        self.stop_renewing(id);
    }
}

fn lose(hold: &mut Hold, reason: LostReason) {
    if hold.watch.lose(reason) {
        tracing::warn!(key = %hold.key.log_id(), %reason, "dlock.lost");
    }
}

impl Engine {
    /// Does what a change of the schedule needs of the task.
    pub(super) fn kick(self: &Arc<Self>, kick: Kick) {
        match kick {
            Kick::Nothing => {}
            Kick::Wake => self.holds.wake.notify_one(),
            Kick::Start => match tokio::runtime::Handle::try_current() {
                Ok(runtime) => {
                    // `Serving` is made here, not in the task: a task dropped
                    // before its first poll must still mark the schedule unserved.
                    runtime.spawn(run(Serving { engine: self.clone(), done: false }));
                }
                Err(_) => {
                    self.holds.table().schedule.running = false;
                    tracing::warn!("dlock: lock taken outside a tokio runtime; its lease is not renewed");
                }
            },
        }
    }
}

/// Marks the schedule unserved when the task ends for any reason, including
/// its runtime shutting down, so the next hold filed starts a new one.
struct Serving {
    engine: Arc<Engine>,
    /// Set when the task ended on its own and already said so under the
    /// table's lock (a new task may be serving by the time this drops).
    done: bool,
}

impl Drop for Serving {
    fn drop(&mut self) {
        if !self.done {
            let mut table = self.engine.holds.table();
            table.schedule.running = false;
            table.schedule.sleeping_until = None;
        }
    }
}

async fn run(mut serving: Serving) {
    let engine = serving.engine.clone();
    let mut in_flight = FuturesUnordered::new();
    loop {
        let now = Instant::now();
        let (mut ids, mut to_send) = (Vec::new(), Vec::new());
        let deadline = {
            let mut table = engine.holds.table();
            table.drain_pending();
            // Filed again after the loop, which would otherwise meet them again.
            let mut looked_at = Vec::new();
            while let Some(&(at, id)) = table.schedule.due.first() {
                if at > now + RENEW_EARLY_MAX {
                    break;
                }
                table.schedule.due.pop_first();
                let Some(hold) = table.get_mut(id) else { continue };
                let (Some(renewing), Some(valid_until)) = (hold.renewing.as_mut(), hold.valid_until) else { continue };
                renewing.in_due = false;
                if now >= valid_until {
                    table.lease_ended(id);
                    continue;
                }
                // Due, or within a thirtieth of its lease (one batch), and
                // still valid; else a stale entry, which `file` puts back.
                let early = (renewing.lease / 30).min(RENEW_EARLY_MAX);
                if !renewing.in_flight && renewing.may_renew() && now + early >= renewing.next_renewal {
                    renewing.in_flight = true;
                    ids.push(id);
                    to_send.push(RenewRequest::new(hold.key.clone(), hold.owner.clone(), renewing.lease));
                }
                looked_at.push(id);
            }
            for id in looked_at {
                table.file(id);
            }
            if table.schedule.filed == 0 && in_flight.is_empty() && to_send.is_empty() {
                // Under the lock, so a hold filed from now on starts a task.
                table.schedule.running = false;
                table.schedule.sleeping_until = None;
                serving.done = true;
                return;
            }
            let deadline = table.schedule.due.first().map(|&(at, _)| at);
            table.schedule.sleeping_until = deadline;
            deadline
        };
        if !to_send.is_empty() {
            // The tick's renewals go down as one batch.
            let backend = engine.backend.clone();
            in_flight.push(async move {
                let sent = Instant::now();
                let results = backend.renew_many(&to_send).await;
                (ids, sent, results)
            });
        }
        // Without a deadline only an answer or a newly filed hold can matter.
        let sleep = sleep_until(deadline.unwrap_or_else(|| now + Duration::from_secs(3600)));
        tokio::select! {
            biased;
            Some((ids, sent, results)) = in_flight.next(), if !in_flight.is_empty() => {
                engine.meters.op(Op::Renew, Stopwatch::at(sent));
                let (mut renewed, mut failed, mut lost) = (0, 0, 0);
                for result in &results {
                    match result {
                        Ok(Renewal::Held { .. }) => renewed += 1,
                        Ok(Renewal::Lost) => lost += 1,
                        Err(_) => failed += 1,
                    }
                }
                // Holds a backend left unanswered failed their renewal.
                let (asked, answered) = (ids.len(), results.len());
                engine.meters.renewals(renewed, failed + asked.saturating_sub(answered) as u64, lost);
                let mut results = results.into_iter();
                for id in ids {
                    let result = results.next().unwrap_or_else(|| {
                        Err(crate::Error::Internal(format!("the backend answered {answered} of {asked} renewals")))
                    });
                    settle(&engine, (id, sent, result));
                }
            }
            _ = engine.holds.wake.notified() => {}
            _ = sleep => {}
        }
    }
}

/// Applies a renewal's answer to its hold, if it is still renewed.
fn settle(engine: &Engine, (id, sent, result): (HoldId, Instant, Result<Renewal>)) {
    let mut table = engine.holds.table();
    let Some(hold) = table.get_mut(id) else { return };
    let Some(renewing) = hold.renewing.as_mut() else { return };
    renewing.in_flight = false;
    match result {
        Ok(Renewal::Held { valid_until }) => {
            tracing::trace!(key = %hold.key.log_id(), took_us = sent.elapsed().as_micros() as u64, "dlock.renew");
            renewing.next_renewal = sent + renewing.lease / 3;
            let lease = renewing.lease;
            // A renewed hold always has a lease (`Table::renew` files no other).
            if hold.valid_until.is_some_and(|current| Instant::now() >= current) {
                // Too late: the lease ran out first. The verdict stands.
                table.lease_ended(id);
                return;
            }
            hold.renewed(sent, lease, valid_until);
        }
        Ok(Renewal::Lost) => {
            lose(hold, LostReason::Stolen);
            table.stop_renewing(id);
            return;
        }
        Err(e) => {
            tracing::warn!(key = %hold.key.log_id(), error = %e, "dlock.renew failed; retrying until the lease ends");
            // Sooner than the regular interval, but no more than ten times
            // per lease.
            renewing.next_renewal = Instant::now() + (renewing.lease / 10).max(Duration::from_millis(1));
        }
    }
    table.file(id);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::AcquireRequest;
    use crate::engine::holds::tests::Remote;
    use crate::engine::holds::Enter;
    use crate::key::LockKey;
    use crate::owner::Owner;
    use crate::{LockerOptions, MemoryBackend};

    /// Short holds filed and unfiled while the task sleeps do not pile up:
    /// the task sorts the list whenever it grows long, and only the hold
    /// still filed reaches the schedule.
    #[tokio::test(flavor = "current_thread")]
    async fn pending_holds_are_sorted_before_the_list_grows_long() {
        let engine = Engine::new(Arc::new(MemoryBackend::new()), LockerOptions::default());
        let lease = Duration::from_secs(30);
        let renew = Some(Renew { lease, max_hold: None });
        let hold = |i: u64| {
            let key = LockKey::builder("t", "k").part(i).build().expect("key");
            let req = AcquireRequest::new(key, Owner::random().expect("owner"), lease);
            let Enter::First(turn) = engine.holds.enter(&req, false, None, &Remote, &Default::default()).0 else {
                panic!("first")
            };
            let (joined, kick) = engine.holds.granted(
                turn,
                crate::backend::Grant::until(1, Instant::now() + lease),
                &req,
                renew,
                &Default::default(),
            );
            engine.kick(kick);
            joined.id
        };
        let kept = hold(0);
        tokio::task::yield_now().await;
        let mut longest = 0;
        for i in 0..10 * DRAIN_PENDING_AT as u64 {
            let id = hold(i + 1);
            assert!(matches!(engine.holds.leave(id, true, &Remote), super::super::holds::Leave::Last(_)));
            if i % 64 == 0 {
                tokio::task::yield_now().await;
            }
            longest = longest.max(engine.holds.table().schedule.pending.len());
        }
        tokio::task::yield_now().await;
        let table = engine.holds.table();
        assert!(longest <= DRAIN_PENDING_AT + 64, "pending grew to {longest}");
        assert_eq!(table.schedule.filed, 1);
        let due: Vec<HoldId> = table.schedule.due.iter().map(|&(_, id)| id).collect();
        assert_eq!(due, [kept], "only the kept hold is scheduled");
    }
}
