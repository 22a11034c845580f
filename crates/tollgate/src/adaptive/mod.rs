//! An adaptive concurrency limit: protects the service itself from more work than it can do.
//!
//! The other limits of a [`RateLimitLayer`](crate::RateLimitLayer) say what each client may
//! use; an [`Adaptive`] limit says how many requests this process lets run at once, and
//! learns it from their latency. It is local to one replica (overload is per process) and
//! never calls the backend. Add it with
//! [`RateLimitLayerBuilder::adaptive`](crate::RateLimitLayerBuilder::adaptive), with the key
//! that fairness counts by.
//!
//! - **The limit** follows a gradient (see [`Adaptive::gradient`]): at each window (at least
//!   100 ms) it moves toward `limit × min(1, tolerance × baseline / mean latency)`, plus a
//!   headroom while the latency is within the tolerance, so it settles near what the service
//!   runs at its baseline latency. The
//!   baseline is measured with the limit pinned to its floor, at start and every minute or so
//!   (jittered), under a ceiling. The latency of a request runs from its handler's start to
//!   its response head; a 5xx, an error of the service, or a request that took the timeout
//!   counts as a sample at the timeout (overload); a request refused by another limit, or
//!   dropped before its answer, tells nothing.
//! - **Classes** ([`Priority`], levels 0 to 99): as the requests in flight rise, the lowest
//!   levels are shed first; [`Priority::Critical`] keeps a reserve (default 20% of the limit)
//!   that no other level takes; nothing else is set aside.
//! - **Fairness**: once a level's share is half full, a key may hold only its part of it
//!   (the share divided among the keys in flight): the heaviest keys are shed first.
//! - **A short queue** ([`Adaptive::queue`]), sized by the current limit, serves the highest
//!   levels first; a request waits in it at most its longest wait.
//! - **Counting is one critical section**: requests in flight, of all classes together,
//!   never exceed the limit in force when each was admitted.
//!
//! A shed request is answered `503 Service Unavailable` with `Retry-After` (gRPC:
//! `UNAVAILABLE` with a retry delay): the server's overload, not the client's quota. Its
//! [`Decision`](crate::Decision) says so ([`Decision::adaptive`](crate::Decision::adaptive)).
//!
//! # Order in the layer
//!
//! The adaptive permit is taken first, in `call`, before the layer's backend is asked: a shed
//! request never reaches the backend and consumes no unit of any other limit. An admitted
//! request then goes through the other limits; if one refuses it, its permit goes back at once
//! (no sample). The permit is held while the handler runs and until the response body ends or
//! is dropped, as a concurrency limit's slot is; a request that waits for a delayed or queued
//! limit holds it while it waits.
//!
//! # Examples
//!
//! ```
//! use axum::{routing::get, Router};
//! use tollgate::key::ClientIp;
//! use tollgate::{Adaptive, Limit, Priority, Quota, RateLimitLayer};
//!
//! # fn main() -> Result<(), tollgate::engine::ConfigError> {
//! let layer = RateLimitLayer::builder()
//!     .limit(Limit::gcra("per-ip", Quota::per_second(50)?)?, ClientIp::peer())
//!     .adaptive(Adaptive::gradient().name("api").max(200), ClientIp::peer())
//!     .build()?;
//! // An application marks its checkout critical (an extension set by an earlier layer).
//! let app: Router = Router::new().route("/checkout", get(|| async { "ok" }).route_layer(layer));
//! # let _ = Priority::Critical;
//! # Ok(()) }
//! ```

mod builder;
mod classes;
mod controller;
mod fairness;
mod gate;
mod line;
mod metrics;
mod outcome;
mod permit;

use std::sync::Arc;
use std::time::Duration;

use http::Request;

pub use builder::Adaptive;
pub use classes::Priority;
pub use outcome::{AdaptiveDecision, ShedReason};

pub(crate) use gate::Gate;
pub(crate) use permit::{Permit, PermitWait};

use gate::Answer;

use crate::key::{KeyExtractor, RequestView};

