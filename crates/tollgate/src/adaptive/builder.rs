//! [`Adaptive`]: an adaptive concurrency limit's settings, checked when the layer is built.

use std::sync::Arc;
use std::time::Duration;

use http::HeaderName;
use tollgate_engine::{ConfigError, MAX_NAME_LEN};

use super::controller::{Controller, Settings};
use super::gate::{Gate, GateSettings};

/// The most a limit's ceiling may be.
const MAX_CEILING: u32 = 1_000_000;

/// An adaptive concurrency limit: how many requests this process lets run at once, learned
/// from their latency, with priority classes, fairness between keys and a short queue.
///
/// Add it to a layer with
/// [`RateLimitLayerBuilder::adaptive`](crate::RateLimitLayerBuilder::adaptive); the settings
/// are checked when the layer is built. See the [module docs](crate::adaptive).
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use tollgate::key::ClientIp;
/// use tollgate::{Adaptive, RateLimitLayer};
///
/// # fn main() -> Result<(), tollgate::engine::ConfigError> {
/// let layer = RateLimitLayer::builder()
///     .adaptive(
///         Adaptive::gradient()
///             .name("api")
///             .min(4)
///             .initial(20)
///             .max(500)
///             .timeout(Duration::from_secs(2))
///             .queue(50, Duration::from_millis(100)),
///         ClientIp::peer(),
///     )
///     .build()?;
/// assert_eq!(layer.adaptive().map(|a| a.name().to_owned()).as_deref(), Some("api"));
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Adaptive {
    name: String,
    min: u32,
    max: u32,
    initial: u32,
    probe: Option<u32>,
    timeout: Duration,
    max_baseline: Option<Duration>,
    tolerance: f64,
    smoothing: f64,
    remeasure: Duration,
    reserve: u8,
    queue: Option<(u16, Duration)>,
    monitor_only: bool,
    header: Option<HeaderName>,
    retry_after: Duration,
}

impl Adaptive {
    /// A limit of the gradient kind (see the [module docs](crate::adaptive)), named
    /// `adaptive`, from 4 to 1,000 requests, starting at 20, a timeout of 5 s, a reserve of
    /// 20% for critical requests, no queue.
    pub fn gradient() -> Self {
        Self {
            name: "adaptive".to_owned(),
            min: 4,
            max: 1_000,
            initial: 20,
            probe: None,
            timeout: Duration::from_secs(5),
            max_baseline: None,
            tolerance: 1.1,
            smoothing: 0.2,
            remeasure: Duration::from_secs(60),
            reserve: 20,
            queue: None,
            monitor_only: false,
            header: None,
            retry_after: Duration::from_secs(1),
        }
    }

    /// Its name, in metrics and refusals (`[A-Za-z0-9_.-]`, at most 64 bytes).
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// The floor: the limit never falls below it, and it is the limit while the baseline
    /// latency is measured (default 4). At least 1.
    pub fn min(mut self, min: u32) -> Self {
        self.min = min;
        self
    }

    /// The ceiling: the limit never grows above it (default 1,000, at most 1,000,000).
    pub fn max(mut self, max: u32) -> Self {
        self.max = max;
        self
    }

    /// The limit at start, once the baseline is measured (default 20), between the floor and
    /// the ceiling.
    pub fn initial(mut self, initial: u32) -> Self {
        self.initial = initial;
        self
    }

    /// The headroom added at each step, in requests, to probe for more capacity (default:
    /// ⌈√limit⌉). Apart from the floor: a large probe finds capacity faster and queues more.
    pub fn probe(mut self, probe: u32) -> Self {
        self.probe = Some(probe);
        self
    }

    /// A request that takes this long or longer, from its handler's start to its response
    /// head, is overload, as a failure is (default 5 s).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The ceiling on the baseline latency (default: a quarter of the timeout): a service
    /// that is slower than this even alone is not "healthy", and a baseline that crept up
    /// would let the limit creep up with it.
    pub fn max_baseline(mut self, max: Duration) -> Self {
        self.max_baseline = Some(max);
        self
    }

    /// How much slower than the baseline the mean latency may be before the limit falls
    /// (default 1.1: 10%), from 1 to 10.
    pub fn tolerance(mut self, tolerance: f64) -> Self {
        self.tolerance = tolerance;
        self
    }

    /// The share of the way to its target the limit moves at each step (default 0.2), above
    /// 0 and at most 1.
    pub fn smoothing(mut self, smoothing: f64) -> Self {
        self.smoothing = smoothing;
        self
    }

    /// How often the baseline is measured again, ±20% (default 60 s, at least 1 s).
    pub fn remeasure_every(mut self, every: Duration) -> Self {
        self.remeasure = every;
        self
    }

    /// The share of the limit, in percent, that only [`Priority::Critical`](super::Priority::Critical)
    /// requests may take (default 20, at most 100).
    pub fn critical_reserve_percent(mut self, percent: u8) -> Self {
        self.reserve = percent;
        self
    }

    /// A short queue: when the limit is full, up to `percent` of the current limit (at
    /// least one request) wait, each for at most `max_wait`, the highest levels served first;
    /// a request of a higher level takes the place of the last one of a lower level when the
    /// queue is full. Without it (the default), such a request is shed at once.
    pub fn queue(mut self, percent: u16, max_wait: Duration) -> Self {
        self.queue = Some((percent, max_wait));
        self
    }

