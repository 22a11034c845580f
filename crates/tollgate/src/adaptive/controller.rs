//! The gradient controller: what the concurrency limit should be, as pure maths of its state,
//! the latencies of finished requests and the time (microseconds since the limit was made).
//!
//! - **The gradient.** Samples are gathered over a window (at least 100 ms, and at least the
//!   baseline); at its end the window's mean latency `rtt` (by Little's law, `n / N` times
//!   the baseline when `n` requests share `N` workers) gives
//!   `gradient = clamp(tolerance × baseline / rtt, 0.5, 1)` and the limit moves a
//!   `smoothing` share of the way to `limit × gradient`, plus a headroom (the `probe`, or
//!   ⌈√limit⌉) when the gradient is 1 (the service is as fast as alone): past the service's
//!   capacity `N`, `n` requests in flight take `n / N` times the baseline, so the requests in
//!   flight settle near `tolerance × N`.
//! - **The baseline** (the latency of a lone request) is measured in a window where the limit
//!   is pinned to its floor (`min`): at start, after [`Controller::restart`], and again every
//!   `remeasure` (±20%, drawn). It is taken from the latencies of the requests admitted in
//!   that window (so while few were in flight): their mean, never above `max_baseline`: a baseline that
//!   grows with the load would let the limit grow with it. A baseline poisoned by fast
//!   answers makes every later window look slow and the limit fall to its floor, until the
//!   next measurement sets it right.
//! - **Overload.** A failed request (a 5xx, an error) and one that took the timeout or longer
//!   are failures, never fast samples. A window with any failure never grows the limit; a
//!   window where they are half of the samples or more (a latency flat at the timeout)
//!   halves it.
//! - **Only real demand grows the limit**: a window grows it only if the requests in flight
//!   reached half of it, or a request was shed or queued meanwhile.
//! - **Back to the limit it held once the overload is over.** A window that is healthy (as
//!   fast as the baseline allows, nothing failed) with no demand above the limit remembers
//!   the limit as the one the service held. After an overload lowered it, the first such
//!   window (the load has fallen back, the latency with it) moves the limit halfway back to
//!   that one, and each next one halfway again: within 10% in four windows, without waiting
//!   for a demand that would only come with the next spike. A window with demand or a slow
//!   mean never does, so a service that really became slower keeps its lower limit.

/// The controller's settings, checked by the builder.
#[derive(Debug, Clone)]
pub(crate) struct Settings {
    pub(crate) min: u32,
    pub(crate) max: u32,
    pub(crate) initial: u32,
    /// A fixed headroom; `None`: ⌈√limit⌉.
    pub(crate) probe: Option<u32>,
    pub(crate) timeout: u64,
    pub(crate) max_baseline: u64,
    pub(crate) tolerance: f64,
    pub(crate) smoothing: f64,
    pub(crate) remeasure: u64,
}

/// The shortest window over which samples are gathered, in microseconds.
const WINDOW: u64 = 100_000;
/// A measurement of the baseline ends with this many samples...
const MEASURE_SAMPLES: usize = 16;
/// ...or after this long with at least one (microseconds)...
const MEASURE_FOR: u64 = 2_000_000;

/// What a finished request says of the service.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Sample {
    /// Answered (its head) this many microseconds after the handler started.
    Answered(u64),
    /// Failed: a 5xx, an error of the service, or abandoned after the timeout.
    Failed,
}

#[derive(Debug)]
enum Phase {
    /// The baseline is being measured: the limit is pinned to its floor, and the samples of
    /// requests admitted meanwhile (`epoch`) are kept.
    Measuring { since: u64, samples: Vec<u64> },
    /// The gradient runs; the baseline is measured again at `next`.
    Steady { next: u64 },
}

/// One window's samples.
#[derive(Debug, Default)]
struct Window {
    since: u64,
    /// The answered requests' latencies, summed, and their count.
    sum: u64,
    answered: u64,
    failed: u64,
    /// The most requests in flight at an admission.
    peak: u32,
    /// A request was shed or queued.
    demand: bool,
}

/// The gradient controller's state.
#[derive(Debug)]
pub(crate) struct Controller {
    s: Settings,
    limit: f64,
    baseline: Option<u64>,
    phase: Phase,
    /// Numbers measurements: a permit carries the epoch it was admitted in.
    epoch: u64,
    window: Window,
    rng: u64,
    /// The limit of the last healthy window without demand: the one the service held before
    /// an overload, which the limit returns to once the overload is over.
    held: f64,
}

impl Controller {
    /// A controller at `initial`, measuring its baseline from `now`.
    pub(crate) fn new(s: Settings, seed: u64, now: u64) -> Self {
        let limit = f64::from(s.initial);
        let mut c = Self {
            s,
            limit,
            baseline: None,
            phase: Phase::Steady { next: 0 },
            epoch: 0,
            window: Window::default(),
            rng: seed | 1,
            held: limit,
        };
        c.measure(now);
        c
    }

