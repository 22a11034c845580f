//! Shared helpers of the tests: a per-test metrics recorder, a tracing collector, backends
//! that fail on demand (to test how failures are mapped, not limiting), and clients
//! ([`clients`]).

#![allow(dead_code, clippy::unwrap_used, unreachable_pub)]

use std::collections::HashMap;
use std::future::{ready, Ready};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use metrics::{Counter, Gauge, Histogram, Key, KeyName, Metadata, SharedString, Unit};
use metrics_util::registry::{AtomicStorage, Registry};
use tollgate::engine::{Backend, BackendError, BackendErrorKind, Check, Verdicts};
use tollgate::MemoryBackend;

pub mod clients;
pub mod sim;

/// One metric series: its name and its labels, sorted.
pub type Series = (String, Vec<(String, String)>);

/// A recorder that keeps plain values (counters add up, gauges hold their last value), built on
/// `metrics-util`'s registry.
struct Store {
    registry: Registry<Key, AtomicStorage>,
}

impl metrics::Recorder for Store {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}

    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        self.registry
            .get_or_create_counter(key, |c| Counter::from_arc(c.clone()))
    }

    fn register_gauge(&self, key: &Key, _: &Metadata<'_>) -> Gauge {
        self.registry
            .get_or_create_gauge(key, |g| Gauge::from_arc(g.clone()))
    }

    fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
        self.registry
            .get_or_create_histogram(key, |h| Histogram::from_arc(h.clone()))
    }
}

fn series_of(key: &Key) -> Series {
    let mut labels: Vec<(String, String)> = key
        .labels()
        .map(|l| (l.key().to_owned(), l.value().to_owned()))
        .collect();
    labels.sort();
    (key.name().to_owned(), labels)
}

/// A recorder installed for the current thread only, so that tests running in parallel each
/// see their own figures. Tests run on Tokio's current-thread runtime, so every task they
/// spawn records here too.
pub struct Recorder {
    store: &'static Store,
    /// Counter values at the last snapshot.
    seen: Mutex<HashMap<Series, u64>>,
    _guard: metrics::LocalRecorderGuard<'static>,
}

impl Recorder {
    pub fn install() -> Self {
        // Leaked: the guard borrows the recorder for as long as the test runs.
        let store: &'static Store = Box::leak(Box::new(Store {
            registry: Registry::atomic(),
        }));
        Self {
            store,
            seen: Mutex::new(HashMap::new()),
            _guard: metrics::set_default_local_recorder(store),
        }
    }

    /// Counters: their increase since the last snapshot. Gauges: their value now. Histograms:
    /// how many samples they hold.
    pub fn snapshot(&self) -> Snapshot {
        let mut seen = self.seen.lock().unwrap();
        let mut counters = HashMap::new();
        for (key, value) in self.store.registry.get_counter_handles() {
            let series = series_of(&key);
            let now = value.load(Ordering::SeqCst);
            let before = seen.insert(series.clone(), now).unwrap_or(0);
            counters.insert(series, now - before);
        }
        let gauges = self
            .store
            .registry
            .get_gauge_handles()
            .into_iter()
            .map(|(key, v)| (series_of(&key), f64::from_bits(v.load(Ordering::SeqCst))))
            .collect();
        let histograms = self
            .store
            .registry
            .get_histogram_handles()
            .into_iter()
            .map(|(key, h)| (series_of(&key), h.data().len()))
            .collect();
        Snapshot {
            counters,
            gauges,
            histograms,
        }
    }
}

pub struct Snapshot {
    pub counters: HashMap<Series, u64>,
    pub gauges: HashMap<Series, f64>,
    pub histograms: HashMap<Series, usize>,
}

fn series(name: &str, labels: &[(&str, &str)]) -> Series {
    let mut labels: Vec<(String, String)> = labels
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    labels.sort();
    (name.to_owned(), labels)
}

impl Snapshot {
    /// A counter's increase since the last snapshot; `None` if it was never registered.
    pub fn counter(&self, name: &str, labels: &[(&str, &str)]) -> Option<u64> {
        self.counters.get(&series(name, labels)).copied()
    }

    /// `tollgate_decisions_total{limit, outcome}`, 0 if never registered.
    pub fn decisions(&self, limit: &str, outcome: &str) -> u64 {
        self.counter(
            "tollgate_decisions_total",
            &[("limit", limit), ("outcome", outcome)],
        )
        .unwrap_or(0)
    }

    /// `tollgate_bypass_total{limit, reason}`, 0 if never registered.
    pub fn bypasses(&self, limit: &str, reason: &str) -> u64 {
        self.counter(
            "tollgate_bypass_total",
            &[("limit", limit), ("reason", reason)],
        )
        .unwrap_or(0)
    }

    /// The sum of every counter called `name`.
    pub fn total(&self, name: &str) -> u64 {
        self.counters
            .iter()
            .filter(|((n, _), _)| n == name)
            .map(|(_, v)| v)
            .sum()
    }

    pub fn gauge(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        self.gauges.get(&series(name, labels)).copied()
    }

    /// Every label value of every series.
    pub fn label_values(&self) -> Vec<String> {
        self.counters
            .keys()
            .chain(self.gauges.keys())
            .chain(self.histograms.keys())
            .flat_map(|(_, labels)| labels.iter().map(|(_, v)| v.clone()))
            .collect()
    }
}

