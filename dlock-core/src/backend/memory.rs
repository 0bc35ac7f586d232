//! The in-process backend: a map of leases behind a mutex.
//!
//! It follows the same rules as the Redis backend (leases expire, the owner
//! is checked on renew and release, fencing tokens only grow, a release
//! wakes one waiter; re-entry is counted by the engine) so that a single instance needs no server
//! and tests of the HTTP layers run without one. It coordinates only the
//! tasks of one process.
//!
//! One difference: a lock taken on the spot for a request that would keep it
//! until released (watchdog mode, no `max_hold`) has no lease: it is granted
//! [`GrantLease::UntilReleased`](super::GrantLease::UntilReleased). Its
//! holder lives in this process and its guard's drop always gives it back,
//! so there is nothing for a watchdog to renew; the grant's [`LostSignal`]
//! tells the guard at once when an operator's forced unlock takes the
//! lock from it.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use hashbrown::hash_map::EntryRef;
use hashbrown::HashMap;
use tokio::sync::Notify;
use tokio::time::Instant;

use super::signal::never_after;
use super::wait::{acquire_loop, Attempt, Freed, Parked};
use super::{
    AcquireRequest, Backend, BoxFuture, CancellationToken, Grant, Holder as BackendHolder, KeyPage, ListQuery,
    LockMode, LockState, LostReason, LostSignal, Release, Renewal,
};
use crate::error::{Error, Result};
use crate::key::LockKey;
use crate::owner::Owner;

/// Locks for the tasks of this process.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> dlock_core::Result<()> {
/// use dlock_core::{Locker, MemoryBackend};
/// let locker = Locker::new(MemoryBackend::new());
/// let key = locker.key("demo").part(1).build()?;
/// let guard = locker.try_acquire(&key).await?;
/// assert!(locker.try_acquire(&key).await.is_err());
/// assert!(guard.release().await?);
/// # Ok(()) }
/// ```
#[derive(Debug, Default)]
pub struct MemoryBackend {
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// Hashed with foldhash, seeded per process, as the engine's hold
    /// table: every acquire and release hashes its key here, and SipHash
    /// cost more than the rest of the look-up. hashbrown's map, whose
    /// `entry_ref` clones the key only to insert it: a look-up by a key's
    /// reference costs no reference count.
    slots: HashMap<LockKey, Slot, foldhash::fast::RandomState>,
    /// One counter for all keys: strictly increasing per key, trivially.
    last_fence: u64,
}

#[derive(Debug, Default)]
struct Slot {
    /// The exclusive holder.
    holder: Option<Holder>,
    /// The holders that share the key (shared holds or permits), boxed:
    /// most keys are only ever taken exclusively.
    counted: Option<Box<Counted>>,
    /// The acquires waiting for it. While one of them wants it exclusive,
    /// new shared holders wait behind it (writer preference).
    parked: Parked,
}

/// The holders of a key taken in a mode that admits several, and the
/// places of the waiters that keep a semaphore's limit.
#[derive(Debug)]
struct Counted {
    /// Shared, or permits of a fixed limit.
    mode: LockMode,
    holders: Vec<Holder>,
    /// The waiters for a permit that found every permit of this limit
    /// taken, with the end of their wait: while one is here the key stays a
    /// semaphore of this limit, also with nobody holding it (issue 38 item
    /// 5, as on Redis). A grant takes the waiter's place, and so does the
    /// end of its acquire (its [`Registration`] dropped: cancelled, failed
    /// or timed out); the end of its wait bounds a place whose acquire
    /// future was leaked.
    places: Vec<(Owner, Instant)>,
}

#[derive(Debug)]
struct Holder {
    owner: Owner,
    fence: u64,
    /// `None`: held until released (granted `GrantLease::UntilReleased`);
    /// a re-entry or a renewal never gives such a hold a lease again.
    expires_at: Option<Instant>,
    /// The guard of a hold taken until released, told when it is taken away.
    watcher: Option<LostSignal>,
}

impl Slot {
    /// Nobody holds or waits for it: its map entry can go, so that one-off
    /// keys do not accumulate.
    fn idle(&mut self, now: Instant) -> bool {
        self.parked.waiters == 0 && self.live_holder(now).is_none() && self.live_counted(now).is_none()
    }

