//! Who is being refused: per enforced limit, a Space-Saving summary of the keys it refused,
//! counted in this process on the refusal path (`report.rs`) and handed to the backend's
//! [`Reports`](tollgate_engine::Reports) at most once per [`REPORT_TICK`];
//! `RateLimitLayer::top_refused` (`admin.rs`) hands what is left and reads the reports.
//!
//! A refusal costs one mutex and one summary update (a hash lookup and a walk along one path
//! of a heap of `k` counters); a limit finds its summary by name, under a read lock, once (at
//! its first refusal, and again after a reload). Once per tick one refusal also names the
//! summary's keys (`KeyExtractor::identity_of`) and hands them over: in memory at once, on a
//! networked backend in a task that nobody waits for. Identities are never metric labels.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, PoisonError, RwLock};

use tollgate_engine::topk::{Counter, SpaceSaving};
use tollgate_engine::REPORT_TICK;
use tollgate_engine::{Clock, Micros};

/// Every limit's summary of refused keys in this process, by limit name (a reload that keeps
/// a limit's name keeps its summary).
pub(crate) struct Refusals {
    /// Counters per summary; 0: refusals are not counted.
    k: usize,
    clock: Arc<dyn Clock>,
    limits: RwLock<HashMap<Box<str>, Arc<Mutex<Local>>>>,
}

/// A limit's own handle on its summary, found by name at its first refusal and kept beside
/// the limit, so that a refusal (the path a flood takes) neither locks nor searches the map.
#[derive(Default)]
pub(crate) struct Handle(OnceLock<Arc<Mutex<Local>>>);

/// One limit's refusals since they were last handed to the backend.
struct Local {
    summary: SpaceSaving<Vec<u8>>,
    handed_at: Micros,
}

impl Refusals {
    /// Summaries of `k` counters (none at 0), timed by `clock`.
    pub(crate) fn new(k: usize, clock: Arc<dyn Clock>) -> Self {
        Self {
            k,
            clock,
            limits: RwLock::default(),
        }
    }

    /// Whether refusals are counted.
    pub(crate) fn enabled(&self) -> bool {
        self.k > 0
    }

    /// The most identities a backend keeps per limit and bucket: twice a summary's.
    pub(super) fn keep(&self) -> usize {
        self.k.saturating_mul(2)
    }

    fn local(&self, limit: &str) -> Arc<Mutex<Local>> {
        if let Some(local) = self
            .limits
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(limit)
        {
            return Arc::clone(local);
        }
        let now = self.clock.now();
        let mut limits = self.limits.write().unwrap_or_else(PoisonError::into_inner);
        let local = limits.entry(limit.into()).or_insert_with(|| {
            Arc::new(Mutex::new(Local {
                summary: SpaceSaving::new(self.k),
                handed_at: now,
            }))
        });
        Arc::clone(local)
    }

    /// Counts one refusal of `key` by `limit` now (`handle`: the limit's own handle on its
    /// summary); the counters to hand to the backend when a tick has passed since they were
    /// last handed.
    pub(super) fn count(
        &self,
        limit: &str,
        handle: &Handle,
        key: &[u8],
    ) -> Option<(Vec<Counter<Vec<u8>>>, Micros)> {
        let now = self.clock.now();
        let local = handle.0.get_or_init(|| self.local(limit));
        let mut local = local.lock().unwrap_or_else(PoisonError::into_inner);
        local.summary.add(key, 1, now);
        if now.saturating_sub(local.handed_at) < REPORT_TICK.as_micros() as Micros {
            return None;
        }
        local.handed_at = now;
        Some((local.summary.drain(), now))
    }

    /// Takes `limit`'s counters now, whatever the tick (a read of the reports).
    pub(super) fn take(&self, limit: &str) -> (Vec<Counter<Vec<u8>>>, Micros) {
        let now = self.clock.now();
        let local = self.local(limit);
        let mut local = local.lock().unwrap_or_else(PoisonError::into_inner);
        local.handed_at = now;
        (local.summary.drain(), now)
    }
}
