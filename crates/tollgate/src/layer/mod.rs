//! The rate-limit middleware: [`RateLimitLayer`](crate::RateLimitLayer), its service
//! [`RateLimit`](crate::RateLimit) and future.
//!
//! One request's way through it:
//!
//! 0. With an adaptive concurrency limit ([`crate::adaptive`]), its permit first (or a wait in
//!    its queue, or `503`): a shed request never reaches the backend. `service.rs` `start`
//!    then runs the steps below; the permit goes back with the response body, or at once
//!    when another limit refuses.
//! 1. `prepare.rs`: the request's facts, decided once: each limit's key (no I/O; a missing key
//!    applies the limit's [`MissingKeyPolicy`]: refuse with 400, skip the limit, or count in a
//!    shared bucket), quota and cost, and the one backend call that checks every limit,
//!    all-or-nothing.
//! 2. `decide.rs` (`failure.rs` when the backend failed: each limit's [`FailurePolicy`]): all
//!    admitted, the [`Decision`](crate::Decision) goes into the request's extensions and the
//!    inner service is called (`future.rs`); any refused, `refusal.rs` answers 429 (or 503
//!    when a fail-closed limit's backend failed) with `Retry-After`, and nothing was consumed.
//! 3. `respond.rs`: the admitted response gets the decision and the `RateLimit` fields;
//!    `settle.rs` and `slots.rs` settle what it owes and give back its slots when it is done.
//!
//! A request admitted by a delayed limit beyond its burst waits in `future.rs` for the time
//! its check reserved before the inner service is called; `wait.rs` bounds the waiters. A
//! request that a queued concurrency limit's full key refused waits in its key's line
//! (`queue.rs`) and is checked again, whole, when its turn comes (`queued.rs`).
//!
//! [`MissingKeyPolicy`]: tollgate_engine::MissingKeyPolicy
//! [`FailurePolicy`]: tollgate_engine::FailurePolicy

pub(crate) mod admin;
pub(crate) mod body;
mod decide;
mod facts;
mod failure;
pub(crate) mod future;
mod held;
// The layer itself, as in tower-http's middleware folders.
#[allow(clippy::module_inception)]
pub(crate) mod layer;
pub(crate) mod limits;
mod prepare;
mod queue;
mod queued;
mod refusal;
mod refused;
pub(crate) mod reload;
mod report;
mod respond;
pub(crate) mod service;
mod settle;
mod slots;
mod state;
pub(crate) mod svc;
mod wait;
