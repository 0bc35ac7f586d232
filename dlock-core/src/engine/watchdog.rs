//! The watchdog: one task per [`Locker`](crate::Locker) renews every lease
//! held in watchdog mode, like Redisson's shared timer, instead of a task per
//! guard.
//!
//! A guard files its hold in a schedule ordered by the instant something is
//! due (the next renewal, or the end of the lease when no renewal may be
//! sent). Filing a hold is a push on a list the task sorts into the schedule
//! when it wakes, and unfiling it a slot freed, under one short lock: no
//! task spawn, no wake-up, nothing to cancel per request. The task sleeps
//! until the earliest instant in the schedule and is woken only when a hold
//! is filed earlier than that, or when many wait to be sorted.
//!
//! Nothing here can lose a lock silently: a guard reads its own
//! `valid_until`, which only a successful renewal moves forward, so if this
//! task stops (its runtime shut down) the guard's lost signal still fires
//! when the lease it can vouch for ends; the next guard filed starts a new
//! task, which adopts every hold still filed.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use futures_util::stream::{FuturesUnordered, StreamExt};
use tokio::sync::Notify;
use tokio::time::{sleep_until, Instant};

use crate::backend::signal::renewed_lease_expired;
use crate::backend::{Backend, LostReason, LostSignal, Renewal};
use crate::error::Result;
use crate::key::LockKey;
use crate::owner::Owner;

/// Renews the watchdog-mode holds of one engine. Cheap to clone.
#[derive(Clone)]
pub(crate) struct Watchdog {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Watchdog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.shared.lock();
        f.debug_struct("Watchdog").field("holds", &s.holds.len()).field("running", &s.running).finish()
    }
}