    /// The limit requests are admitted under now: the floor while measuring.
    pub(crate) fn limit(&self) -> u32 {
        match self.phase {
            Phase::Measuring { .. } => self.s.min,
            Phase::Steady { .. } => self.learned(),
        }
    }

    /// The limit the gradient has learned (the one that comes back after a measurement).
    pub(crate) fn learned(&self) -> u32 {
        // `limit` stays within [min, max].
        (self.limit.floor() as u32).clamp(self.s.min, self.s.max)
    }

    /// The baseline latency, in microseconds, once measured.
    pub(crate) fn baseline(&self) -> Option<u64> {
        self.baseline
    }

    /// The epoch a request admitted now belongs to.
    pub(crate) fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Whether the baseline is being measured.
    pub(crate) fn is_measuring(&self) -> bool {
        matches!(self.phase, Phase::Measuring { .. })
    }

    /// A request was admitted with `in_flight` requests in flight (itself included).
    pub(crate) fn admitted(&mut self, in_flight: u32) {
        self.window.peak = self.window.peak.max(in_flight);
    }

    /// A request was shed or queued: there is more demand than the limit.
    pub(crate) fn demanded(&mut self) {
        self.window.demand = true;
    }

    /// Learns the baseline again from `now`, as at start.
    pub(crate) fn restart(&mut self, now: u64) {
        self.measure(now);
    }

    fn measure(&mut self, now: u64) {
        self.epoch += 1;
        self.phase = Phase::Measuring {
            since: now,
            samples: Vec::with_capacity(MEASURE_SAMPLES),
        };
    }

    /// What a request admitted in `epoch` says; whether the limit changed.
    pub(crate) fn sample(&mut self, epoch: u64, sample: Sample, now: u64) -> bool {
        let before = self.limit();
        let value = match sample {
            Sample::Answered(rtt) if rtt < self.s.timeout => Some(rtt),
            _ => None,
        };
        match &mut self.phase {
            Phase::Measuring { samples, .. } => {
                // Only requests admitted while the limit was pinned tell the baseline.
                if let (Some(rtt), true) = (value, epoch == self.epoch) {
                    samples.push(rtt);
                }
            }
            Phase::Steady { .. } => {
                let w = &mut self.window;
                match value {
                    Some(rtt) => {
                        w.sum = w.sum.saturating_add(rtt);
                        w.answered += 1;
                    }
                    None => w.failed += 1,
                }
            }
        }
        self.tick(now);
        self.limit() != before
    }

    /// Ends what is due at `now` (a window, a measurement) and starts a measurement that is
    /// due; whether the limit changed.
    pub(crate) fn tick(&mut self, now: u64) -> bool {
        let before = self.limit();
        match &mut self.phase {
            Phase::Measuring { since, samples } => {
                let elapsed = now.saturating_sub(*since);
                let done = samples.len() >= MEASURE_SAMPLES
                    || (!samples.is_empty() && elapsed >= MEASURE_FOR)
                    || (self.baseline.is_some() && elapsed >= MEASURE_FOR.max(self.s.timeout));
                if done {
                    if !samples.is_empty() {
                        let mean = samples.iter().sum::<u64>() / samples.len() as u64;
                        self.baseline = Some(mean.clamp(1, self.s.max_baseline));
                    }
                    let next = now + self.jittered();
                    self.phase = Phase::Steady { next };
                    self.window = Window {
                        since: now,
                        ..Window::default()
                    };
                }
            }
            Phase::Steady { next } => {
                let due = *next;
                let length = WINDOW.max(self.baseline.unwrap_or(0));
                if now.saturating_sub(self.window.since) >= length {
                    self.update();
                    self.window = Window {
                        since: now,
                        ..Window::default()
                    };
                }
                if now >= due {
                    self.measure(now);
                }
            }
        }
        self.limit() != before
    }

    /// The end of a window: the gradient's step.
    fn update(&mut self) {
        let w = &self.window;
        let Some(baseline) = self.baseline.filter(|_| w.answered + w.failed > 0) else {
            return;
        };
        let (min, max) = (f64::from(self.s.min), f64::from(self.s.max));
        if w.failed >= w.answered {
            // Half the requests failed or took the timeout: overload, whatever the latency
            // of the others.
            self.limit = (self.limit / 2.0).clamp(min, max);
            return;
        }
        let rtt = (w.sum / w.answered).max(1);
        let overloaded = w.failed > 0;
        let gradient = (self.s.tolerance * baseline as f64 / rtt as f64).clamp(0.5, 1.0);
        let demanded = w.demand || f64::from(w.peak) * 2.0 >= self.limit.floor();
        if gradient >= 1.0 {
            if overloaded {
                return;
            }
            // Healthy at this limit: the service held it.
            self.held = self.held.max(self.limit);
            if !demanded {
                // Below its limit: back toward the one it held before an overload.
                self.limit = ((self.limit + self.held) / 2.0).clamp(min, max);
                return;
            }
        }
        // Probe only while healthy: a headroom added under a slow mean would hold the
        // limit up (at about 4 requests with ⌈√limit⌉) however slow the service gets.
        let headroom = if overloaded || gradient < 1.0 {
            0.0
        } else {
            match self.s.probe {
                Some(probe) => f64::from(probe),
                None => self.limit.sqrt().ceil(),
            }
        };
        let target = self.limit * gradient + headroom;
        let next = self.limit * (1.0 - self.s.smoothing) + target * self.s.smoothing;
        self.limit = next.clamp(min, max);
    }

