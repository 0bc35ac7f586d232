//! The holds of one engine: every lock this process holds, once per key and
//! owner, however many guards share it.
//!
//! A hold is where re-entry is counted, where the fencing token and the lost
//! signal its guards share live, where the watchdog finds what to renew
//! (`watchdog.rs` schedules these entries), and where the first acquire and
//! the last release of a key and owner take their turn. Only that first
//! acquire and that last release reach the backend: a backend never counts.
//!
//! A hold goes through three phases:
//!
//! * **acquiring**: the first acquire is on its way to the backend. Other
//!   acquires of the same key and owner wait for its answer (one that does
//!   not wait is told the key is busy): sent beside it, a second acquire
//!   would reach the service as a second holder of one lock.
//! * **held**: an acquire joins it without I/O while it has at least half of
//!   the requested lease left, or once the backend renewed it; a hold found
//!   lost is *detached* instead (below).
//! * **releasing**: the last release is on its way, or is retried after the
//!   service could not be reached. Acquires of the key and owner wait for it
//!   to end: sent before it lands, they could join the hold on the service
//!   just before the release deletes it.
//!
//! A detached hold is no longer the hold of its key and owner: the next
//! acquire starts a new one, and when the old one's guards go they send
//! nothing, since what the service holds for that owner now is the new hold.
//!
//! Re-entry is counted per process. An owner shared across processes shares
//! the lock on the service, but each process counts its own holds, and the
//! first last-release in any of them frees the lock for all.

use std::collections::BTreeSet;
use std::hash::{BuildHasher, Hash, Hasher};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use hashbrown::hash_table::{Entry, HashTable};
use tokio::sync::futures::Notified;
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::backend::signal::{Expiry, Terms};
use crate::backend::{AcquireRequest, Backend, Grant, GrantLease, LockMode, LostReason, LostSignal, Release};
use crate::error::{Error, Result};
use crate::key::LockKey;
use crate::metrics::{HoldMeter, LockMeter};
use crate::owner::Owner;

/// Names one hold: a slot plus its generation, so a stale id never reaches
/// a later hold of the same slot.
pub(super) type HoldId = u64;

/// The holds of one engine, with the schedule of their renewals.
#[derive(Default)]
pub(crate) struct Holds {
    table: Mutex<Table>,
    /// Wakes the acquires waiting for a first acquire or last release to
    /// end: one for the table, since such waits are rare.
    settled: Notify,
    /// Wakes the watchdog's task.
    pub(super) wake: Notify,
}

#[derive(Default)]
pub(super) struct Table {
    slots: Slots,
    /// The current hold of each key and owner, filed under their hash: no
    /// copy of either is kept here.
    current: HashTable<HoldId>,
    /// Hashes `current`'s pairs, seeded per process so that keys from
    /// requests cannot be chosen to collide.
    hasher: foldhash::fast::RandomState,
    pub(super) schedule: Schedule,
}

impl Hold {
    /// A hold whose first acquire is on its way.
    fn acquiring(req: &AcquireRequest, hash: u64) -> Self {
        Hold {
            key: req.key.clone(),
            owner: req.owner.clone(),
            mode: req.mode,
            hash,
            phase: Phase::Acquiring,
            guards: 0,
            token: 0,
            watch: Watch::Pending,
            valid_until: None,
            detached: false,
            awaited: false,
            renewing: None,
            meter: HoldMeter::none(),
        }
    }

    /// Makes this hold the backend's `grant`; returns when it was granted,
    /// for its renewals (`None`: nothing renews it).
    fn take(&mut self, grant: Grant, req: &AcquireRequest, renew: Option<Renew>, meter: &LockMeter) -> Option<Instant> {
        self.meter = meter.held();
        let valid_until = grant.valid_until();
        let (watch, granted_at) = match (grant.lost, grant.lease) {
            (lost, GrantLease::Until(at)) => {
                // Measured from before the request: no clock read needed.
                let granted_at = renew.map(|_| at.checked_sub(req.lease).unwrap_or_else(Instant::now));
                let expiry = match (renew, granted_at) {
                    (Some(Renew { max_hold, .. }), Some(granted_at)) => {
                        Expiry::Renewed { renew_until: max_hold.map(|m| granted_at + m) }
                    }
                    _ => Expiry::Lease,
                };
                let watch = match lost {
                    Some(signal) => {
                        signal.set_terms(at, expiry);
                        Watch::Signal(signal)
                    }
                    None => Watch::Terms(Terms::new(at, expiry)),
                };
                (watch, granted_at)
            }
            // Nothing renews a hold with no lease: no clock is read for it.
            (lost, GrantLease::UntilReleased) => (Watch::Signal(lost.unwrap_or_else(LostSignal::until_released)), None),
        };
        self.phase = Phase::Held;
        self.token = grant.fencing_token;
        self.valid_until = valid_until;
        self.watch = watch;
        granted_at
    }