    /// Computes and reports (metrics, the decision's part), but sheds nothing (default
    /// `false`).
    pub fn monitor_only(mut self, on: bool) -> Self {
        self.monitor_only = on;
        self
    }

    /// Reads a request's [`Priority`](super::Priority) from the header `name` (values
    /// `critical`, `default`, `batch`, or a level `0` to `99`) when the request carries no
    /// `Priority` extension. Only name a header that clients cannot set themselves (one that
    /// a gateway in front writes), or any client can make itself critical. By default no
    /// header is read.
    pub fn priority_header(mut self, name: HeaderName) -> Self {
        self.header = Some(name);
        self
    }

    /// The `Retry-After` of a shed request (default 1 s).
    pub fn retry_after(mut self, after: Duration) -> Self {
        self.retry_after = after;
        self
    }

    /// The running limit these settings make.
    pub(crate) fn build(&self) -> Result<Gate, ConfigError> {
        self.check()?;
        let micros = |d: Duration| u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        let max_baseline = self.max_baseline.unwrap_or(self.timeout / 4);
        let settings = Settings {
            min: self.min,
            max: self.max,
            initial: self.initial,
            probe: self.probe,
            timeout: micros(self.timeout),
            max_baseline: micros(max_baseline).max(1),
            tolerance: self.tolerance,
            smoothing: self.smoothing,
            remeasure: micros(self.remeasure),
        };
        let gate = GateSettings {
            reserve_percent: self.reserve,
            queue: self.queue,
            monitor_only: self.monitor_only,
            retry_after: self.retry_after,
            header: self.header.clone(),
            timeout: self.timeout,
        };
        let seed = {
            use std::hash::BuildHasher;
            std::collections::hash_map::RandomState::new().hash_one(&self.name)
        };
        Ok(Gate::new(Arc::from(self.name.as_str()), gate, |now| {
            Controller::new(settings, seed, now)
        }))
    }

    fn check(&self) -> Result<(), ConfigError> {
        let fail = |why: String| {
            Err(ConfigError::InvalidAdaptive(format!(
                "{:?}: {why}",
                self.name
            )))
        };
        let valid_name = !self.name.is_empty()
            && self.name.len() <= MAX_NAME_LEN
            && self
                .name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'));
        if !valid_name {
            return fail(format!(
                "a name is 1 to {MAX_NAME_LEN} bytes of letters, digits, '_', '.' and '-'"
            ));
        }
        let (min, initial, max) = (self.min, self.initial, self.max);
        if min == 0 {
            return fail("min must be at least 1".to_owned());
        }
        if !(min <= initial && initial <= max) {
            return fail(format!(
                "min ({min}) <= initial ({initial}) <= max ({max}) does not hold"
            ));
        }
        if max > MAX_CEILING {
            return fail(format!("max ({max}) is above {MAX_CEILING}"));
        }
        if self.probe.is_some_and(|p| p > max) {
            return fail("the probe is above max".to_owned());
        }
        if self.timeout.is_zero() {
            return fail("the timeout must be above 0".to_owned());
        }
        if let Some(b) = self.max_baseline {
            if b.is_zero() || b > self.timeout {
                return fail("max_baseline must be above 0 and at most the timeout".to_owned());
            }
        }
        if !(1.0..=10.0).contains(&self.tolerance) {
            return fail("the tolerance must be from 1 to 10".to_owned());
        }
        if !(self.smoothing > 0.0 && self.smoothing <= 1.0) {
            return fail("the smoothing must be above 0 and at most 1".to_owned());
        }
        if self.remeasure < Duration::from_secs(1) {
            return fail("the baseline is measured again at most once a second".to_owned());
        }
        if self.reserve > 100 {
            return fail(format!("a reserve of {} percent", self.reserve));
        }
        if let Some((percent, wait)) = self.queue {
            if percent == 0 || wait.is_zero() {
                return fail("a queue needs a size and a wait above 0".to_owned());
            }
        }
        if self.retry_after.is_zero() {
            return fail("retry_after must be above 0".to_owned());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn error(a: Adaptive) -> String {
        match a.build() {
            Err(e) => e.to_string(),
            Ok(_) => panic!("built"),
        }
    }

    #[test]
    fn bad_settings_are_refused_with_their_reason() {
        let a = Adaptive::gradient;
        assert_eq!(
            error(a().min(10).initial(5)),
            "invalid adaptive concurrency limit: \"adaptive\": min (10) <= initial (5) <= max (1000) does not hold"
        );
        assert!(error(a().min(0)).contains("min must be at least 1"));
        assert!(error(a().max(10)).contains("initial (20) <= max (10)"));
        assert!(error(a().name("a b")).contains("a name is"));
        assert!(error(a().critical_reserve_percent(101)).contains("reserve of 101"));
        assert!(error(a().tolerance(0.5)).contains("tolerance"));
        assert!(error(a().smoothing(0.0)).contains("smoothing"));
        assert!(error(a().queue(0, Duration::from_millis(5))).contains("queue"));
        assert!(error(a().timeout(Duration::ZERO)).contains("timeout"));
        assert!(error(a().max_baseline(Duration::from_secs(6))).contains("max_baseline"));
        assert!(error(a().remeasure_every(Duration::from_millis(10))).contains("once a second"));
        assert!(a().min(1).initial(1).max(1).build().is_ok());
    }
}
