//! The in-memory layers whose cost per feature `docs/benchmarks.md` tabulates, shared by the
//! bench server (`--mode tollgate-mem-allow+penalty+slots`) and the allocation count
//! (`allocs`), so that both measure the same configuration.
//!
//! A layer is a base path, one GCRA limit per client IP that either admits every request
//! ([`Path::Allow`]) or refuses all but the first of a day ([`Path::Deny`]), plus features.

use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use tollgate::cost::Metered;
use tollgate::key::ClientIp;
use tollgate::{Allowlist, Denylist, Limit, Quota, RateLimitLayer};
use tollgate_engine::Penalty;

/// The base path of a measured layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Path {
    /// A quota nothing reaches: every request admitted.
    Allow,
    /// One a day: every request but the first refused.
    Deny,
}

/// A feature added to the base layer. Each is configured so that it does its work on every
/// request and changes no answer of the base path (a list matches no bench client, a plan is
/// not the request's, a cost is the default's 1), except a penalty box, which blocks the
/// refused client as it is made to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Feature {
    /// `headers_on_allowed(false)`: no `RateLimit` fields on admitted responses.
    NoHeaders,
    /// `decision_on_allowed(false)`: no `Decision` in admitted responses.
    NoDecision,
    /// A metrics recorder ([`Counting`]) installed: the layer's counters count (the layer is
    /// the same; whoever runs it installs the recorder).
    Metrics,
    /// `near_limit_percent(100)`: every admission counts as near the limit.
    NearLimit,
    /// `top_refused_k(0)`: refusals are not summarised for the reports of who is refused.
    NoTopRefused,
    /// A penalty box: a block of an hour after 5 refusals within a minute.
    Penalty,
    /// A denylist of a network no bench client is in.
    Denylist,
    /// An allowlist of a network no bench client is in.
    Allowlist,
    /// The limit has a plan ("pro", half the quota) no request has.
    Plans,
    /// The limit is metered: the cost of each request comes from a function (always 1).
    Costs,
    /// The limit waits up to a second instead of refusing (nothing waits in `Allow`).
    Delay,
    /// A concurrency limit per IP beside it, with room for every request.
    Slots,
    /// The same concurrency limit, queued up to a second (nothing waits).
    Queue,
}

impl Feature {
    /// Every feature, in the order of the table in `docs/benchmarks.md`.
    pub const ALL: [Feature; 13] = [
        Feature::NoHeaders,
        Feature::NoDecision,
        Feature::Metrics,
        Feature::NearLimit,
        Feature::NoTopRefused,
        Feature::Penalty,
        Feature::Denylist,
        Feature::Allowlist,
        Feature::Plans,
        Feature::Costs,
        Feature::Delay,
        Feature::Slots,
        Feature::Queue,
    ];

    /// Its name in a mode (`tollgate-mem-allow+NAME`).
    pub fn name(self) -> &'static str {
        match self {
            Feature::NoHeaders => "no-headers",
            Feature::NoDecision => "no-decision",
            Feature::Metrics => "metrics",
            Feature::NearLimit => "near-limit",
            Feature::NoTopRefused => "no-top-refused",
            Feature::Penalty => "penalty",
            Feature::Denylist => "denylist",
            Feature::Allowlist => "allowlist",
            Feature::Plans => "plans",
            Feature::Costs => "costs",
            Feature::Delay => "delay",
            Feature::Slots => "slots",
            Feature::Queue => "queue",
        }
    }

    /// The feature named `name`.
    pub fn parse(name: &str) -> Option<Feature> {
        Feature::ALL.into_iter().find(|f| f.name() == name)
    }
}

/// A mode `tollgate-mem-allow` or `tollgate-mem-deny`, each followed by `+FEATURE`s; `None`
/// for any other mode.
pub fn parse_mode(mode: &str) -> Option<(Path, Vec<Feature>)> {
    let mut parts = mode.split('+');
    let path = match parts.next()? {
        "tollgate-mem-allow" => Path::Allow,
        "tollgate-mem-deny" => Path::Deny,
        _ => return None,
    };
    let features = parts.map(Feature::parse).collect::<Option<Vec<_>>>()?;
    Some((path, features))
}