    /// The holders that share the key, whose leases have not run out, and
    /// the places of waiters whose wait has not ended; `None` when there
    /// are neither.
    fn live_counted(&mut self, now: Instant) -> Option<&mut Counted> {
        if let Some(counted) = self.counted.as_mut() {
            counted.holders.retain(|h| h.expires_at.is_none_or(|at| at > now));
            counted.places.retain(|(_, until)| *until > now);
        }
        self.forget_counted_if_empty();
        self.counted.as_deref_mut()
    }

    /// Drops the counted mode once nobody holds the key and no waiter
    /// keeps its limit.
    fn forget_counted_if_empty(&mut self) {
        if self.counted.as_ref().is_some_and(|c| c.holders.is_empty() && c.places.is_empty()) {
            self.counted = None;
        }
    }

    /// The holder whose lease has not run out.
    fn live_holder(&mut self, now: Instant) -> Option<&mut Holder> {
        if self.holder.as_ref().is_some_and(|h| h.expires_at.is_some_and(|at| at <= now)) {
            self.holder = None;
        }
        self.holder.as_mut()
    }
}

impl MemoryBackend {
    /// An empty lock table.
    pub fn new() -> Self {
        Self::default()
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // A panic while holding this mutex cannot leave the map half-updated
        // (every update is a single assignment), so a poisoned lock is safe to use.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// One attempt. A fresh hold gets the request's lease, or with
    /// `until_released` none at all: what a watchdog-mode acquire answered
    /// on the spot gets, since nothing here can outlive the guard that would
    /// renew it. A hold of the same owner (the engine asks again only once
    /// its own hold lapsed) is joined: same token, its lease extended.
    /// `awaited`: the request waits (a try after it registered); a permit
    /// that finds every permit taken then records its place.
    fn take(&self, req: &AcquireRequest, until_released: bool, awaited: bool) -> std::result::Result<Grant, Refusal> {
        let now = Instant::now();
        let mut state = self.state();
        let state = &mut *state;
        let slot = state.slots.entry_ref(&req.key).or_default();
        let expires_at = now + req.lease;
        if let Some(h) = slot.live_holder(now) {
            return match h.owner == req.owner {
                true if req.mode == LockMode::Exclusive || req.mode == LockMode::Shared => {
                    if let Some(at) = h.expires_at.as_mut() {
                        *at = expires_at;
                    }
                    Ok(Grant::until(h.fence, expires_at))
                }
                true => Err(Refusal::Conflict(Error::mode_conflict(
                    &req.key,
                    format!("this owner holds it exclusive, not as {}", req.mode),
                ))),
                false => Err(Refusal::Held(h.expires_at.map(|at| at - now))),
            };
        }
        let writers = slot.parked.writers;
        if let Some(counted) = slot.live_counted(now) {
            if !counted.mode.is_compatible_with(req.mode) {
                return Err(match (counted.mode, req.mode) {
                    // A writer waits for the readers.
                    (LockMode::Shared, LockMode::Exclusive) => Refusal::Held(counted.next_expiry(now)),
                    (held, asked) if counted.holders.is_empty() => Refusal::Conflict(Error::mode_conflict(
                        &req.key,
                        format!("a waiter for {held} keeps its limit, and it was asked for as {asked}"),
                    )),
                    (held, asked) => Refusal::Conflict(Error::mode_conflict(
                        &req.key,
                        format!("it is held as {held}, and was asked for as {asked}"),
                    )),
                });
            }
            if let Some(h) = counted.holders.iter_mut().find(|h| h.owner == req.owner) {
                if let Some(at) = h.expires_at.as_mut() {
                    *at = (*at).max(expires_at);
                }
                return Ok(Grant::until(h.fence, expires_at));
            }
            let full = match req.mode {
                LockMode::Shared => writers > 0,
                mode => mode.limit().is_some_and(|limit| counted.holders.len() >= limit as usize),
            };
            if full {
                if let (true, LockMode::Permits { .. }, Some(until)) = (awaited, req.mode, req.deadline)
                    && !counted.places.iter().any(|(o, _)| *o == req.owner)
                {
                    counted.places.push((req.owner.clone(), until));
                }
                return Err(Refusal::Held(counted.next_expiry(now)));
            }
            // Granted: a waiter's place goes with its wait.
            counted.places.retain(|(o, _)| *o != req.owner);
        } else if req.mode == LockMode::Shared && writers > 0 {
            // Free, but a writer waits for it: readers queue behind it.
            return Err(Refusal::Held(None));
        }
        state.last_fence += 1;
        let fence = state.last_fence;
        let (expires_at, watcher, grant) = if until_released {
            let watcher = LostSignal::new(never_after(now));
            (None, Some(watcher.clone()), Grant::until_released(fence).with_lost_signal(watcher))
        } else {
            (Some(expires_at), None, Grant::until(fence, expires_at))
        };
        let holder = Holder { owner: req.owner.clone(), fence, expires_at, watcher };
        match req.mode {
            LockMode::Exclusive => slot.holder = Some(holder),
            mode => slot
                .counted
                .get_or_insert_with(|| Box::new(Counted { mode, holders: Vec::new(), places: Vec::new() }))
                .holders
                .push(holder),
        }
        Ok(grant)
    }

    fn register(&self, req: &AcquireRequest) -> Registration<'_> {
        let mut state = self.state();
        let slot = state.slots.entry_ref(&req.key).or_default();
        let notify = slot.parked.park(req.mode);
        let permit = matches!(req.mode, LockMode::Permits { .. }).then(|| req.owner.clone());
        Registration { backend: self, key: req.key.clone(), notify, mode: req.mode, permit }
    }

