//! Re-entry decided in the client.
//!
//! A process that holds a key for an owner re-enters it without a round
//! trip: the server keeps one hold per key (its value names the owner and
//! the fencing token, no count), and this table counts the holds of this
//! process. Only the first acquire and the last release reach the server.
//!
//! * A re-entry is answered here while at least half of the requested lease
//!   is left on the hold it joins (the watchdog renews at a third, so a
//!   renewed hold always qualifies); otherwise it goes to the server, whose
//!   script joins the hold idempotently (same token, the lease extended).
//! * Two tasks of one owner that miss the table at once both reach the
//!   server; the second joins the first's hold there, and both count here.
//! * While the last release of a key is on its way, an acquire of the same
//!   key and owner waits for it: sent first, it could join the hold on the
//!   server just before the release deletes it.
//!
//! **An owner shared across processes** shares the lock but not the count:
//! each process joins the same server hold, and the first last-release in
//! any of them frees it for all. Give every process an owner of its own.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::futures::Notified;
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::backend::{Grant, Release};
use crate::error::Result;
use crate::key::LockKey;
use crate::owner::Owner;

/// The holds this process has on its backend, by key and owner.
#[derive(Default)]
pub(crate) struct LocalHolds {
    map: Mutex<Map>,
    /// Wakes the acquires that wait for a last release to land. One for the
    /// table: such waits are rare, and a release nobody waits for then
    /// costs no allocation and no wake-up.
    landed: Notify,
}

/// Hashed with foldhash, seeded per process: every acquire and release
/// looks its key up here a few times, and std's SipHash took three times as
/// long (about 120 ns of a lock cycle against 40, `perf` on `dlock-bench`);
/// the random seed still keeps keys that come from requests from being
/// chosen to collide.
type Map = HashMap<(LockKey, Owner), Hold, foldhash::fast::RandomState>;

struct Hold {
    token: u64,
    /// Holds given out here; 0 while the last release is on its way.
    count: u32,
    /// The end of the lease as last granted or renewed.
    valid_until: Instant,
    /// The last release is on its way (`count` is 0).
    releasing: bool,
    /// An acquire waits for that release to land.
    awaited: bool,
}

/// What an acquire of a key may do before asking the server.
pub(crate) enum Reentry<'a> {
    /// Joined a hold of this process.
    Local(Grant),
    /// The last release of this key and owner is on its way: wait for it to
    /// land, then look again.
    AfterRelease(Notified<'a>),
    /// Ask the server.
    Server,
}

/// What a release of a key may do before asking the server.
pub(crate) enum LocalRelease {
    /// Other holds of this process remain.
    StillHeld(u32),
    /// The last hold: release on the server; the turn goes with the release
    /// command until it is answered.
    Last(ReleaseTurn),
    /// Not a hold this table knows of (a RedLock node's, or a grant whose
    /// answer was lost): release on the server, owner-checked.
    Unknown,
}

/// The turn of the last release of a key while it is on its way: it goes
/// with the release command, and dropping it forgets the hold and wakes the
/// acquires of the key that wait. The command holds it until answered, also
/// when the caller gave up on the release (a command queued for a batch
/// call is still sent, `coalesce.rs`); a command never sent drops it at once.
/// So no acquire waits for a release that will never land, and none
/// overtakes one still on its way.
pub(crate) struct ReleaseTurn {
    holds: Arc<LocalHolds>,
    /// The hold's entry in the table.
    id: (LockKey, Owner),
}

impl Drop for ReleaseTurn {
    fn drop(&mut self) {
        let mut map = self.holds.map();
        // While the release is on its way the count stays 0: acquires of
        // the key wait, and grants are refused (`granted`).
        let Some(hold) = map.get(&self.id).filter(|h| h.releasing && h.count == 0) else { return };
        let awaited = hold.awaited;
        map.remove(&self.id);
        drop(map);
        if awaited {
            self.holds.landed.notify_waiters();
        }
    }
}

