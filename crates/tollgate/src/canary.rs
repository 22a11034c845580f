//! The canary: a synthetic request that must be rejected, checked periodically through the real
//! backend.
//!
//! A fail-open limiter whose backend is gone admits everything and raises no error: it looks
//! healthiest exactly when it has stopped limiting. Counting bypasses
//! (`tollgate_bypass_total`) catches the failures the backend reports; the canary catches
//! the rest, such as a backend that answers but has lost its state, and it keeps probing when
//! no request arrives to be counted.
//!
//! The canary checks a fixed key against a limit of its own, [`CANARY_LIMIT`], with a quota of
//! one per day. The first check consumes that single unit; from then on every check must be
//! denied. `tollgate_canary_ok{backend}` is 1 only when the last check was answered and denied:
//!
//! | the backend | the canary | gauge |
//! |---|---|---|
//! | denies the key | [`CanaryStatus::Denied`] | 1 |
//! | admits it although it was used up within the day (state lost) | [`CanaryStatus::Admitted`] | 0 |
//! | fails, times out, or its circuit breaker is open | [`CanaryStatus::Failed`] | 0 |
//!
//! When the unit is expected back (a day after the canary last saw an admission, and once the
//! reset of the last denial it saw has passed; or at its first check, when it has seen
//! neither), an admission is fine and the canary checks once more at once: that second check
//! must be denied. Several replicas may run canaries against one shared backend: they share
//! the key, and each judges by what it saw. A denial tells when the unit comes back, so a
//! canary that has only ever seen denials (another replica's canary took the unit) still
//! fails when the backend admits the key too early: every replica's canary notices a backend
//! that lost its state, not only the one that took the unit.
//!
//! The canary's checks are shadow checks (`enforce == false`): a local deny cache (such as the
//! Redis backend's) answers only enforced checks, so every canary check reaches the backend.
//! The key begins with a byte that no key extractor produces, and the limit name is reserved,
//! so the canary never shares a counter with requests.

use std::fmt;
use std::sync::Mutex;
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio::time::{Instant, MissedTickBehavior};
use tollgate_engine::{Backend, BackendErrorKind, Check, Limit, Quota, Status, Verdict};

/// The name of the canary's limit. Reserved: do not give it to a limit of your own.
pub const CANARY_LIMIT: &str = "tollgate-canary";

/// The canary's key. IP keys start with a 4 or 6 byte and tenants are ASCII: no extracted key
/// begins with 0xfe.
const CANARY_KEY: &[u8] = b"\xfetollgate-canary";

/// The canary's quota is one unit per this period.
const PERIOD: Duration = Duration::from_secs(86_400);

/// How much earlier than a full period an admission is still taken as the unit coming back:
/// the backend's clock (the Redis server's) and ours may drift apart by a few seconds a day.
const SLACK: Duration = Duration::from_secs(864);

const DEFAULT_TIMEOUT: Duration = Duration::from_secs(5);

/// The name of the gauge the canary sets.
const GAUGE: &str = "tollgate_canary_ok";

/// The gauge of when the last check ended (seconds since the Unix epoch), whatever it found:
/// a canary that stops checking is seen by its age, even while `GAUGE` still reads 1.
const CHECKED: &str = "tollgate_canary_last_check_timestamp_seconds";

/// The gauge of the canary's interval in seconds, for an alert on a check older than two.
const INTERVAL: &str = "tollgate_canary_interval_seconds";

/// What one canary check found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum CanaryStatus {
    /// The backend answered and denied the synthetic key: it is limiting.
    Denied,
    /// The backend admitted the synthetic key although it had been used up within its period:
    /// the backend lost its state (or does not keep it), so it is not limiting.
    Admitted,
    /// The backend failed, did not answer within the canary's timeout, or its circuit breaker
    /// is open.
    Failed(BackendErrorKind),
}

impl CanaryStatus {
    /// Whether the check was answered and denied (the gauge reads 1).
    pub fn is_ok(&self) -> bool {
        matches!(self, Self::Denied)
    }

    /// A fixed word for logs: `denied`, `admitted`, or the failure's reason (`timeout`,
    /// `error`, `circuit_open`, `protocol`, `overloaded`).
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Denied => "denied",
            Self::Admitted => "admitted",
            Self::Failed(BackendErrorKind::Timeout) => "timeout",
            Self::Failed(BackendErrorKind::CircuitOpen) => "circuit_open",
            Self::Failed(BackendErrorKind::Protocol) => "protocol",
            Self::Failed(BackendErrorKind::Overloaded) => "overloaded",
            Self::Failed(_) => "error",
        }
    }
}

