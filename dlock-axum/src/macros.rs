//! What every middleware service of this crate has alike.

/// `get_ref`, `get_mut` and `into_inner` over the field `inner` (as tower-http's).
macro_rules! inner_service_accessors {
    () => {
        /// The wrapped service.
        pub fn get_ref(&self) -> &S {
            &self.inner
        }

        /// The wrapped service, mutably.
        pub fn get_mut(&mut self) -> &mut S {
            &mut self.inner
        }

        /// The wrapped service, by value.
        pub fn into_inner(self) -> S {
            self.inner
        }
    };
}

/// The wrapped service that was polled ready; a clone takes its place (tower's usual swap).
pub(crate) fn take_ready<S: Clone>(inner: &mut S) -> S {
    let clone = inner.clone();
    std::mem::replace(inner, clone)
}