    /// The backend renewed this hold until `valid_until`, for `lease` sent
    /// at `sent`. Its end moves forward only, and never past `sent + lease`:
    /// only what our clock can vouch for.
    pub(super) fn renewed(&mut self, sent: Instant, lease: Duration, valid_until: Instant) {
        let valid_until = valid_until.min(sent + lease);
        if let Some(at) = self.valid_until.as_mut()
            && valid_until > *at
        {
            *at = valid_until;
            self.watch.renewed(valid_until);
        }
    }
}

/// One hold: one lock on the service, however many guards share it.
pub(super) struct Hold {
    pub(super) key: LockKey,
    pub(super) owner: Owner,
    /// How the backend holds it; a re-entry must fit it
    /// ([`LockMode::reentry`]).
    mode: LockMode,
    /// The hash of `key` and `owner`, which `current` files it under.
    hash: u64,
    phase: Phase,
    /// The guards that hold it.
    guards: u32,
    token: u64,
    /// Whether it may be lost, shared by every guard of the hold.
    pub(super) watch: Watch,
    /// The end of the lease; `None`: [`GrantLease::UntilReleased`].
    pub(super) valid_until: Option<Instant>,
    detached: bool,
    /// An acquire waits for this hold's phase to change.
    awaited: bool,
    /// Renewed by the watchdog while a watchdog-mode guard holds it.
    pub(super) renewing: Option<Renewing>,
    /// Its time held and its end, for the metrics.
    meter: HoldMeter,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Acquiring,
    Held,
    /// `retrying`: a background retry keeps the turn.
    Releasing {
        retrying: bool,
    },
}

/// How the watchdog is to keep a guard's hold: renewed every `lease`/3, for
/// at most `max_hold` after the grant.
#[derive(Debug, Clone, Copy)]
pub(super) struct Renew {
    pub(super) lease: Duration,
    pub(super) max_hold: Option<Duration>,
}

/// The renewals' side of the table.
#[derive(Default)]
pub(crate) struct Schedule {
    /// `(instant, hold)`: when each renewed hold next needs attention.
    pub(super) due: BTreeSet<(Instant, HoldId)>,
    /// Holds filed since the task last looked, moved into `due` when it
    /// wakes: a short hold costs a push, not an ordered insert and remove.
    pub(super) pending: Vec<HoldId>,
    /// Holds renewed now.
    pub(super) filed: usize,
    /// Whether a task serves this schedule.
    pub(super) running: bool,
    /// When the task wakes if nothing earlier is filed.
    pub(super) sleeping_until: Option<Instant>,
}

impl Schedule {
    /// Stops renewing `hold`, filed as `id`; a renewal already sent
    /// completes, and its answer is ignored.
    #[inline]
    pub(super) fn stop_renewing(&mut self, id: HoldId, hold: &mut Hold) {
        // Inlined: most holds are never renewed, and every release asks.
        if hold.renewing.is_some() {
            self.stop(id, hold);
        }
    }

    pub(super) fn stop(&mut self, id: HoldId, hold: &mut Hold) {
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
    pub(super) lease: Duration,
    /// The watchdog-mode guards of the hold.
    pub(super) guards: u32,
    /// No renewal is sent from this instant on (the latest `max_hold`).
    pub(super) renew_until: Option<Instant>,
    pub(super) next_renewal: Instant,
    pub(super) in_flight: bool,
    pub(super) filed_at: Instant,
    /// Filed in `due` under `filed_at` (else still in `pending`).
    pub(super) in_due: bool,
}

impl Renewing {
    pub(super) fn may_renew(&self) -> bool {
        self.renew_until.is_none_or(|until| self.next_renewal < until)
    }