impl fmt::Display for CanaryStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A periodic check of a synthetic key that the backend must deny.
///
/// Opt-in: build one for the backend your layer uses, [`spawn`](Canary::spawn) it, and keep the
/// returned [`CanaryHandle`] for as long as the application runs. It sets
/// `tollgate_canary_ok{backend}` to 1 after every check that was answered and denied, and to 0
/// otherwise; after every check, whatever it found, it sets
/// `tollgate_canary_last_check_timestamp_seconds{backend}` to the time (seconds since the Unix
/// epoch) and `tollgate_canary_interval_seconds{backend}` to its interval, so that a canary
/// that stopped checking shows by its age. Its failures never reach requests: it runs in its
/// own task, and only logs and sets its gauges.
///
/// Run one canary per backend and process: canaries on backends of the same
/// [`kind`](Backend::kind) set the same gauge.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use tollgate::{Canary, MemoryBackend};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let backend = MemoryBackend::new(); // in production: the layer's `RedisBackend`
/// let canary = Canary::new(backend.clone(), Duration::from_secs(30));
/// assert!(canary.check_once().await.is_ok()); // the first check consumes, then is denied
///
/// // Checks every 30 s until `_canary` is dropped (keep it alive with the server).
/// let _canary = canary.spawn();
/// # }
/// ```
pub struct Canary<B> {
    backend: B,
    interval: Duration,
    timeout: Duration,
    limit: Limit,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// When this canary last saw the backend admit its key.
    last_admitted: Option<Instant>,
    /// When, by the backend's latest denial, the key's unit comes back: an admission before
    /// then means the backend lost its state, even if this canary never saw the unit taken
    /// (another replica's canary took it).
    back_at: Option<Instant>,
    /// Whether the last check was ok, to log changes rather than every check.
    last_ok: Option<bool>,
}

impl<B: Backend> Canary<B> {
    /// A canary that checks `backend` every `interval` (at least one millisecond).
    ///
    /// Pass a clone of the backend the layer counts in (backends are cheap to clone and clones
    /// share their state), so that the canary probes the very connection requests use.
    pub fn new(backend: B, interval: Duration) -> Self {
        Self {
            backend,
            // `tokio::time::interval` refuses a zero period.
            interval: interval.max(Duration::from_millis(1)),
            timeout: DEFAULT_TIMEOUT,
            limit: canary_limit(),
            state: Mutex::new(State::default()),
        }
    }

    /// How long one check may take before it counts as failed (default 5 s).
    ///
    /// A networked backend has its own, shorter deadline; this one guards against a backend
    /// that never answers.
    #[must_use]
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The backend the canary checks.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// The time between two checks.
    pub fn interval(&self) -> Duration {
        self.interval
    }

    /// Checks the synthetic key once, sets `tollgate_canary_ok{backend}` (and the time of the
    /// check and the interval) and returns what it found.
    ///
    /// [`spawn`](Canary::spawn) calls it every interval; call it yourself from a health
    /// endpoint or a test.
    pub async fn check_once(&self) -> CanaryStatus {
        let status = self.check().await;
        self.report(status);
        status
    }

    /// Starts checking every interval in a task of the current Tokio runtime; the first check
    /// runs at once.
    ///
    /// The task stops when the returned handle is dropped (so keep it: `let _ = canary.spawn()`
    /// would stop it at once) or when the runtime shuts down. A canary that no longer runs sets
    /// its gauge to 0: a dead canary must not look like a healthy backend.
    ///
    /// # Panics
    ///
    /// Outside a Tokio runtime, as [`tokio::spawn`] does.
    pub fn spawn(self) -> CanaryHandle {
        let kind = self.backend.kind();
        let task = tokio::spawn(async move {
            // Dropped when the task is aborted, ends or panics.
            let _stopped = GaugeOnDrop(kind);
            let mut ticks = tokio::time::interval(self.interval);
            // A check that took long (a slow backend) must not be followed by a burst of them.
            ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
            loop {
                ticks.tick().await;
                self.check_once().await;
            }
        });
        CanaryHandle { task }
    }

    /// One check against the backend, bounded by the canary's timeout.
    async fn probe(&self) -> Result<Verdict, BackendErrorKind> {
        let checks = [Check::new(&self.limit, CANARY_KEY)];
        match tokio::time::timeout(self.timeout, self.backend.check(&checks)).await {
            Err(_) => Err(BackendErrorKind::Timeout),
            Ok(Err(e)) => Err(e.kind()),
            Ok(Ok(verdicts)) => verdicts.first().copied().ok_or(BackendErrorKind::Protocol),
        }
    }

