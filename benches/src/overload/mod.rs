//! The overload benchmark (`benches/overload.sh`; what it prints is explained in
//! `docs/benchmarks.md`, "Overload"): a server of known capacity, the systems that protect it,
//! an open-loop load generator and the figures of each phase.
//!
//! - [`server`]: the handler with a real capacity (`W` workers, `S` per request, an unbounded
//!   queue before them) and the server that runs one system in front of it.
//! - [`systems`]: the systems compared, among them [`systems::tollgate_adaptive`], the one
//!   place that builds tollgate's.
//! - [`phases`]: the plan of a run (steady, spikes, a slower dependency, recoveries).
//! - [`load`]: the open-loop load generator and what each request met.
//! - [`stats`]: the figures of one phase of one system, and the table they are printed in.

pub mod load;
pub mod phases;
pub mod server;
pub mod stats;
pub mod systems;

use http::HeaderMap;

/// The header a request's priority class travels in.
pub const PRIORITY_HEADER: &str = "x-priority";

/// A request's priority class: the load sends 20% critical, 50% default, 30% batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Class {
    /// Must get through: a checkout, a login.
    Critical,
    /// Ordinary traffic.
    Default,
    /// Can wait or be retried later: exports, crawlers.
    Batch,
}

impl Class {
    /// Every class, in the order the figures print them.
    pub const ALL: [Class; 3] = [Class::Critical, Class::Default, Class::Batch];

    /// The header value that names the class.
    pub fn name(self) -> &'static str {
        match self {
            Class::Critical => "critical",
            Class::Default => "default",
            Class::Batch => "batch",
        }
    }

    /// The class a request's `x-priority` names: `Default` when it names none, or a value
    /// that is no class.
    pub fn of(headers: &HeaderMap) -> Class {
        match headers.get(PRIORITY_HEADER).map(|v| v.as_bytes()) {
            Some(b"critical") => Class::Critical,
            Some(b"batch") => Class::Batch,
            _ => Class::Default,
        }
    }

    /// The class of the load's `n`th request: 2 in every 10 critical, 5 default, 3 batch,
    /// interleaved so that every short stretch of time holds the same mix.
    pub fn nth(n: u64) -> Class {
        use Class::{Batch as B, Critical as C, Default as D};
        const MIX: [Class; 10] = [C, D, B, D, D, C, D, B, D, B];
        MIX[(n % 10) as usize]
    }

    /// The class's index in [`Class::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }
}

/// What the server can do: `workers` requests at once, each taking `service`.
#[derive(Clone, Copy, Debug)]
pub struct Capacity {
    /// Requests served at once.
    pub workers: u32,
    /// The time one request holds a worker, at the normal speed of the dependency.
    pub service: std::time::Duration,
}

impl Capacity {
    /// Requests per second the server completes when always busy: `C = W / S`.
    pub fn per_second(&self) -> f64 {
        f64::from(self.workers) / self.service.as_secs_f64()
    }
}
