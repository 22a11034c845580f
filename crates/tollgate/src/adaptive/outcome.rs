//! What the adaptive limit decided for one request, as its [`Decision`](crate::Decision)
//! carries it.

use std::time::Duration;

use super::classes::Priority;

/// Why the adaptive limit shed a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ShedReason {
    /// The requests in flight reached the request's level's share of the current limit, and
    /// there was no queue (or the limit is being measured).
    Limit,
    /// The queue was full, or a request of a higher level took the request's place in it.
    QueueFull,
    /// The request waited in the queue as long as it may.
    QueueTimeout,
    /// The request's level is contended and its key held more than its fair part of it.
    KeyShare,
}

impl ShedReason {
    /// Every reason, in the order of their labels.
    pub(crate) const ALL: [ShedReason; 4] = [
        Self::Limit,
        Self::QueueFull,
        Self::QueueTimeout,
        Self::KeyShare,
    ];

    /// A fixed label: `limit`, `queue_full`, `queue_timeout` or `key_share`.
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Limit => "limit",
            Self::QueueFull => "queue_full",
            Self::QueueTimeout => "queue_timeout",
            Self::KeyShare => "key_share",
        }
    }

    pub(crate) fn index(self) -> usize {
        match self {
            Self::Limit => 0,
            Self::QueueFull => 1,
            Self::QueueTimeout => 2,
            Self::KeyShare => 3,
        }
    }
}

/// The adaptive concurrency limit's part of a [`Decision`](crate::Decision).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdaptiveDecision {
    priority: Priority,
    shed: Option<ShedReason>,
    monitor_only: bool,
    /// Microseconds in the queue.
    queued: u64,
}

impl AdaptiveDecision {
    pub(crate) fn new(priority: Priority, shed: Option<ShedReason>, monitor_only: bool) -> Self {
        Self {
            priority,
            shed,
            monitor_only,
            queued: 0,
        }
    }

    pub(crate) fn queued_for(mut self, waited: Duration) -> Self {
        self.queued = u64::try_from(waited.as_micros()).unwrap_or(u64::MAX);
        self
    }

    /// The request's class.
    pub fn priority(&self) -> Priority {
        self.priority
    }

    /// Why the request was shed, or, under
    /// [`monitor_only`](super::Adaptive::monitor_only), would have been; `None` when it
    /// was admitted on its merits.
    pub fn shed_reason(&self) -> Option<ShedReason> {
        self.shed
    }

    /// Whether the request was shed: refused with `503` and `Retry-After`.
    pub fn is_shed(&self) -> bool {
        self.shed.is_some() && !self.monitor_only
    }

    /// Whether the limit only reports: it sheds nothing.
    pub fn is_monitor_only(&self) -> bool {
        self.monitor_only
    }

    /// How long the request waited in the adaptive limit's queue; `None` if it did not.
    pub fn queued(&self) -> Option<Duration> {
        (self.queued > 0).then(|| Duration::from_micros(self.queued))
    }
}