    /// Drops the map entry of `key` if it is [idle](Slot::idle).
    fn forget_if_idle(state: &mut State, key: &LockKey, now: Instant) {
        if state.slots.get_mut(key).is_some_and(|slot| slot.idle(now)) {
            state.slots.remove(key);
        }
    }

    /// Who holds `key`, and how many acquires wait for it.
    fn state_of(&self, key: &LockKey) -> LockState {
        let now = Instant::now();
        let mut state = self.state();
        let mut out = LockState::new(key.clone()).with_waiting(0);
        let Some(slot) = state.slots.get_mut(key) else { return out };
        let shown = |h: &Holder, mode: LockMode| {
            let holder = BackendHolder::new(h.owner.as_str(), mode, h.fence);
            match h.expires_at {
                Some(at) => holder.with_time_left(at.saturating_duration_since(now)),
                None => holder,
            }
        };
        if let Some(h) = slot.live_holder(now) {
            out.holders.push(shown(h, LockMode::Exclusive));
        }
        let mut places = 0;
        if let Some(counted) = slot.live_counted(now) {
            out.holders.extend(counted.holders.iter().map(|h| shown(h, counted.mode)));
            places = counted.places.len() as u64;
        }
        out.holders.sort_by_key(|h| h.fencing_token);
        // A waiting writer's intent keeps readers out; a permit's place, the limit.
        out.with_waiting(slot.parked.waiters as u64).with_intents(places + slot.parked.writers as u64)
    }

    /// Frees the hold of the owner whose token is `handle`, whoever holds
    /// it, as an operator would (Redisson's `forceUnlock`), and wakes the
    /// waiters. A guard holding it until released sees the loss at once;
    /// one with a lease, at its next renewal.
    fn force_free(&self, key: &LockKey, handle: &str) -> Release {
        let now = Instant::now();
        let mut state = self.state();
        let mut freed: Option<Holder> = None;
        if let Some(slot) = state.slots.get_mut(key) {
            if slot.live_holder(now).is_some_and(|h| h.owner.as_str() == handle) {
                freed = slot.holder.take();
            } else if let Some(counted) = slot.live_counted(now)
                && let Some(i) = counted.holders.iter().position(|h| h.owner.as_str() == handle)
            {
                freed = Some(counted.holders.swap_remove(i));
            }
            if freed.is_some() {
                // The waiters still wait, and their places keep the limit.
                slot.forget_counted_if_empty();
                slot.parked.wake(Freed::All);
            }
        }
        Self::forget_if_idle(&mut state, key, now);
        drop(state);
        match freed {
            Some(mut holder) => {
                if let Some(watcher) = holder.watcher.take() {
                    tracing::warn!(key = %key.log_id(), reason = %LostReason::Stolen, "dlock.lost");
                    watcher.lose(LostReason::Stolen);
                }
                Release::Freed
            }
            None => Release::NotHeld,
        }
    }

