//! The state every clone of a layer and its services shares.

use std::fmt;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

use arc_swap::ArcSwap;
use tollgate_engine::{Backend, Clock, MemoryBackend};

use super::limits::LimitSet;
use super::queue::Lines;
use super::refused::Refusals;
use super::respond::Responses;
use super::wait::Waiters;
use crate::adaptive::Guard;
use crate::key::RequestView;
use crate::plan::Plan;
/// The plan of a request without a [`Plan`] extension.
pub(crate) type PlanFn = Box<dyn Fn(&RequestView<'_>) -> Option<Plan> + Send + Sync>;

/// The state every clone of a layer and its services shares.
pub(crate) struct Shared<B> {
    pub(crate) backend: B,
    /// The limits now. A request loads them once (no lock) and keeps them to its decision,
    /// so a reload never changes the limits of a request in flight.
    pub(crate) set: ArcSwap<LimitSet>,
    /// Serialises reloads (never taken by a request), and holds the ticket of the last one
    /// applied.
    pub(crate) reloads: Mutex<u64>,
    /// Numbers reloads in the order they start.
    pub(crate) reload_tickets: AtomicU64,
    /// The plan of a request without a `Plan` extension.
    pub(crate) plan_fn: Option<PlanFn>,
    pub(crate) fallback: MemoryBackend<Arc<dyn Clock>>,
    /// How admitted responses and refusals are shaped.
    pub(crate) respond: Responses,
    /// The requests that wait for delayed limits, counted per limit and key.
    pub(crate) waiters: Arc<Waiters>,
    /// The lines of requests that wait for queued concurrency limits' slots.
    pub(crate) lines: Arc<Lines>,
    /// The share of a quota, in percent, at or below which an admission's remaining units
    /// count in `tollgate_near_limit_total`.
    pub(crate) near_limit: u8,
    /// Each limit's summary of refused keys, for the reports of who is refused.
    pub(crate) refused: Refusals,
    /// The adaptive concurrency limit, asked before the backend.
    pub(crate) adaptive: Option<Guard>,
}

impl<B: Backend> fmt::Debug for Shared<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimitLayer")
            .field("backend", &self.backend.kind())
            .field(
                "limits",
                &self
                    .set
                    .load()
                    .limits
                    .iter()
                    .map(|e| &e.limit)
                    .collect::<Vec<_>>(),
            )
            .field("fields", &self.respond.fields)
            .field("decision_on_allowed", &self.respond.decision_on_allowed)
            .finish()
    }
}