/// A backend that counts in memory and can be made to fail, or to forget everything.
#[derive(Clone)]
pub struct Flaky {
    memory: Arc<Mutex<MemoryBackend>>,
    /// 0: answers; otherwise fails with the kind `1 + index` in [`KINDS`].
    failing: Arc<AtomicU64>,
    calls: Arc<AtomicU64>,
}

pub const KINDS: [BackendErrorKind; 5] = [
    BackendErrorKind::Timeout,
    BackendErrorKind::Unavailable,
    BackendErrorKind::CircuitOpen,
    BackendErrorKind::Protocol,
    BackendErrorKind::Overloaded,
];

impl Flaky {
    pub fn new() -> Self {
        Self {
            memory: Arc::new(Mutex::new(MemoryBackend::new())),
            failing: Arc::new(AtomicU64::new(0)),
            calls: Arc::new(AtomicU64::new(0)),
        }
    }

    /// Fails every call with `kind` from now on, or answers again with `None`.
    pub fn fail(&self, kind: Option<BackendErrorKind>) {
        let code = kind.map_or(0, |k| {
            1 + KINDS.iter().position(|x| *x == k).unwrap() as u64
        });
        self.failing.store(code, Ordering::SeqCst);
    }

    /// How many batches it was asked to check.
    pub fn calls(&self) -> u64 {
        self.calls.load(Ordering::SeqCst)
    }

    /// Loses every counter, as a Redis restarted without persistence would.
    pub fn forget(&self) {
        *self.memory.lock().unwrap() = MemoryBackend::new();
    }
}

impl Backend for Flaky {
    type Future = Ready<Result<Verdicts, BackendError>>;

    fn check(&self, checks: &[Check<'_>]) -> Self::Future {
        self.calls.fetch_add(1, Ordering::SeqCst);
        match self.failing.load(Ordering::SeqCst) {
            0 => ready(self.memory.lock().unwrap().check_now(checks)),
            code => ready(Err(BackendError::new(KINDS[code as usize - 1], "injected"))),
        }
    }

    fn kind(&self) -> &'static str {
        "flaky"
    }
}

/// What a [`Collector`] saw: span fields by span name, and events.
#[derive(Default, Debug)]
pub struct Seen {
    /// One entry per span, with every field recorded on it.
    pub spans: Vec<(String, HashMap<String, String>)>,
    /// Every event, with its level and fields (`message` included).
    pub events: Vec<(tracing::Level, HashMap<String, String>)>,
}

/// A minimal tracing subscriber that records span fields and events, at every level.
#[derive(Clone, Default)]
pub struct Collector {
    pub seen: Arc<Mutex<Seen>>,
}

struct Fields<'a>(&'a mut HashMap<String, String>);

impl tracing::field::Visit for Fields<'_> {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        self.0.insert(field.name().to_owned(), format!("{value:?}"));
    }

    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        self.0.insert(field.name().to_owned(), value.to_owned());
    }
}

impl tracing::Subscriber for Collector {
    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        true
    }

    fn new_span(&self, attrs: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        let mut fields = HashMap::new();
        attrs.record(&mut Fields(&mut fields));
        let mut seen = self.seen.lock().unwrap();
        seen.spans
            .push((attrs.metadata().name().to_owned(), fields));
        tracing::span::Id::from_u64(seen.spans.len() as u64)
    }

    fn record(&self, span: &tracing::span::Id, values: &tracing::span::Record<'_>) {
        let mut seen = self.seen.lock().unwrap();
        let i = span.into_u64() as usize - 1;
        values.record(&mut Fields(&mut seen.spans[i].1));
    }

    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}

    fn event(&self, event: &tracing::Event<'_>) {
        let mut fields = HashMap::new();
        event.record(&mut Fields(&mut fields));
        let level = *event.metadata().level();
        self.seen.lock().unwrap().events.push((level, fields));
    }

    fn enter(&self, _: &tracing::span::Id) {}

    fn exit(&self, _: &tracing::span::Id) {}
}

/// A layered service's response, as the tests read it.
pub type Res = http::Response<tollgate::ResponseBody<http_body_util::Full<bytes::Bytes>>>;

/// When each request reached the handler, by its `x-id`, measured from a test's start.
pub type Started = Arc<Mutex<Vec<(usize, std::time::Duration)>>>;

/// A service behind `layer` whose handler records when each request (by its `x-id` header)
/// reached it, from `start`, then holds it for `hold` before it answers `ok`.
pub fn recording<B: Backend>(
    layer: &tollgate::RateLimitLayer<B>,
    start: tokio::time::Instant,
    started: Started,
    hold: std::time::Duration,
) -> impl tower::Service<
    http::Request<http_body_util::Full<bytes::Bytes>>,
    Response = Res,
    Error = std::convert::Infallible,
    Future: Send,
> + Clone {
    use tower::Layer;
    layer.layer(tower::service_fn(
        move |req: http::Request<http_body_util::Full<bytes::Bytes>>| {
            let started = Arc::clone(&started);
            async move {
                let id = req.headers()["x-id"].to_str().unwrap().parse().unwrap();
                started.lock().unwrap().push((id, start.elapsed()));
                if !hold.is_zero() {
                    tokio::time::sleep(hold).await;
                }
                Ok::<_, std::convert::Infallible>(http::Response::new(http_body_util::Full::new(
                    bytes::Bytes::from_static(b"ok"),
                )))
            }
        },
    ))
}