    /// The next instant this hold needs the task (renewal or lease end).
    pub(super) fn attention(&self, valid_until: Instant) -> Instant {
        if self.in_flight || !self.may_renew() {
            valid_until
        } else {
            self.next_renewal.min(valid_until)
        }
    }
}

/// What the watchdog's task needs after a change of the schedule.
#[must_use]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kick {
    Nothing,
    /// No task serves the schedule: start one.
    Start,
    /// The task sleeps past something filed now: wake it.
    Wake,
}

/// Whether a hold may be lost, as its guards see it: its terms, until a
/// guard or the backend asks for a signal, which starts from them (most
/// short holds are released unasked; `docs/performance.md`).
pub(super) enum Watch {
    /// The first acquire is on its way: no terms yet.
    Pending,
    Terms(Terms),
    Signal(LostSignal),
}

impl Watch {
    /// Why it is lost, if it is.
    fn reason(&self) -> Option<LostReason> {
        match self {
            Watch::Pending => None,
            Watch::Terms(terms) => terms.reason(),
            Watch::Signal(signal) => signal.reason(),
        }
    }

    pub(super) fn is_lost(&self) -> bool {
        match self {
            Watch::Pending => false,
            Watch::Terms(terms) => terms.is_lost(),
            Watch::Signal(signal) => signal.is_lost(),
        }
    }

    /// Gives the verdict; whether it was the first.
    pub(super) fn lose(&mut self, reason: LostReason) -> bool {
        match self {
            Watch::Pending => false,
            Watch::Terms(terms) => terms.lose(reason),
            Watch::Signal(signal) => signal.lose(reason),
        }
    }

    fn renewed(&mut self, valid_until: Instant) {
        match self {
            Watch::Pending => {}
            Watch::Terms(terms) => drop(terms.renewed(valid_until)),
            Watch::Signal(signal) => signal.renewed(valid_until),
        }
    }

    pub(super) fn set_terms(&mut self, valid_until: Instant, expiry: Expiry) {
        match self {
            Watch::Pending => {}
            Watch::Terms(terms) => terms.set_terms(valid_until, expiry),
            Watch::Signal(signal) => signal.set_terms(valid_until, expiry),
        }
    }

    /// The hold's signal, made now if nobody asked for it before.
    fn signal(&mut self) -> Option<LostSignal> {
        match self {
            Watch::Pending => None,
            Watch::Terms(terms) => {
                let signal = LostSignal::from_terms(*terms);
                *self = Watch::Signal(signal.clone());
                Some(signal)
            }
            Watch::Signal(signal) => Some(signal.clone()),
        }
    }
}

/// A guard's share of a hold.
pub(crate) struct Joined {
    pub(super) id: HoldId,
    pub(super) token: u64,
    /// The hold's signal if it was made already; else the guard asks
    /// [`Holds::signal`] when it needs it.
    pub(super) state: Option<LostSignal>,
}

/// What an acquire may do, looked up in the table.
pub(super) enum Enter<'a> {
    /// Joined a hold of this process.
    Joined(Joined),
    /// The first acquire of this key and owner: ask the backend, with the turn.
    First(AcquireTurn),
    /// Less than half the requested lease left: renew, then join.
    Extend(HoldId),
    /// A first acquire or last release is on its way: wait, then look again.
    Wait(Notified<'a>),
    /// The same, for a caller that does not wait.
    Busy,
    /// Refused on the spot (held, or an error), for a caller that does not wait.
    Refused(Error),
}

/// What a guard's release leaves to do.
pub(super) enum Leave {
    /// Other guards of this process still hold it; whether it is lost.
    Others { lost: bool },
    /// The last guard: release on the service, with the turn.
    Last(ReleaseTurn),
    /// The hold was lost and replaced: nothing to send.
    Detached,
    /// The last guard, released on the spot by the backend.
    Released(Result<Release>),
}

/// The turn of a first acquire while it is on its way; dropped unanswered,
/// it forgets the hold and wakes the acquires that wait.
pub(super) struct AcquireTurn {
    holds: Arc<Holds>,
    id: Option<HoldId>,
}

/// The turn of a last release on its way (or retried), or of the undo of a
/// first acquire that got no grant: dropped, it forgets the hold and wakes
/// the acquires that wait. It stays with the release until it is answered
/// or given up, so no acquire overtakes it.
pub(super) struct ReleaseTurn {
    holds: Arc<Holds>,
    id: HoldId,
    /// The end of the lease, which bounds retries (`None`: not retried).
    pub(super) valid_until: Option<Instant>,
}