    /// The keys held or waited for that start with `query.starts_with`, in
    /// order, after the cursor (the last key of the page before).
    fn keys(&self, query: &ListQuery) -> KeyPage {
        let now = Instant::now();
        let mut state = self.state();
        let after = query.cursor.as_deref().unwrap_or("");
        let mut keys: Vec<LockKey> = state
            .slots
            .iter_mut()
            .filter(|(k, _)| k.as_str().starts_with(&query.starts_with) && k.as_str() > after)
            .filter_map(|(k, slot)| (!slot.idle(now)).then(|| k.clone()))
            .collect();
        keys.sort_unstable();
        let next = (keys.len() > query.limit).then(|| keys[query.limit - 1].as_str().to_owned());
        keys.truncate(query.limit);
        KeyPage::new(keys, next)
    }

    /// How many keys the table currently tracks (held or waited for).
    pub fn len(&self) -> usize {
        let now = Instant::now();
        let mut state = self.state();
        let keys: Vec<LockKey> = state.slots.keys().cloned().collect();
        for k in &keys {
            Self::forget_if_idle(&mut state, k, now);
        }
        state.slots.len()
    }

    /// Whether no key is held or waited for.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Test hook: how many acquires are parked waiting for `key`, so a test
    /// can wait for a waiter to park instead of sleeping and hoping.
    #[doc(hidden)]
    pub fn waiters(&self, key: &LockKey) -> usize {
        self.state().slots.get(key).map_or(0, |slot| slot.parked.waiters)
    }
}

/// Why an attempt was not granted.
enum Refusal {
    /// Held by others; the first of their leases ends in the time given
    /// (`None`: not before a release).
    Held(Option<Duration>),
    /// The key is in use in a mode that does not fit the one asked for.
    Conflict(Error),
}

impl Counted {
    /// When the first of the holders' leases runs out (`None`: one of them
    /// is held until released, or none has a lease).
    fn next_expiry(&self, now: Instant) -> Option<Duration> {
        let mut first = None;
        for h in &self.holders {
            let at = h.expires_at?;
            first = Some(first.map_or(at, |f: Instant| f.min(at)));
        }
        first.map(|at| at.saturating_duration_since(now))
    }
}

struct Registration<'a> {
    backend: &'a MemoryBackend,
    key: LockKey,
    notify: Arc<Notify>,
    mode: LockMode,
    /// The owner of a waiting permit, whose place (if its tries recorded
    /// one) goes when the wait ends.
    permit: Option<Owner>,
}

impl AsRef<Notify> for Registration<'_> {
    fn as_ref(&self) -> &Notify {
        &self.notify
    }
}

impl Drop for Registration<'_> {
    fn drop(&mut self) {
        let mut state = self.backend.state();
        if let Some(slot) = state.slots.get_mut(&self.key) {
            slot.parked.leave(self.mode);
            if let (Some(owner), Some(counted)) = (&self.permit, slot.counted.as_mut()) {
                counted.places.retain(|(o, _)| o != owner);
                slot.forget_counted_if_empty();
            }
            // The last waiting writer gave up or got in: the readers it held
            // back may try again.
            if self.mode == LockMode::Exclusive && slot.parked.writers == 0 && slot.parked.waiters > 0 {
                slot.parked.wake(Freed::All);
            }
        }
        MemoryBackend::forget_if_idle(&mut state, &self.key, Instant::now());
    }
}

