//! The watchdog: one task per [`Locker`](crate::Locker) renews every hold
//! kept in watchdog mode, like Redisson's shared timer, instead of a task per
//! guard.
//!
//! The schedule indexes the engine's holds (`holds.rs`) by the instant each
//! needs attention: its next renewal, or the end of its lease when no
//! renewal may be sent. A hold starts being renewed when its first
//! watchdog-mode guard joins it and stops when the last one goes. Starting
//! is a push on a list the task sorts into the schedule when it wakes, and
//! stopping a field cleared, under the table's one lock: no task spawn, no
//! wake-up, nothing to cancel per request. The task sleeps until the
//! earliest instant in the schedule and is woken only when a hold is filed
//! earlier than that, or when many wait to be sorted.
//!
//! Nothing here can lose a lock silently: a guard reads its hold's
//! `valid_until`, which only a successful renewal moves forward, so if this
//! task stops (its runtime shut down) the guard's lost signal still fires
//! when the lease it can vouch for ends; the next hold filed starts a new
//! task, which adopts every hold still filed.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use futures_util::stream::{FuturesUnordered, StreamExt};
use tokio::time::{sleep_until, Instant};

use super::holds::{Hold, HoldId, Kick, Renew, Table};
use super::Engine;
use crate::backend::signal::{renewed_lease_expired, Expiry};
use crate::backend::{LostReason, Renewal};
use crate::error::Result;

/// The renewals' side of the table.
#[derive(Default)]
pub(crate) struct Schedule {
    /// `(instant, hold)`: when each renewed hold next needs attention.
    due: BTreeSet<(Instant, HoldId)>,
    /// Holds filed since the task last looked. Most stop being renewed
    /// (their request ended) long before they need attention; the task
    /// moves the rest into `due` when it wakes, so a short hold costs a push
    /// here instead of an ordered insert and remove.
    pending: Vec<HoldId>,
    /// Holds renewed now.
    filed: usize,
    /// Whether a task serves this schedule.
    running: bool,
    /// When the task wakes if nothing earlier is filed.
    sleeping_until: Option<Instant>,
}

impl Schedule {
    /// Stops renewing `hold`, filed as `id` (the caller has it in hand,
    /// see [`Table::stop_renewing`]). A renewal already sent completes, and
    /// its answer is ignored.
    #[inline]
    pub(super) fn stop_renewing(&mut self, id: HoldId, hold: &mut Hold) {
        // Inlined for this check: most holds are never renewed, and every
        // release asks.
        if hold.renewing.is_some() {
            self.stop(id, hold);
        }
    }

    fn stop(&mut self, id: HoldId, hold: &mut Hold) {
        let Some(renewing) = hold.renewing.take() else { return };
        if let Some(valid_until) = hold.valid_until {
            // Its guards that remain have fixed leases: what passes now is one.
            if !hold.watch.is_lost() {
                hold.watch.set_terms(valid_until, Expiry::Lease);
            }
        }
        self.filed -= 1;
        if renewing.in_due {
            self.due.remove(&(renewing.filed_at, id));
        }
    }
}

/// How one hold is renewed.
pub(crate) struct Renewing {
    lease: Duration,
    /// The watchdog-mode guards of the hold.
    pub(super) guards: u32,
    /// No renewal is sent at or after this instant: the latest `max_hold`
    /// of its guards allows (`None`: no limit).
    renew_until: Option<Instant>,
    next_renewal: Instant,
    in_flight: bool,
    filed_at: Instant,
    /// Filed in `due` under `filed_at` (else still in `pending`).
    in_due: bool,
}

impl Renewing {
    fn may_renew(&self) -> bool {
        self.renew_until.is_none_or(|until| self.next_renewal < until)
    }

    /// The next instant this hold needs the task: its renewal, or the end
    /// of the lease when no renewal is coming.
    fn attention(&self, valid_until: Instant) -> Instant {
        if self.in_flight || !self.may_renew() {
            valid_until
        } else {
            self.next_renewal.min(valid_until)
        }
    }
}

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

type RenewalResult = (HoldId, Instant, Result<Renewal>);

async fn run(mut serving: Serving) {
    let engine = serving.engine.clone();
    let mut in_flight = FuturesUnordered::new();
    loop {
        let now = Instant::now();
        let mut to_send = Vec::new();
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
                // Due, or nearly (a renewal goes out with those due now when
                // it is due within a thirtieth of its lease: they share a
                // script call), and still valid. Else a stale entry of a hold
                // filed again, which `file` puts back in place.
                let early = (renewing.lease / 30).min(RENEW_EARLY_MAX);
                if !renewing.in_flight && renewing.may_renew() && now + early >= renewing.next_renewal {
                    renewing.in_flight = true;
                    to_send.push((id, hold.key.clone(), hold.owner.clone(), renewing.lease));
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
        for (id, key, owner, lease) in to_send {
            let backend = engine.backend.clone();
            in_flight.push(async move {
                let sent = Instant::now();
                let result = backend.renew(&key, &owner, lease).await;
                (id, sent, result)
            });
        }
        // Without a deadline only an answer or a newly filed hold can matter.
        let sleep = sleep_until(deadline.unwrap_or_else(|| now + Duration::from_secs(3600)));
        tokio::select! {
            biased;
            Some(answer) = in_flight.next(), if !in_flight.is_empty() => settle(&engine, answer),
            _ = engine.holds.wake.notified() => {}
            _ = sleep => {}
        }
    }
}

/// Applies a renewal's answer to its hold, if it is still renewed.
fn settle(engine: &Engine, (id, sent, result): RenewalResult) {
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
                // Too late: the lease ran out before the answer came, and
                // another holder may have been granted meanwhile. The first
                // verdict stands.
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
            let Enter::First(turn) = engine.holds.enter(&req, false, None, &Remote).0 else { panic!("first") };
            let (joined, kick) =
                engine.holds.granted(turn, crate::backend::Grant::until(1, Instant::now() + lease), &req, renew);
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