impl Holds {
    pub(super) fn table(&self) -> MutexGuard<'_, Table> {
        // Every change is a field or an entry: poisoning leaves it consistent.
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Looks an acquire up: joins a live hold, takes the first turn (tried
    /// on the spot under the lock when the backend can:
    /// [`Backend::try_acquire_now`]), or says what to wait for.
    pub(super) fn enter(
        self: &Arc<Self>,
        req: &AcquireRequest,
        waits: bool,
        renew: Option<Renew>,
        backend: &dyn Backend,
        meter: &LockMeter,
    ) -> (Enter<'_>, Kick) {
        let mut guard = self.table();
        let table = &mut *guard;
        let hash = table.hash(&req.key, &req.owner);
        let slots = &table.slots;
        let found = table.current.entry(
            hash,
            |&id| slots.get(id).is_some_and(|h| h.key == req.key && h.owner == req.owner),
            |&id| slots.get(id).map_or(0, |h| h.hash),
        );
        let (id, kick) = match found {
            Entry::Vacant(vacant) => {
                let grant = match backend.try_acquire_now(req) {
                    Some(Ok(grant)) => Some(grant),
                    // Held, and the caller waits: the backend's `acquire` waits.
                    Some(Err(e)) if !(waits && e.is_contention()) => return (Enter::Refused(e), Kick::Nothing),
                    Some(Err(_)) | None => None,
                };
                // Filed first, then granted in place: a hold is large.
                let (new, hold) = table.slots.insert_with(|| Hold::acquiring(req, hash));
                vacant.insert(new);
                let Some(grant) = grant else {
                    return (Enter::First(AcquireTurn { holds: self.clone(), id: Some(new) }), Kick::Nothing);
                };
                let granted_at = hold.take(grant, req, renew, meter);
                (new, table.join(new, renew, granted_at))
            }
            Entry::Occupied(entry) => {
                let current = *entry.get();
                let Some(hold) = table.slots.get_mut(current) else {
                    // Not reachable: an id in `current` always has its slot.
                    entry.remove();
                    return (Enter::Wait(self.settled.notified()), Kick::Nothing);
                };
                match hold.phase {
                    Phase::Acquiring | Phase::Releasing { retrying: true } if !waits => {
                        return (Enter::Busy, Kick::Nothing)
                    }
                    Phase::Acquiring | Phase::Releasing { .. } => {
                        hold.awaited = true;
                        return (Enter::Wait(self.settled.notified()), Kick::Nothing);
                    }
                    Phase::Held => {}
                }
                if hold.mode != req.mode
                    && let Err(e) = hold.mode.reentry(req.mode, &req.key)
                {
                    return (Enter::Refused(e), Kick::Nothing);
                }
                if hold.watch.is_lost() {
                    // Lost: the next hold is a new one; its guards send nothing.
                    hold.detached = true;
                    entry.remove();
                    drop(guard);
                    return self.enter(req, waits, renew, backend, meter);
                }
                if hold.valid_until.is_some_and(|at| at < Instant::now() + req.lease / 2) {
                    return (Enter::Extend(current), Kick::Nothing);
                }
                (current, table.join(current, renew, renew.map(|_| Instant::now())))
            }
        };
        match table.joined(id) {
            Some(joined) => (Enter::Joined(joined), kick),
            None => (Enter::Wait(self.settled.notified()), kick),
        }
    }

    /// The backend granted the first acquire of `turn`.
    pub(super) fn granted(
        &self,
        mut turn: AcquireTurn,
        grant: Grant,
        req: &AcquireRequest,
        renew: Option<Renew>,
        meter: &LockMeter,
    ) -> (Joined, Kick) {
        let id = turn.id.take();
        let mut guard = self.table();
        let table = &mut *guard;
        let found = id.and_then(|id| Some((id, table.slots.get_mut(id)?)));
        let Some((id, hold)) = found else {
            // Not reachable: the turn keeps its hold in the table.
            drop(guard);
            let state = grant.lost.unwrap_or_else(LostSignal::until_released);
            return (Joined { id: HoldId::MAX, token: grant.fencing_token, state: Some(state) }, Kick::Nothing);
        };
        let granted_at = hold.take(grant, req, renew, meter);
        let awaited = std::mem::take(&mut hold.awaited);
        let kick = table.join(id, renew, granted_at);
        let joined = table.joined(id);
        drop(guard);
        if awaited {
            self.settled.notify_waiters();
        }
        match joined {
            Some(joined) => (joined, kick),
            None => (Joined { id, token: 0, state: Some(LostSignal::until_released()) }, kick),
        }
    }

    /// The backend renewed hold `id` for an acquire that joins it; `None`
    /// when it is no longer the hold to join.
    pub(super) fn extended(
        &self,
        id: HoldId,
        sent: Instant,
        lease: Duration,
        valid_until: Instant,
        renew: Option<Renew>,
    ) -> (Option<Joined>, Kick) {
        let mut table = self.table();
        let Some(hold) = table.slots.get_mut(id).filter(|h| h.phase == Phase::Held && !h.detached) else {
            return (None, Kick::Nothing);
        };
        hold.renewed(sent, lease, valid_until);
        let kick = table.join(id, renew, renew.map(|_| Instant::now()));
        (table.joined(id), kick)
    }

    /// Hold `id` is gone: its guards lose it; the next acquire starts anew.
    pub(super) fn lost(&self, id: HoldId, reason: LostReason) {
        let mut table = self.table();
        let table = &mut *table;
        let Some(hold) = table.slots.get_mut(id) else { return };
        if hold.watch.lose(reason) {
            tracing::warn!(key = %hold.key.log_id(), %reason, "dlock.lost");
        }
        hold.detached = true;
        if let Ok(current) = table.current.find_entry(hold.hash, |&c| c == id) {
            current.remove();
        }
        table.stop_renewing(id);
    }

    /// One guard of hold `id` goes; `renewed`: it was in watchdog mode. The
    /// last one is released on the spot when the backend can
    /// ([`Backend::release_now`]).
    pub(super) fn leave(self: &Arc<Self>, id: HoldId, renewed: bool, backend: &dyn Backend) -> Leave {
        let mut guard = self.table();
        let table = &mut *guard;
        let Some(hold) = table.slots.get_mut(id) else { return Leave::Detached };
        hold.guards = hold.guards.saturating_sub(1);
        // The last guard, or the last watchdog-mode one: nothing renews it now.
        let mut stop_renewing = hold.guards == 0;
        if let (true, Some(renewing)) = (renewed, hold.renewing.as_mut()) {
            renewing.guards = renewing.guards.saturating_sub(1);
            stop_renewing |= renewing.guards == 0;
        }
        if stop_renewing {
            table.schedule.stop_renewing(id, hold);
        }
        if hold.guards > 0 {
            return Leave::Others { lost: hold.watch.is_lost() };
        }
        if hold.detached {
            table.slots.remove(id);
            return Leave::Detached;
        }
        if let Some(released) = backend.release_now(&hold.key, &hold.owner) {
            let awaited = hold.awaited;
            table.forget(id);
            drop(guard);
            if awaited {
                self.settled.notify_waiters();
            }
            return Leave::Released(released);
        }
        hold.phase = Phase::Releasing { retrying: false };
        Leave::Last(ReleaseTurn { holds: self.clone(), id, valid_until: hold.valid_until })
    }

    /// Forgets hold `id` if it is still in `phase`, and wakes its waiters.
    fn end_turn(&self, id: HoldId, phase: fn(Phase) -> bool) {
        let mut guard = self.table();
        let table = &mut *guard;
        let Some(hold) = table.slots.get(id).filter(|h| phase(h.phase)) else { return };
        let awaited = hold.awaited;
        table.forget(id);
        drop(guard);
        if awaited {
            self.settled.notify_waiters();
        }
    }

    /// The signal of hold `id`, made now if nobody asked for it before.
    pub(super) fn signal(&self, id: HoldId) -> LostSignal {
        let signal = self.table().slots.get_mut(id).and_then(|hold| hold.watch.signal());
        signal.unwrap_or_else(|| {
            // Not reachable: a guard's hold stays while the guard lives.
            let lost = LostSignal::new(Instant::now());
            lost.lose(LostReason::Stolen);
            lost
        })
    }

    /// How many holds the table keeps (test hook: none may outlive its guards).
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.table().slots.len
    }
}