impl Backend for MemoryBackend {
    fn name(&self) -> &'static str {
        "memory"
    }

    /// Every mode.
    fn supports(&self, _: LockMode) -> Result<()> {
        Ok(())
    }

    /// Nothing to reach: in process, always ready.
    fn ready(&self) -> BoxFuture<'_, Result<()>> {
        Box::pin(async { Ok(()) })
    }

    fn acquire<'a>(&'a self, req: &'a AcquireRequest, cancel: &'a CancellationToken) -> BoxFuture<'a, Result<Grant>> {
        Box::pin(acquire_loop(
            req,
            cancel,
            // A try here costs no round trip: always try before subscribing.
            || false,
            // Always ready, so it spends the task's cooperative budget like
            // tokio's own primitives: a loop that only locks and unlocks
            // in-process keys still lets the other tasks of its worker run.
            move |awaited| async move {
                tokio::task::coop::consume_budget().await;
                // A grant after a wait keeps its lease, as it always did:
                // only an answer on the spot is held until released.
                match self.take(req, false, awaited) {
                    Ok(grant) => Ok(Attempt::Acquired(grant)),
                    Err(Refusal::Held(retry_in)) => Ok(Attempt::Held { retry_in }),
                    Err(Refusal::Conflict(e)) => Err(e),
                }
            },
            move || std::future::ready(self.register(req)),
        ))
    }

    fn renew<'a>(&'a self, key: &'a LockKey, owner: &'a Owner, lease: Duration) -> BoxFuture<'a, Result<Renewal>> {
        let now = Instant::now();
        let mut state = self.state();
        let holder = state.slots.get_mut(key).and_then(|slot| {
            if slot.live_holder(now).is_some_and(|h| &h.owner == owner) {
                return slot.holder.as_mut();
            }
            slot.live_counted(now)?.holders.iter_mut().find(|h| &h.owner == owner)
        });
        let renewal = match holder {
            Some(h) => {
                if let Some(at) = h.expires_at.as_mut() {
                    *at = now + lease;
                }
                Renewal::Held { valid_until: now + lease }
            }
            _ => Renewal::Lost,
        };
        Box::pin(std::future::ready(Ok(renewal)))
    }

    fn release<'a>(&'a self, key: &'a LockKey, owner: &'a Owner) -> BoxFuture<'a, Result<Release>> {
        Box::pin(std::future::ready(Ok(self.release_in_table(key, owner))))
    }

    fn try_acquire_now(&self, req: &AcquireRequest) -> Option<Result<Grant>> {
        Some(self.take(req, req.until_released, false).map_err(|refusal| match refusal {
            Refusal::Held(_) => Error::Busy { key: req.key.to_string() },
            Refusal::Conflict(e) => e,
        }))
    }

    fn release_now(&self, key: &LockKey, owner: &Owner) -> Option<Result<Release>> {
        Some(Ok(self.release_in_table(key, owner)))
    }

    fn inspect<'a>(&'a self, key: &'a LockKey) -> BoxFuture<'a, Result<LockState>> {
        Box::pin(std::future::ready(Ok(self.state_of(key))))
    }

    fn list<'a>(&'a self, query: &'a ListQuery) -> BoxFuture<'a, Result<KeyPage>> {
        Box::pin(std::future::ready(Ok(self.keys(query))))
    }

    fn force_unlock<'a>(&'a self, key: &'a LockKey, holder: &'a BackendHolder) -> BoxFuture<'a, Result<Release>> {
        Box::pin(std::future::ready(Ok(self.force_free(key, holder.handle()))))
    }
}

impl MemoryBackend {
    fn release_in_table(&self, key: &LockKey, owner: &Owner) -> Release {
        let now = Instant::now();
        let mut state = self.state();
        // One lookup (one hash of the key) finds, frees and forgets the slot.
        let EntryRef::Occupied(mut entry) = state.slots.entry_ref(key) else {
            return Release::NotHeld;
        };
        let slot = entry.get_mut();
        let release = match slot.live_holder(now) {
            Some(h) if &h.owner == owner => {
                slot.holder = None;
                slot.parked.wake(Freed::Hold);
                Release::Freed
            }
            _ => match slot.live_counted(now) {
                Some(counted) => match counted.holders.iter().position(|h| &h.owner == owner) {
                    Some(at) => {
                        counted.holders.swap_remove(at);
                        let mode = counted.mode;
                        slot.forget_counted_if_empty();
                        slot.parked.wake(Freed::release_of(mode));
                        Release::Freed
                    }
                    None => Release::NotHeld,
                },
                None => Release::NotHeld,
            },
        };
        if slot.idle(now) {
            entry.remove();
        }
        release
    }
}