/// The in-memory layer of `path` with `features`.
///
/// # Panics
///
/// Never for the features above: their configurations are valid.
#[allow(clippy::unwrap_used)] // fixed, valid configurations
pub fn memory_layer(path: Path, features: &[Feature]) -> RateLimitLayer {
    let on = |f| features.contains(&f);
    let quota = match path {
        Path::Allow => Quota::per_second(1_000_000)
            .unwrap()
            .with_burst(u32::MAX)
            .unwrap(),
        Path::Deny => Quota::per_day(1).unwrap(),
    };
    let mut limit = Limit::gcra("per-ip", quota).unwrap();
    if on(Feature::Penalty) {
        let penalty = Penalty::after(5)
            .within(Duration::from_secs(60))
            .block_for(Duration::from_secs(3_600));
        limit = limit.penalty(penalty).unwrap();
    }
    if on(Feature::Plans) {
        let pro = Quota::per_second(500_000)
            .unwrap()
            .with_burst(u32::MAX)
            .unwrap();
        limit = limit.plan("pro", pro).unwrap();
    }
    if on(Feature::Delay) {
        limit = limit.delay_up_to(Duration::from_secs(1)).unwrap();
    }
    let mut builder = RateLimitLayer::builder();
    builder = if on(Feature::Costs) {
        builder.metered(limit, ClientIp::peer(), Metered::new().cost_from(|_| Ok(1)))
    } else {
        builder.limit(limit, ClientIp::peer())
    };
    if on(Feature::Slots) || on(Feature::Queue) {
        let mut slots = Limit::concurrency("in-flight", 1_000).unwrap();
        if on(Feature::Queue) {
            slots = slots.queue_up_to(Duration::from_secs(1), 64).unwrap();
        }
        builder = builder.limit(slots, ClientIp::peer());
    }
    let elsewhere = || ["192.0.2.0/24".parse().unwrap()];
    if on(Feature::Denylist) {
        builder = builder.denylist(Denylist::new().networks(ClientIp::peer(), elsewhere()));
    }
    if on(Feature::Allowlist) {
        builder = builder.allowlist(Allowlist::new().networks(ClientIp::peer(), elsewhere()));
    }
    if on(Feature::NearLimit) {
        builder = builder.near_limit_percent(100);
    }
    if on(Feature::NoTopRefused) {
        builder = builder.top_refused_k(0);
    }
    builder
        .headers_on_allowed(!on(Feature::NoHeaders))
        .decision_on_allowed(!on(Feature::NoDecision))
        .build()
        .unwrap()
}

/// A metrics recorder whose counters and gauges are atomics, made once per metric (the layer
/// keeps its handles): what an exporter's registry costs a request, without the exporter.
#[derive(Debug, Default)]
pub struct Counting;

impl metrics::Recorder for Counting {
    fn describe_counter(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn describe_gauge(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn describe_histogram(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn register_counter(&self, _: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Counter {
        metrics::Counter::from_arc(Arc::new(AtomicU64::new(0)))
    }
    fn register_gauge(&self, _: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Gauge {
        metrics::Gauge::from_arc(Arc::new(AtomicU64::new(0)))
    }
    fn register_histogram(
        &self,
        _: &metrics::Key,
        _: &metrics::Metadata<'_>,
    ) -> metrics::Histogram {
        metrics::Histogram::noop()
    }
}

/// tower_governor per client IP (the bench server's `governor-*` modes, and `allocs`' rows):
/// a token every `period`, `burst` at once.
///
/// # Panics
///
/// If tower_governor refuses the configuration (a zero period or burst).
#[allow(clippy::unwrap_used)]
pub fn governor(
    period: Duration,
    burst: u32,
) -> tower_governor::GovernorLayer<
    tower_governor::key_extractor::PeerIpKeyExtractor,
    governor::middleware::NoOpMiddleware<governor::clock::QuantaInstant>,
    axum::body::Body,
> {
    let config = tower_governor::governor::GovernorConfigBuilder::default()
        .period(period)
        .burst_size(burst)
        .finish()
        .unwrap();
    tower_governor::GovernorLayer::new(config)
}
