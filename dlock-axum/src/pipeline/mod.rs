//! The request pipeline every face of dlock-axum goes through:
//! [`LockLayer`](crate::LockLayer), the `#[lockable]` runtime, [`JsonBody`](crate::JsonBody)
//! and the [idempotency layers](crate::idempotency).
//!
//! * [`policy`]: what a route's lock is (name, wait, lease, message, code);
//! * [`body`]: reading a body within its byte and time bounds, and draining
//!   a refused one;
//! * [`acquire`]: taking a request's lock and releasing it;
//! * [`detached`]: what a hang-up must not cut (a locked route, a claim and
//!   what settles it) runs on a task of its own;
//! * [`refusal`]: a request refused before its route ran, its answer and
//!   its one log event;
//! * [`until_commit`]: a lock inside an in-transaction idempotency layer
//!   released once the transaction has ended, not when the route answers;
//! * [`outage`]: an outage of the lock service or the idempotency store,
//!   logged once with a count, not once per request.

pub(crate) mod acquire;
pub(crate) mod body;
pub(crate) mod detached;
pub(crate) mod outage;
pub(crate) mod policy;
pub(crate) mod refusal;
pub(crate) mod until_commit;