    /// `remeasure`, ±20%.
    fn jittered(&mut self) -> u64 {
        // splitmix64: enough to spread replicas' measurements apart.
        self.rng = self.rng.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        let spread = self.s.remeasure / 5;
        self.s.remeasure - spread + z % (2 * spread + 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000;

    fn settings() -> Settings {
        Settings {
            min: 2,
            max: 100,
            initial: 10,
            probe: None,
            timeout: 1_000 * MS,
            max_baseline: 250 * MS,
            tolerance: 1.1,
            smoothing: 0.2,
            remeasure: 60_000 * MS,
        }
    }

    /// A measurement at the floor, then the gradient.
    #[test]
    fn measures_then_follows_the_gradient() {
        let mut c = Controller::new(settings(), 7, 0);
        assert_eq!((c.limit(), c.learned(), c.baseline()), (2, 10, None));
        // A sample of a request admitted before the measurement tells nothing.
        c.sample(0, Sample::Answered(MS), 0);
        for i in 0..15 {
            c.sample(1, Sample::Answered(50 * MS), i * MS);
        }
        assert!(c.is_measuring());
        c.sample(1, Sample::Answered(50 * MS), 20 * MS);
        assert!(!c.is_measuring());
        assert_eq!(c.baseline(), Some(50 * MS));
        assert_eq!(c.limit(), 10);
        // Fast, and in demand: grows by a fifth of ⌈√10⌉ = 4.
        c.admitted(10);
        c.sample(2, Sample::Answered(50 * MS), 120 * MS);
        assert!((c.limit - 10.8).abs() < 1e-9, "{}", c.limit);
        // Twice the baseline: 0.55 × 10.8 (no headroom), a fifth of the way.
        c.admitted(10);
        c.sample(2, Sample::Answered(100 * MS), 220 * MS);
        assert!((c.limit - (10.8 * 0.8 + (10.8 * 0.55) * 0.2)).abs() < 1e-9);
        // Fast and not in demand: halfway back to the limit the service was fast at (10;
        // 10.8 was grown to, never shown fast).
        let fell = c.limit;
        c.sample(2, Sample::Answered(50 * MS), 320 * MS);
        assert!((c.limit - (fell + 10.0) / 2.0).abs() < 1e-9, "{}", c.limit);
        let before = c.limit;
        // Failures (and a request at the timeout): half the window or more halves the limit.
        c.sample(2, Sample::Failed, 400 * MS);
        c.sample(2, Sample::Answered(2_000 * MS), 420 * MS);
        assert_eq!(c.limit, before / 2.0);
    }

    /// After a spike lowered it, the limit is back within 10% of the one it held before in
    /// four healthy windows without demand; a window that is still slow keeps it down.
    #[test]
    fn the_limit_returns_to_the_one_it_held_once_the_overload_is_over() {
        let mut c = Controller::new(settings(), 7, 0);
        for i in 0..16 {
            c.sample(1, Sample::Answered(50 * MS), i * MS);
        }
        assert_eq!(c.limit(), 10);
        let mut t = 100 * MS;
        // Held at 10: fast, not in demand.
        c.sample(2, Sample::Answered(50 * MS), t);
        // A spike: in demand, three times the baseline, window after window.
        for _ in 0..10 {
            t += 100 * MS;
            c.admitted(10);
            c.demanded();
            c.sample(2, Sample::Answered(150 * MS), t);
        }
        let low = c.limit();
        assert!(low <= 5, "{low}");
        // Still slow without demand (a slower dependency): stays down.
        t += 100 * MS;
        c.sample(2, Sample::Answered(150 * MS), t);
        assert!(c.limit() <= low, "{}", c.limit());
        // Fast again, not in demand: 10% of 10 within four windows.
        for _ in 0..4 {
            t += 100 * MS;
            c.sample(2, Sample::Answered(50 * MS), t);
        }
        assert!(c.limit >= 9.0, "{}", c.limit);
    }

    #[test]
    fn the_baseline_has_a_ceiling_and_is_measured_again() {
        let mut c = Controller::new(settings(), 7, 0);
        for _ in 0..16 {
            c.sample(1, Sample::Answered(900 * MS), 0);
        }
        assert_eq!(c.baseline(), Some(250 * MS));
        // Measured again within 48..72 s.
        c.tick(47_999 * MS);
        assert!(!c.is_measuring());
        c.tick(72_001 * MS);
        assert!(c.is_measuring());
        assert_eq!(c.epoch(), 2);
    }
}
