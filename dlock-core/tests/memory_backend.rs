//! The behavioural suite on the in-process backend.

mod suite;

use std::sync::Arc;
use std::time::Duration;

use dlock_core::{Backend, LockKey, Locker, LockerOptions, MemoryBackend};

struct Memory {
    backend: Arc<MemoryBackend>,
}

/// Every client of the in-process backend shares one table, as every task
/// of a process does.
impl suite::Harness for Memory {
    async fn client(&self) -> Locker {
        let opts = LockerOptions::default().with_watchdog_lease(Duration::from_millis(300));
        Locker::with_options(self.backend.clone() as Arc<dyn Backend>, opts).expect("valid options")
    }

    async fn delete_behind_back(&self, key: &LockKey) {
        assert!(self.backend.force_unlock(key), "the key was held");
    }

    async fn lock_keys_left(&self) -> usize {
        self.backend.len()
    }
}

async fn memory() -> Memory {
    Memory { backend: Arc::new(MemoryBackend::new()) }
}

backend_suite!(memory());