impl Table {
    /// The hash `current` files the hold of `key` and `owner` under.
    fn hash(&self, key: &LockKey, owner: &Owner) -> u64 {
        // No end marker needed: an owner always has the same length.
        let mut hasher = self.hasher.build_hasher();
        hasher.write(key.as_str().as_bytes());
        owner.hash(&mut hasher);
        hasher.finish()
    }

    /// Removes hold `id` from the table, and from `current` if it is there.
    fn forget(&mut self, id: HoldId) {
        let Some(hold) = self.slots.get_mut(id) else { return };
        self.schedule.stop_renewing(id, hold);
        // A hold not detached is its key and owner's current one.
        if !hold.detached
            && let Ok(current) = self.current.find_entry(hold.hash, |&c| c == id)
        {
            current.remove();
        }
        self.slots.remove(id);
    }

    /// One more guard joins hold `id`, renewed when `renew` says so and the
    /// hold has a lease granted or renewed at `granted_at`.
    fn join(&mut self, id: HoldId, renew: Option<Renew>, granted_at: Option<Instant>) -> Kick {
        let Some(hold) = self.slots.get_mut(id) else { return Kick::Nothing };
        hold.guards += 1;
        match (renew, hold.valid_until, granted_at) {
            (Some(renew), Some(_), Some(granted_at)) => self.renew(id, renew, granted_at),
            _ => Kick::Nothing,
        }
    }