    async fn check(&self) -> CanaryStatus {
        // At most two probes: an admission that was due is followed by one that must deny.
        for _ in 0..2 {
            let verdict = match self.probe().await {
                Ok(verdict) => verdict,
                Err(kind) => return CanaryStatus::Failed(kind),
            };
            match verdict.status {
                // A full in-memory backend refuses the canary's key as it refuses every new
                // key: that is limiting too.
                Status::Denied { .. } => {
                    self.note_denied(verdict.reset());
                    return CanaryStatus::Denied;
                }
                Status::AtCapacity { .. } => return CanaryStatus::Denied,
                Status::Allowed => {
                    if !self.admission_was_due() {
                        return CanaryStatus::Admitted;
                    }
                }
                // The one check of the batch was not evaluated: no answer.
                _ => return CanaryStatus::Failed(BackendErrorKind::Protocol),
            }
        }
        // Not reached: the second of two admissions in a row is never due.
        CanaryStatus::Admitted
    }

    /// Notes an admission now; whether the single unit could have come back by now, by this
    /// canary's last admission and by the backend's last denial.
    fn admission_was_due(&self) -> bool {
        let now = Instant::now();
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let due = state
            .last_admitted
            .is_none_or(|last| now.duration_since(last) + SLACK >= PERIOD)
            && state.back_at.is_none_or(|back| now + SLACK >= back);
        state.last_admitted = Some(now);
        state.back_at = None;
        due
    }

    /// Notes a denial whose unit comes back in `reset`.
    fn note_denied(&self, reset: Duration) {
        let back = Instant::now() + reset.min(PERIOD);
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if state.back_at.is_none_or(|known| known < back) {
            state.back_at = Some(back);
        }
    }

    fn report(&self, status: CanaryStatus) {
        let kind = self.backend.kind();
        let ok = status.is_ok();
        // Looked up at every check (once an interval): a recorder installed after the canary
        // was built still gets the gauge.
        metrics::gauge!(GAUGE, "backend" => kind).set(if ok { 1.0 } else { 0.0 });
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
        metrics::gauge!(CHECKED, "backend" => kind).set(now.map_or(0.0, |d| d.as_secs_f64()));
        metrics::gauge!(INTERVAL, "backend" => kind).set(self.interval.as_secs_f64());
        let was_ok = {
            let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
            state.last_ok.replace(ok)
        };
        // Logged when the state changes, not at every check.
        match (was_ok, ok) {
            (Some(false), true) => {
                tracing::info!(
                    backend = kind,
                    "rate-limit canary ok again: the backend denies"
                )
            }
            (Some(true) | None, false) => tracing::warn!(
                backend = kind,
                status = status.as_str(),
                "rate-limit canary failing: the backend did not deny a key it must deny; \
                 requests may not be limited"
            ),
            _ => {}
        }
    }
}

fn canary_limit() -> Limit {
    // Constants, checked by a test: these cannot fail.
    let quota = Quota::new(1, PERIOD).expect("one per day is a valid quota");
    // A shadow check never meets a deny cache (see the module docs).
    Limit::gcra(CANARY_LIMIT, quota)
        .expect("the canary's limit name is valid")
        .shadow()
}

impl<B: Backend> fmt::Debug for Canary<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Canary")
            .field("backend", &self.backend.kind())
            .field("interval", &self.interval)
            .field("timeout", &self.timeout)
            .finish()
    }
}

/// The running canary of [`Canary::spawn`]; dropping it stops the canary.
#[must_use = "the canary stops when its handle is dropped"]
#[derive(Debug)]
pub struct CanaryHandle {
    task: JoinHandle<()>,
}

impl CanaryHandle {
    /// Stops the canary (as dropping the handle does).
    pub fn stop(self) {}

    /// Whether the canary's task has ended (it only does when stopped or if it panicked).
    pub fn is_finished(&self) -> bool {
        self.task.is_finished()
    }
}

impl Drop for CanaryHandle {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Sets the canary gauge to 0 when the canary's task ends.
struct GaugeOnDrop(&'static str);

impl Drop for GaugeOnDrop {
    fn drop(&mut self) {
        metrics::gauge!(GAUGE, "backend" => self.0).set(0.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_canary_limit_is_a_shadow_limit_of_one_a_day() {
        let limit = canary_limit();
        assert_eq!(limit.name(), CANARY_LIMIT);
        assert_eq!(limit.quota().limit(), 1);
        assert_eq!(limit.quota().period(), PERIOD);
        assert!(!Check::new(&limit, CANARY_KEY).enforce);
    }
}