impl LocalHolds {
    fn map(&self) -> MutexGuard<'_, Map> {
        // Every change under this lock is one field or one entry, so a panic
        // elsewhere leaves it consistent.
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits for the release `hold` is in. Made under the table's lock,
    /// before the release can land: `notify_waiters` wakes a `Notified` from
    /// the moment it exists, polled or not, so no wake-up falls in between.
    fn wait_release(&self, hold: &mut Hold) -> Notified<'_> {
        hold.awaited = true;
        self.landed.notified()
    }

    /// Joins a hold of this process when it has one with at least half of
    /// `lease` left.
    pub(crate) fn reenter(&self, key: &LockKey, owner: &Owner, lease: Duration) -> Reentry<'_> {
        let mut map = self.map();
        let Some(hold) = map.get_mut(&(key.clone(), owner.clone())) else {
            return Reentry::Server;
        };
        if hold.count == 0 {
            return if hold.releasing { Reentry::AfterRelease(self.wait_release(hold)) } else { Reentry::Server };
        }
        if hold.valid_until < Instant::now() + lease / 2 {
            return Reentry::Server;
        }
        hold.count += 1;
        Reentry::Local(Grant::until(hold.token, hold.valid_until))
    }

    /// Whether this process counts a hold of `key` for `owner`.
    pub(crate) fn holding(&self, key: &LockKey, owner: &Owner) -> bool {
        self.map().get(&(key.clone(), owner.clone())).is_some_and(|h| h.count > 0)
    }

    /// Records a grant of the server and returns its fencing token.
    /// `joined`: the server (or a RedLock quorum) says the owner held the key
    /// already, so a hold of ours that is still counted keeps its token;
    /// otherwise our earlier hold lapsed and the grant is a new one.
    ///
    /// `Err` with a wait for the release when the last release of the key is
    /// on its way: it may land after the grant and delete it, so the grant is
    /// not counted; wait and acquire again.
    pub(crate) fn granted(
        &self,
        key: &LockKey,
        owner: &Owner,
        token: u64,
        valid_until: Instant,
        joined: bool,
    ) -> Result<u64, Notified<'_>> {
        let mut map = self.map();
        let hold = map.entry((key.clone(), owner.clone())).or_insert(Hold {
            token,
            count: 0,
            valid_until,
            releasing: false,
            awaited: false,
        });
        if hold.count == 0 {
            if hold.releasing {
                return Err(self.wait_release(hold));
            }
            hold.count = 1;
            return Ok(token);
        }
        if joined {
            hold.valid_until = hold.valid_until.max(valid_until);
        } else {
            hold.token = token;
            hold.valid_until = valid_until;
        }
        hold.count += 1;
        Ok(hold.token)
    }

    /// Gives back a hold that is not the last one, without I/O; `None` when
    /// the server must be asked.
    pub(crate) fn release_inner(&self, key: &LockKey, owner: &Owner) -> Option<Release> {
        let mut map = self.map();
        let hold = map.get_mut(&(key.clone(), owner.clone()))?;
        if hold.count <= 1 {
            return None;
        }
        hold.count -= 1;
        Some(Release::StillHeld(hold.count))
    }

    /// Gives back one hold.
    pub(crate) fn release(self: &Arc<Self>, key: &LockKey, owner: &Owner) -> LocalRelease {
        let mut map = self.map();
        let Some(hold) = map.get_mut(&(key.clone(), owner.clone())) else {
            return LocalRelease::Unknown;
        };
        match hold.count {
            0 => LocalRelease::Unknown,
            1 => {
                hold.count = 0;
                hold.releasing = true;
                LocalRelease::Last(ReleaseTurn { holds: self.clone(), id: (key.clone(), owner.clone()) })
            }
            _ => {
                hold.count -= 1;
                LocalRelease::StillHeld(hold.count)
            }
        }
    }

    /// Gives back one hold, and sends the release to the server only when it
    /// was the last (or the hold is not known here): the one release path
    /// of every backend that counts re-entry with this table. `on_server`
    /// gets the last release's turn, to keep until its command is answered.
    pub(crate) async fn release_through<F, Fut>(
        self: &Arc<Self>,
        key: &LockKey,
        owner: &Owner,
        on_server: F,
    ) -> Result<Release>
    where
        F: FnOnce(Option<ReleaseTurn>) -> Fut,
        Fut: std::future::Future<Output = Result<Release>>,
    {
        match self.release(key, owner) {
            LocalRelease::StillHeld(left) => Ok(Release::StillHeld(left)),
            LocalRelease::Unknown => on_server(None).await,
            LocalRelease::Last(turn) => on_server(Some(turn)).await,
        }
    }

    /// A re-entry answered from this table, if it can be: `None` when the
    /// server must be asked.
    pub(crate) fn reenter_now(&self, key: &LockKey, owner: &Owner, lease: Duration) -> Option<Result<Grant>> {
        match self.reenter(key, owner, lease) {
            Reentry::Local(grant) => Some(Ok(grant)),
            Reentry::Server | Reentry::AfterRelease(_) => None,
        }
    }

    /// A renewal answered: the hold lives until `valid_until`, or (`None`)
    /// it is gone, so that no re-entry joins it here any more.
    pub(crate) fn renewed(&self, key: &LockKey, owner: &Owner, valid_until: Option<Instant>) {
        let mut map = self.map();
        if let Some(hold) = map.get_mut(&(key.clone(), owner.clone())) {
            hold.valid_until = match valid_until {
                Some(at) => hold.valid_until.max(at),
                None => Instant::now(),
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id() -> (LockKey, Owner) {
        (LockKey::builder("dlock", "holds").part(1).build().expect("key"), Owner::random().expect("owner"))
    }

    #[tokio::test]
    async fn only_the_first_acquire_and_the_last_release_reach_the_server() {
        let holds = Arc::new(LocalHolds::default());
        let (k, o) = id();
        let lease = Duration::from_secs(30);
        assert!(matches!(holds.reenter(&k, &o, lease), Reentry::Server));
        assert_eq!(holds.granted(&k, &o, 7, Instant::now() + lease, false).ok(), Some(7));
        let Reentry::Local(inner) = holds.reenter(&k, &o, lease) else { panic!("a re-entry is local") };
        assert_eq!(inner.fencing_token, 7);
        assert_eq!(holds.release_inner(&k, &o), Some(Release::StillHeld(1)));
        assert_eq!(holds.release_inner(&k, &o), None, "the last hold needs the server");
        let LocalRelease::Last(turn) = holds.release(&k, &o) else { panic!("the last release") };
        let Reentry::AfterRelease(landed) = holds.reenter(&k, &o, lease) else { panic!("waits for the release") };
        assert!(holds.granted(&k, &o, 7, Instant::now() + lease, true).is_err(), "a grant racing the release");
        drop(turn);
        tokio::time::timeout(Duration::from_secs(5), landed).await.expect("the landed release wakes the waiter");
        assert!(matches!(holds.reenter(&k, &o, lease), Reentry::Server));
        assert!(matches!(holds.release(&k, &o), LocalRelease::Unknown));
    }

    #[tokio::test]
    async fn a_release_abandoned_on_its_way_does_not_keep_acquires_waiting() {
        let holds = Arc::new(LocalHolds::default());
        let (k, o) = id();
        let lease = Duration::from_secs(30);
        assert_eq!(holds.granted(&k, &o, 7, Instant::now() + lease, false).ok(), Some(7));
        // The release's future is dropped before the server answers (a
        // `select!` or a timeout around `release()`).
        let never = |turn| async move {
            let _turn = turn;
            std::future::pending::<Result<Release>>().await
        };
        let abandoned = tokio::time::timeout(Duration::from_millis(10), holds.release_through(&k, &o, never)).await;
        assert!(abandoned.is_err(), "the release never landed");
        assert!(matches!(holds.reenter(&k, &o, lease), Reentry::Server), "an acquire goes to the server");
        assert_eq!(holds.granted(&k, &o, 9, Instant::now() + lease, false).ok(), Some(9), "and its grant counts");
    }

    #[tokio::test]
    async fn a_hold_short_of_lease_or_lost_goes_to_the_server() {
        let holds = LocalHolds::default();
        let (k, o) = id();
        let lease = Duration::from_secs(30);
        assert_eq!(holds.granted(&k, &o, 7, Instant::now() + Duration::from_secs(10), false).ok(), Some(7));
        assert!(matches!(holds.reenter(&k, &o, lease), Reentry::Server), "less than half the lease left");
        assert_eq!(holds.granted(&k, &o, 7, Instant::now() + lease, true).ok(), Some(7), "the server joined the hold");
        holds.renewed(&k, &o, None);
        assert!(matches!(holds.reenter(&k, &o, lease), Reentry::Server), "lost");
        assert_eq!(
            holds.granted(&k, &o, 9, Instant::now() + lease, false).ok(),
            Some(9),
            "a new grant takes its token"
        );
    }
}
