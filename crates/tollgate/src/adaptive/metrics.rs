//! The adaptive limit's metrics, labelled by its name (`limit`), and for sheds by the
//! request's class (`priority`: `critical`, `default`, `batch` or `level_<n>`) and the reason.
//!
//! - `tollgate_adaptive_limit{limit}`: the limit requests are admitted under now.
//! - `tollgate_adaptive_in_flight{limit}`: the requests that hold a permit.
//! - `tollgate_adaptive_min_rtt_seconds{limit}`: the baseline latency (0 until measured).
//! - `tollgate_adaptive_queue_depth{limit}`: the requests waiting in its queue.
//! - `tollgate_adaptive_shed_total{limit, priority, reason}`: requests shed (503).
//! - `tollgate_adaptive_shadow_shed_total{limit, priority, reason}`: requests a
//!   monitor-only limit would have shed (and admitted).
//!
//! Handles are registered on first use, as the layer's are, so that a recorder installed after
//! the layer was built sees them; the named classes' shed counters (the shadow ones under
//! monitor-only) exist (at 0) from then on.

use std::sync::{Arc, OnceLock};

use metrics::{Counter, Gauge, SharedString};

use super::classes::Priority;
use super::outcome::ShedReason;

const NAMED: [Priority; 3] = [Priority::Critical, Priority::Default, Priority::Batch];

pub(crate) struct Metrics {
    name: Arc<str>,
    /// Which shed counter the limit counts in: the shadow one when monitor-only.
    shadow: bool,
    handles: OnceLock<Handles>,
}

struct Handles {
    limit: Gauge,
    in_flight: Gauge,
    min_rtt: Gauge,
    queue: Gauge,
    /// By named class, then reason.
    shed: [[Counter; ShedReason::ALL.len()]; NAMED.len()],
}

/// What the gauges show.
pub(crate) struct Levels {
    pub(crate) limit: u32,
    pub(crate) in_flight: u32,
    pub(crate) min_rtt_micros: u64,
    pub(crate) queue: usize,
}

impl Metrics {
    pub(crate) fn new(name: Arc<str>, shadow: bool) -> Self {
        Self {
            name,
            shadow,
            handles: OnceLock::new(),
        }
    }

    fn label(&self) -> SharedString {
        SharedString::from(Arc::clone(&self.name))
    }

    fn handles(&self) -> &Handles {
        self.handles.get_or_init(|| {
            let shed = NAMED.map(|priority| {
                ShedReason::ALL.map(|reason| self.counter(priority, reason))
            });
            Handles {
                limit: metrics::gauge!("tollgate_adaptive_limit", "limit" => self.label()),
                in_flight: metrics::gauge!("tollgate_adaptive_in_flight", "limit" => self.label()),
                min_rtt: metrics::gauge!("tollgate_adaptive_min_rtt_seconds", "limit" => self.label()),
                queue: metrics::gauge!("tollgate_adaptive_queue_depth", "limit" => self.label()),
                shed,
            }
        })
    }

    fn counter(&self, priority: Priority, reason: ShedReason) -> Counter {
        let name = if self.shadow {
            "tollgate_adaptive_shadow_shed_total"
        } else {
            "tollgate_adaptive_shed_total"
        };
        metrics::counter!(
            name,
            "limit" => self.label(),
            "priority" => priority.label(),
            "reason" => reason.as_str()
        )
    }

    /// Sets the gauges.
    pub(crate) fn show(&self, levels: &Levels) {
        let h = self.handles();
        h.limit.set(f64::from(levels.limit));
        h.in_flight.set(f64::from(levels.in_flight));
        h.min_rtt.set(levels.min_rtt_micros as f64 / 1e6);
        h.queue.set(levels.queue as f64);
    }

    /// Counts a request shed (or, monitor-only, one that would have been).
    pub(crate) fn shed(&self, priority: Priority, reason: ShedReason) {
        let h = self.handles();
        match NAMED.iter().position(|&p| p == priority) {
            Some(i) => h.shed[i][reason.index()].increment(1),
            // Levels other than the named three are rarer: looked up each time.
            None => self.counter(priority, reason).increment(1),
        }
    }
}