/// A running adaptive limit, to read what it has learned.
///
/// From [`RateLimitLayer::adaptive`](crate::RateLimitLayer::adaptive); clones read the same
/// limit.
#[derive(Debug, Clone)]
pub struct AdaptiveLimit {
    gate: Arc<Gate>,
}

impl AdaptiveLimit {
    pub(crate) fn new(gate: Arc<Gate>) -> Self {
        Self { gate }
    }

    /// Its name.
    pub fn name(&self) -> &str {
        &self.gate.name
    }

    /// The limit requests are admitted under now (the floor while the baseline is measured).
    pub fn limit(&self) -> u32 {
        self.gate.lock().ctl.limit()
    }

    /// The limit the gradient has learned (the one in force outside a measurement).
    pub fn learned(&self) -> u32 {
        self.gate.lock().ctl.learned()
    }

    /// The requests that hold a permit now.
    pub fn in_flight(&self) -> u32 {
        self.gate.lock().in_flight
    }

    /// The baseline latency, once measured.
    pub fn min_rtt(&self) -> Option<Duration> {
        self.gate.lock().ctl.baseline().map(Duration::from_micros)
    }

    /// The requests waiting in its queue.
    pub fn queue_depth(&self) -> usize {
        self.gate.lock().line.len()
    }

    /// Whether the baseline is being measured (the limit pinned to its floor).
    pub fn is_measuring(&self) -> bool {
        self.gate.lock().ctl.is_measuring()
    }

    /// Learns the baseline again, as at start: after a deploy, or when the service changed.
    /// A layer's [`Reloader`](crate::Reloader) does this on every reload.
    pub fn restart(&self) {
        let now = self.gate.now();
        self.gate.lock().ctl.restart(now);
    }
}

/// What the adaptive limit answered a request.
pub(crate) enum Admission {
    /// Admitted: it holds a permit (under monitor-only, perhaps one it would have been
    /// refused: its decision says so).
    Admitted(Permit),
    /// Waits in the queue.
    Wait(PermitWait),
    /// Shed.
    Shed(AdaptiveDecision),
}

/// What a layer holds of its adaptive limit: the limit, and the key fairness counts by.
pub(crate) struct Guard {
    pub(crate) gate: Arc<Gate>,
    key: Box<dyn KeyExtractor>,
}

impl Guard {
    pub(crate) fn new(gate: Gate, key: Box<dyn KeyExtractor>) -> Self {
        Self {
            gate: Arc::new(gate),
            key,
        }
    }

    /// Admits, queues or sheds `req`: its class from its [`Priority`] extension, else the
    /// configured header, else `Default`; its key from the extractor (a request without one
    /// counts with every other keyless one).
    pub(crate) fn admit<T>(&self, req: &Request<T>) -> Admission {
        let level = match req.extensions().get::<Priority>() {
            Some(&level) => level,
            None => self
                .gate
                .s
                .header
                .as_ref()
                .and_then(|name| req.headers().get(name))
                .and_then(Priority::from_header)
                .unwrap_or_default(),
        };
        let view = RequestView::new(req);
        let key = self.key.extract(&view).ok();
        let fp = self.gate.fingerprint(key.as_ref().map(|k| k.as_bytes()));
        let gate = Arc::clone(&self.gate);
        match self.gate.admit(level, fp) {
            Answer::Admitted { fp, epoch, part } => {
                Admission::Admitted(Permit::new(gate, fp, epoch, part))
            }
            Answer::Wait {
                place,
                fp,
                level,
                wait,
            } => Admission::Wait(PermitWait::new(gate, (place, fp), level, wait)),
            Answer::Shed(part) => Admission::Shed(part),
        }
    }

    pub(crate) fn name(&self) -> &str {
        &self.gate.name
    }

    pub(crate) fn retry_after(&self) -> Duration {
        self.gate.s.retry_after
    }
}

impl std::fmt::Debug for Guard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Guard")
            .field("gate", &self.gate)
            .finish_non_exhaustive()
    }
}