    fn joined(&self, id: HoldId) -> Option<Joined> {
        let hold = self.slots.get(id)?;
        let state = match &hold.watch {
            Watch::Pending => return None,
            Watch::Terms(_) => None,
            Watch::Signal(signal) => Some(signal.clone()),
        };
        Some(Joined { id, token: hold.token, state })
    }

    pub(super) fn get_mut(&mut self, id: HoldId) -> Option<&mut Hold> {
        self.slots.get_mut(id)
    }

    /// Stops renewing hold `id` (an answer already on its way is ignored).
    pub(super) fn stop_renewing(&mut self, id: HoldId) {
        if let Some(hold) = self.slots.get_mut(id) {
            self.schedule.stop_renewing(id, hold);
        }
    }
}

impl AcquireTurn {
    /// The first acquire returned no grant but may have left something (an
    /// unknown outcome, a writer's intent): the turn becomes that of the
    /// undo that goes after it, which ends at `valid_until`.
    pub(super) fn undo(mut self, valid_until: Instant) -> Option<ReleaseTurn> {
        let id = self.id.take()?;
        let hold = self.holds.table().slots.get_mut(id).map(|hold| hold.phase = Phase::Releasing { retrying: true });
        hold.map(|()| ReleaseTurn { holds: self.holds.clone(), id, valid_until: Some(valid_until) })
    }
}

impl Drop for AcquireTurn {
    fn drop(&mut self) {
        if let Some(id) = self.id.take() {
            self.holds.end_turn(id, |phase| phase == Phase::Acquiring);
        }
    }
}

impl ReleaseTurn {
    /// The release is retried in the background (acquires that do not wait
    /// are told it is busy meanwhile).
    pub(super) fn retrying(&self) {
        if let Some(hold) = self.holds.table().slots.get_mut(self.id) {
            hold.phase = Phase::Releasing { retrying: true };
        }
    }
}

impl Drop for ReleaseTurn {
    fn drop(&mut self) {
        self.holds.end_turn(self.id, |phase| matches!(phase, Phase::Releasing { .. }));
    }
}

/// The table's storage: a slab (a hold is filed once per first acquire).
#[derive(Default)]
struct Slots {
    slots: Vec<(u32, Option<Hold>)>,
    free: Vec<u32>,
    len: usize,
}

impl Slots {
    /// Files the hold `make` makes, in its slot (a hold is large).
    #[inline]
    fn insert_with(&mut self, make: impl FnOnce() -> Hold) -> (HoldId, &mut Hold) {
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
        let id = (u64::from(slot.0) << 32) | u64::from(index);
        (id, slot.1.insert(make()))
    }

    fn get(&self, id: HoldId) -> Option<&Hold> {
        let (generation, index) = ((id >> 32) as u32, id as u32);
        match self.slots.get(index as usize) {
            Some((g, hold)) if *g == generation => hold.as_ref(),
            _ => None,
        }
    }

    fn get_mut(&mut self, id: HoldId) -> Option<&mut Hold> {
        let (generation, index) = ((id >> 32) as u32, id as u32);
        match self.slots.get_mut(index as usize) {
            Some((g, hold)) if *g == generation => hold.as_mut(),
            _ => None,
        }
    }

