//! The plan of a run: phases back to back, each at a share of the capacity `C`.

use std::time::Duration;

/// One phase of a run.
#[derive(Clone, Copy, Debug)]
pub struct Phase {
    /// Its name in the table.
    pub name: &'static str,
    /// Requests per second sent, as a multiple of the capacity `C`.
    pub load: f64,
    /// How many times the normal service time a request takes (a slower dependency: 2).
    pub slowdown: u32,
    /// Whether its table row gives the time to recover from the phase before it.
    pub recovery: bool,
    /// How long it lasts.
    pub length: Duration,
}

/// The run: steady at 0.5× C, spikes to 3× and 10× C, a recovery at 0.5× C, a dependency
/// twice as slow at 0.8× the normal C (1.6× what the server then completes), and a recovery
/// at 0.5× C. Each phase lasts `length`.
///
/// The recovery from the 10× spike comes right after it, before the slowdown, so that what
/// it measures is the spike's after-effect and not the slower dependency.
pub fn plan(length: Duration) -> Vec<Phase> {
    let phase = |name, load, slowdown, recovery| Phase {
        name,
        load,
        slowdown,
        recovery,
        length,
    };
    vec![
        phase("steady", 0.5, 1, false),
        phase("3x", 3.0, 1, false),
        phase("10x", 10.0, 1, false),
        phase("after-10x", 0.5, 1, true),
        phase("slow-dep", 0.8, 2, false),
        phase("after-slow", 0.5, 1, true),
    ]
}

/// The phase whose row the summary lines quote.
pub const SPIKE: &str = "10x";
/// The phase whose recovery the summary lines quote.
pub const AFTER_SPIKE: &str = "after-10x";
/// The phase whose p99 of admitted requests is the unloaded p99 (measured without a limiter).
pub const STEADY: &str = "steady";
