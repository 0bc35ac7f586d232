//! The request pipeline every face of dlock-axum goes through; why each
//! module is as it is: `docs/axum-design.md`.

pub(crate) mod acquire;
pub(crate) mod body;
pub(crate) mod detached;
pub(crate) mod outage;
pub(crate) mod policy;
pub(crate) mod refusal;
pub(crate) mod until_commit;