struct Shared {
    backend: Arc<dyn Backend>,
    schedule: Mutex<Schedule>,
    wake: Notify,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Schedule> {
        // A panic while holding this lock leaves the schedule consistent
        // (every mutation is a single insert or remove), so poisoning is
        // not a reason to stop renewing.
        self.schedule.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[derive(Default)]
struct Schedule {
    holds: Holds,
    /// `(instant, hold id)`: when each hold next needs attention.
    due: BTreeSet<(Instant, u64)>,
    /// Holds filed by guards since the task last looked. Most are unfiled
    /// (their request ended) long before they need attention; the task
    /// moves the rest into `due` when it wakes, so a short hold costs a push
    /// here instead of an ordered insert and remove.
    pending: Vec<u64>,
    /// Whether a task serves this schedule.
    running: bool,
    /// When the task wakes if nothing earlier is filed.
    sleeping_until: Option<Instant>,
}

impl Schedule {
    /// Files a hold under the instant it next needs attention, moving it
    /// from where it was filed before; returns that instant.
    fn file(&mut self, id: u64) -> Option<Instant> {
        let hold = self.holds.get_mut(id)?;
        if hold.in_due {
            self.due.remove(&(hold.filed_at, id));
        }
        hold.filed_at = hold.attention();
        hold.in_due = true;
        self.due.insert((hold.filed_at, id));
        Some(hold.filed_at)
    }

    /// Files a new hold in `pending`; returns when it first needs attention.
    fn file_new(&mut self, hold: Hold) -> (u64, Instant) {
        let at = hold.filed_at;
        let id = self.holds.insert(hold);
        self.pending.push(id);
        (id, at)
    }

    /// Moves the pending holds still filed into `due`.
    fn drain_pending(&mut self) {
        for id in std::mem::take(&mut self.pending) {
            if let Some(hold) = self.holds.get_mut(id) {
                if !hold.in_due {
                    hold.in_due = true;
                    self.due.insert((hold.filed_at, id));
                }
            }
        }
    }

    fn unfile(&mut self, id: u64) -> Option<Hold> {
        let hold = self.holds.remove(id)?;
        if hold.in_due {
            self.due.remove(&(hold.filed_at, id));
        }
        Some(hold)
    }
}

/// Pending holds that wake the task to sort them, so `pending` stays small
/// however long the task sleeps.
const DRAIN_PENDING_AT: usize = 1024;

/// The filed holds: a slab, since filing and unfiling happen once per
/// request. An id is a slot index plus the slot's generation, so the late
/// answer of a renewal for an unfiled hold never reaches the hold filed in
/// its slot after it.
#[derive(Default)]
struct Holds {
    slots: Vec<(u32, Option<Hold>)>,
    free: Vec<u32>,
    len: usize,
}

impl Holds {
    fn insert(&mut self, hold: Hold) -> u64 {
        self.len += 1;
        let index = match self.free.pop() {
            Some(i) => i,
            None => {
                self.slots.push((0, None));
                (self.slots.len() - 1) as u32
            }
        };
        let slot = &mut self.slots[index as usize];
        slot.0 = slot.0.wrapping_add(1);
        slot.1 = Some(hold);
        (u64::from(slot.0) << 32) | u64::from(index)
    }

    fn get_mut(&mut self, id: u64) -> Option<&mut Hold> {
        let (generation, index) = ((id >> 32) as u32, id as u32);
        match self.slots.get_mut(index as usize) {
            Some((g, hold)) if *g == generation => hold.as_mut(),
            _ => None,
        }
    }

    fn remove(&mut self, id: u64) -> Option<Hold> {
        let (generation, index) = ((id >> 32) as u32, id as u32);
        let hold = match self.slots.get_mut(index as usize) {
            Some((g, hold)) if *g == generation => hold.take()?,
            _ => return None,
        };
        self.free.push(index);
        self.len -= 1;
        Some(hold)
    }

    fn len(&self) -> usize {
        self.len
    }

    fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// What the schedule knows of one guard.
struct Hold {
    key: LockKey,
    owner: Owner,
    lease: Duration,
    /// No renewal is sent at or after this instant (`max_hold`).
    renew_until: Option<Instant>,
    valid_until: Instant,
    next_renewal: Instant,
    renewing: bool,
    filed_at: Instant,
    /// Filed in `due` under `filed_at` (else still in `pending`).
    in_due: bool,
    state: LostSignal,
}

impl Hold {
    fn may_renew(&self) -> bool {
        self.renew_until.is_none_or(|until| self.next_renewal < until)
    }

    /// The next instant this hold needs the task: its renewal, or the end
    /// of the lease when no renewal is coming.
    fn attention(&self) -> Instant {
        if self.renewing || !self.may_renew() {
            self.valid_until
        } else {
            self.next_renewal.min(self.valid_until)
        }
    }

    fn lose(self, reason: LostReason) {
        tracing::warn!(key = %self.key.log_id(), %reason, "dlock.lost");
        self.state.lose(reason);
    }
}

/// A hold filed with the watchdog; unfile it when the guard goes.
#[derive(Debug)]
pub(crate) struct Filed {
    id: u64,
}

/// One hold to file.
pub(crate) struct NewHold {
    pub(crate) key: LockKey,
    pub(crate) owner: Owner,
    pub(crate) lease: Duration,
    pub(crate) renew_until: Option<Instant>,
    pub(crate) valid_until: Instant,
    pub(crate) granted_at: Instant,
    pub(crate) state: LostSignal,
}

impl Watchdog {
    pub(crate) fn new(backend: Arc<dyn Backend>) -> Self {
        Watchdog {
            shared: Arc::new(Shared { backend, schedule: Mutex::new(Schedule::default()), wake: Notify::new() }),
        }
    }

    /// Starts renewing a hold every lease/3.
    pub(crate) fn file(&self, new: NewHold) -> Filed {
        let mut hold = Hold {
            next_renewal: new.granted_at + new.lease / 3,
            key: new.key,
            owner: new.owner,
            lease: new.lease,
            renew_until: new.renew_until,
            valid_until: new.valid_until,
            renewing: false,
            filed_at: new.valid_until,
            in_due: false,
            state: new.state,
        };
        hold.filed_at = hold.attention();
        let (id, start, wake) = {
            let mut s = self.shared.lock();
            let (id, at) = s.file_new(hold);
            let start = !s.running;
            s.running = true;
            // No deadline: the task sleeps until woken.
            let sooner = s.sleeping_until.is_none_or(|until| at < until);
            let wake = !start && (sooner || s.pending.len() >= DRAIN_PENDING_AT);
            (id, start, wake)
        };
        if start {
            self.start();
        } else if wake {
            self.shared.wake.notify_one();
        }
        Filed { id }
    }

    /// Stops renewing a hold. A renewal already sent completes, and its
    /// answer is ignored.
    pub(crate) fn unfile(&self, filed: Filed) {
        self.shared.lock().unfile(filed.id);
    }

    fn start(&self) {
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                // `Serving` is made here, not in the task: a task dropped
                // before its first poll must still mark the schedule unserved.
                runtime.spawn(run(Serving { shared: self.shared.clone(), done: false }));
            }
            Err(_) => {
                self.shared.lock().running = false;
                tracing::warn!("dlock: lock taken outside a tokio runtime; its lease is not renewed");
            }
        }
    }
}

/// Marks the schedule unserved when the task ends for any reason, including
/// its runtime shutting down, so the next hold filed starts a new one.
struct Serving {
    shared: Arc<Shared>,
    /// Set when the task ended on its own and already said so under the
    /// schedule's lock (a new task may be serving by the time this drops).
    done: bool,
}

impl Drop for Serving {
    fn drop(&mut self) {
        if !self.done {
            let mut s = self.shared.lock();
            s.running = false;
            s.sleeping_until = None;
        }
    }
}

type RenewalResult = (u64, Instant, Result<Renewal>);

async fn run(mut serving: Serving) {
    let shared = serving.shared.clone();
    let mut in_flight = FuturesUnordered::new();
    loop {
        let now = Instant::now();
        let mut to_send = Vec::new();
        let deadline = {
            let mut s = shared.lock();
            s.drain_pending();
            while let Some(&(at, id)) = s.due.first() {
                if at > now {
                    break;
                }
                s.due.pop_first();
                let Some(hold) = s.holds.get_mut(id) else { continue };
                if now >= hold.valid_until {
                    let reason = if hold.renewing {
                        LostReason::RenewalFailed
                    } else {
                        renewed_lease_expired(hold.renew_until, hold.valid_until)
                    };
                    if let Some(hold) = s.holds.remove(id) {
                        hold.lose(reason);
                    }
                    continue;
                }
                // Due and still valid: the renewal is due (or a stale entry
                // of a hold filed again, which `file` puts back in place).
                if !hold.renewing && hold.may_renew() && now >= hold.next_renewal {
                    hold.renewing = true;
                    to_send.push((id, hold.key.clone(), hold.owner.clone(), hold.lease));
                }
                s.file(id);
            }
            if s.holds.is_empty() && in_flight.is_empty() && to_send.is_empty() {
                // Under the lock, so a hold filed from now on starts a task.
                s.running = false;
                s.sleeping_until = None;
                serving.done = true;
                return;
            }
            let deadline = s.due.first().map(|&(at, _)| at);
            s.sleeping_until = deadline;
            deadline
        };
        for (id, key, owner, lease) in to_send {
            let backend = shared.backend.clone();
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
            Some(answer) = in_flight.next(), if !in_flight.is_empty() => settle(&shared, answer),
            _ = shared.wake.notified() => {}
            _ = sleep => {}
        }
    }
}

/// Applies a renewal's answer to its hold, if the guard still has it.
fn settle(shared: &Shared, (id, sent, result): RenewalResult) {
    let mut s = shared.lock();
    let Some(hold) = s.holds.get_mut(id) else { return };
    hold.renewing = false;
    match result {
        Ok(Renewal::Held { valid_until }) => {
            tracing::trace!(key = %hold.key.log_id(), took_us = sent.elapsed().as_micros() as u64, "dlock.renew");
            // The backend measures from its own send; never extend past what
            // our clock can vouch for.
            let valid_until = valid_until.min(sent + hold.lease);
            hold.valid_until = valid_until;
            hold.next_renewal = sent + hold.lease / 3;
            hold.state.renewed(valid_until);
        }
        Ok(Renewal::Lost) => {
            if let Some(hold) = s.unfile(id) {
                hold.lose(LostReason::Stolen);
            }
            return;
        }
        Err(e) => {
            tracing::warn!(key = %hold.key.log_id(), error = %e, "dlock.renew failed; retrying until the lease ends");
            // Sooner than the regular interval, but no more than ten times
            // per lease.
            hold.next_renewal = Instant::now() + (hold.lease / 10).max(Duration::from_millis(1));
        }
    }
    s.file(id);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hold() -> Hold {
        let state = LostSignal::new(Instant::now());
        let now = Instant::now();
        Hold {
            key: LockKey::builder("t", "k").build().expect("key"),
            owner: Owner::random().expect("owner"),
            lease: Duration::from_secs(1),
            renew_until: None,
            valid_until: now,
            next_renewal: now,
            renewing: false,
            filed_at: now,
            in_due: false,
            state,
        }
    }

    #[test]
    fn a_stale_id_never_reaches_the_next_hold_in_its_slot() {
        let mut holds = Holds::default();
        let first = holds.insert(hold());
        assert!(holds.remove(first).is_some());
        let second = holds.insert(hold());
        assert_eq!(first as u32, second as u32, "the slot is reused");
        assert!(holds.get_mut(first).is_none());
        assert!(holds.remove(first).is_none());
        assert!(holds.get_mut(second).is_some());
        assert_eq!(holds.len(), 1);
        assert!(holds.remove(second).is_some());
        assert!(holds.is_empty());
    }

    fn new_hold(lease: Duration) -> NewHold {
        let now = Instant::now();
        NewHold {
            key: LockKey::builder("t", "k").build().expect("key"),
            owner: Owner::random().expect("owner"),
            lease,
            renew_until: None,
            valid_until: now + lease,
            granted_at: now,
            state: LostSignal::new(now + lease),
        }
    }

    /// Short holds filed and unfiled while the task sleeps do not pile up:
    /// the task sorts the list whenever it grows long, and only the hold
    /// still filed reaches the schedule.
    #[tokio::test(flavor = "current_thread")]
    async fn pending_holds_are_sorted_before_the_list_grows_long() {
        let dog = Watchdog::new(Arc::new(crate::MemoryBackend::new()));
        let kept = dog.file(new_hold(Duration::from_secs(30)));
        tokio::task::yield_now().await;
        let mut longest = 0;
        for i in 0..10 * DRAIN_PENDING_AT {
            let filed = dog.file(new_hold(Duration::from_secs(30)));
            dog.unfile(filed);
            if i % 64 == 0 {
                tokio::task::yield_now().await;
            }
            longest = longest.max(dog.shared.lock().pending.len());
        }
        tokio::task::yield_now().await;
        let mut s = dog.shared.lock();
        assert!(longest <= DRAIN_PENDING_AT + 64, "pending grew to {longest}");
        assert_eq!(s.holds.len(), 1);
        let due: Vec<u64> = s.due.iter().map(|&(_, id)| id).collect();
        assert_eq!(due, [kept.id], "only the kept hold is scheduled");
        let stale = s.pending.clone();
        assert!(stale.into_iter().all(|id| s.holds.get_mut(id).is_none()), "what waits to be sorted was unfiled");
        drop(s);
        dog.unfile(kept);
    }
}