    /// Drops hold `id` in place: moving it out cost a copy per release.
    fn remove(&mut self, id: HoldId) {
        let (generation, index) = ((id >> 32) as u32, id as u32);
        match self.slots.get_mut(index as usize) {
            Some((g, slot @ Some(_))) if *g == generation => {
                if let Some(hold) = slot {
                    hold.meter.end(|| hold.watch.reason());
                }
                *slot = None;
            }
            _ => return,
        }
        self.free.push(index);
        self.len -= 1;
    }
}

#[cfg(test)]
// Without the feature `metrics` the meter is a unit struct; with it, not.
#[allow(clippy::default_constructed_unit_structs)]
pub(super) mod tests {
    use super::*;
    use crate::backend::{BoxFuture, CancellationToken, Renewal};

    /// A backend that answers nothing on the spot, as a remote one.
    #[derive(Debug)]
    pub(in crate::engine) struct Remote;

    impl Backend for Remote {
        fn name(&self) -> &'static str {
            "remote"
        }
        fn acquire<'a>(&'a self, _: &'a AcquireRequest, _: &'a CancellationToken) -> BoxFuture<'a, Result<Grant>> {
            Box::pin(async { Err(Error::backend("remote", "not in these tests")) })
        }
        fn renew<'a>(&'a self, _: &'a LockKey, _: &'a Owner, _: Duration) -> BoxFuture<'a, Result<Renewal>> {
            Box::pin(async { Err(Error::backend("remote", "not in these tests")) })
        }
        fn release<'a>(&'a self, _: &'a LockKey, _: &'a Owner) -> BoxFuture<'a, Result<Release>> {
            Box::pin(async { Err(Error::backend("remote", "not in these tests")) })
        }
        fn ready(&self) -> BoxFuture<'_, Result<()>> {
            Box::pin(async { Err(Error::backend("remote", "not in these tests")) })
        }
    }

    fn request(lease: Duration) -> AcquireRequest {
        let key = LockKey::builder("dlock", "holds").part(1).build().expect("key");
        AcquireRequest::new(key, Owner::random().expect("owner"), lease)
    }

    fn first(holds: &Arc<Holds>, req: &AcquireRequest) -> AcquireTurn {
        match holds.enter(req, false, None, &Remote, &LockMeter::default()).0 {
            Enter::First(turn) => turn,
            _ => panic!("the first acquire goes to the backend"),
        }
    }

    #[tokio::test]
    async fn only_the_first_acquire_and_the_last_release_reach_the_backend() {
        let holds = Arc::new(Holds::default());
        let lease = Duration::from_secs(30);
        let req = request(lease);
        let turn = first(&holds, &req);
        assert!(
            matches!(holds.enter(&req, false, None, &Remote, &LockMeter::default()).0, Enter::Busy),
            "a first acquire is on its way"
        );
        let (outer, _) =
            holds.granted(turn, Grant::until(7, Instant::now() + lease), &req, None, &LockMeter::default());
        let Enter::Joined(inner) = holds.enter(&req, false, None, &Remote, &LockMeter::default()).0 else {
            panic!("a re-entry joins")
        };
        assert_eq!((outer.token, inner.token), (7, 7));
        assert!(matches!(holds.leave(inner.id, false, &Remote), Leave::Others { lost: false }));
        let Leave::Last(turn) = holds.leave(outer.id, false, &Remote) else { panic!("the last release") };
        let Enter::Wait(landed) = holds.enter(&req, true, None, &Remote, &LockMeter::default()).0 else {
            panic!("waits for the release")
        };
        drop(turn);
        tokio::time::timeout(Duration::from_secs(5), landed).await.expect("the landed release wakes the waiter");
        assert!(matches!(holds.enter(&req, false, None, &Remote, &LockMeter::default()).0, Enter::First(_)));
        assert_eq!(holds.len(), 0, "nothing outlives its guards and turns");
    }

    #[tokio::test]
    async fn a_retried_release_keeps_acquires_of_its_owner_out_until_it_ends() {
        let holds = Arc::new(Holds::default());
        let lease = Duration::from_secs(30);
        let req = request(lease);
        let (held, _) = holds.granted(
            first(&holds, &req),
            Grant::until(7, Instant::now() + lease),
            &req,
            None,
            &LockMeter::default(),
        );
        let Leave::Last(turn) = holds.leave(held.id, false, &Remote) else { panic!("the last release") };
        turn.retrying();
        assert!(
            matches!(holds.enter(&req, false, None, &Remote, &LockMeter::default()).0, Enter::Busy),
            "a retried release is in the way"
        );
        let Enter::Wait(landed) = holds.enter(&req, true, None, &Remote, &LockMeter::default()).0 else {
            panic!("a waiting acquire waits")
        };
        drop(turn);
        tokio::time::timeout(Duration::from_secs(5), landed).await.expect("the retry's end wakes it");
        assert!(matches!(holds.enter(&req, false, None, &Remote, &LockMeter::default()).0, Enter::First(_)));
    }

    #[tokio::test]
    async fn a_lost_hold_is_replaced_and_its_guards_send_nothing() {
        let holds = Arc::new(Holds::default());
        let lease = Duration::from_secs(30);
        let req = request(lease);
        let (old, _) = holds.granted(
            first(&holds, &req),
            Grant::until(7, Instant::now() + lease),
            &req,
            None,
            &LockMeter::default(),
        );
        holds.lost(old.id, LostReason::Stolen);
        assert!(holds.signal(old.id).is_lost());
        let (new, _) = holds.granted(
            first(&holds, &req),
            Grant::until(9, Instant::now() + lease),
            &req,
            None,
            &LockMeter::default(),
        );
        assert_eq!(new.token, 9);
        assert!(matches!(holds.leave(old.id, false, &Remote), Leave::Detached), "the old hold's release sends nothing");
        assert!(matches!(holds.leave(new.id, false, &Remote), Leave::Last(_)));
    }

    #[tokio::test]
    async fn a_hold_short_of_lease_is_extended_before_it_is_joined() {
        let holds = Arc::new(Holds::default());
        let lease = Duration::from_secs(30);
        let req = request(lease);
        let short = Instant::now() + Duration::from_secs(10);
        let (held, _) = holds.granted(first(&holds, &req), Grant::until(7, short), &req, None, &LockMeter::default());
        let Enter::Extend(id) = holds.enter(&req, false, None, &Remote, &LockMeter::default()).0 else {
            panic!("less than half the lease left")
        };
        assert_eq!(id, held.id);
        let now = Instant::now();
        let (joined, _) = holds.extended(id, now, lease, now + lease, None);
        let joined = joined.expect("joins the extended hold");
        assert_eq!(joined.token, 7);
        assert!(holds.signal(held.id).valid_until() > short, "every guard of the hold sees the renewal");
    }

    /// A hold's signal is made when first asked for: the guards that share
    /// the hold still share one signal, and one made after a verdict or a
    /// renewal starts from it.
    #[tokio::test]
    async fn a_signal_made_late_is_the_one_signal_of_its_hold() {
        let holds = Arc::new(Holds::default());
        let lease = Duration::from_secs(30);
        let req = request(lease);
        let short = Instant::now() + Duration::from_secs(10);
        let (outer, _) = holds.granted(first(&holds, &req), Grant::until(7, short), &req, None, &LockMeter::default());
        assert!(outer.state.is_none(), "nobody asked for it yet");
        let Enter::Extend(id) = holds.enter(&req, false, None, &Remote, &LockMeter::default()).0 else {
            panic!("short of lease")
        };
        let now = Instant::now();
        let (inner, _) = holds.extended(id, now, lease, now + lease, None);
        let inner = inner.expect("joins");
        let (a, b) = (holds.signal(outer.id), holds.signal(inner.id));
        assert!(a.valid_until() > short, "made from the renewed terms");
        holds.lost(outer.id, LostReason::Stolen);
        assert_eq!((a.reason(), b.reason()), (Some(LostReason::Stolen), Some(LostReason::Stolen)));
        let (early, _) =
            holds.granted(first(&holds, &req), Grant::until(9, now + lease), &req, None, &LockMeter::default());
        holds.lost(early.id, LostReason::Stolen);
        assert_eq!(holds.signal(early.id).reason(), Some(LostReason::Stolen), "the verdict came before the signal");
    }

    #[tokio::test]
    async fn an_abandoned_first_acquire_frees_its_turn() {
        let holds = Arc::new(Holds::default());
        let req = request(Duration::from_secs(30));
        let turn = first(&holds, &req);
        let Enter::Wait(settled) = holds.enter(&req, true, None, &Remote, &LockMeter::default()).0 else {
            panic!("waits for the first acquire")
        };
        drop(turn);
        tokio::time::timeout(Duration::from_secs(5), settled).await.expect("woken");
        assert!(matches!(holds.enter(&req, false, None, &Remote, &LockMeter::default()).0, Enter::First(_)));
    }
}
