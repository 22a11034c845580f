//! Timed sequences: shapes that only time shows, on per-second quotas, judged by the
//! invariants alone (the model does not follow time on Redis).
//!
//! Some seeds draw one after their sequence: requests sent on tasks of their own at set
//! times, in memory on Tokio's paused clock (the backend reads it too), on Redis in real time.
//! The shapes: a GCRA limit with a delay, refunds on `500` and waiters dropped
//! (`OnDrop::Refund`), alone, or stacked on a fixed window (a layer that must be refused at
//! build, `ConfigError::DelayWithWindow`); a concurrency limit with a plan of another quota,
//! its responses held past that plan's period; a concurrency limit metered by a cost that may
//! be 0 (refused with 400, nothing counted); a client of one request at a time alternating between two replicas
//! on a concurrency limit of 1; a static denylist of client addresses behind a trusted proxy
//! that a client pads its `X-Forwarded-For` against.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::http::{HeaderName, Request, StatusCode};
use axum::response::Response;
use axum::routing::get;
use axum::Router;
use tollgate::cost::{Metered, OnDrop};
use tollgate::key::{Cidr, ClientIp, Tenant, TrustedProxies};
use tollgate::{Decision, DenyReason, Denylist, Limit, Limits, Plan, Quota, RateLimitLayer};
use tollgate_engine::{Backend, Clock, ConfigError, MemoryBackend, Micros, MissingKeyPolicy};
use tower::ServiceExt;

use super::flight::InFlight;
use super::invariants::{self, Frame, Sent, Spec, Trace};
use super::{handler, refused_for, Kind, Rng, Servers, KEYS};

const SECOND: Micros = 1_000_000;
/// The client behind the trusted proxy, on the denylist.
const CLIENT: &str = "203.0.113.9";
const PROXY: &str = "10.0.0.1:4000";

/// Tokio's clock, paused, as the in-memory backend's: the layer's waits and the quotas run
/// on one time.
#[derive(Clone)]
struct TokioClock {
    base: Micros,
    start: tokio::time::Instant,
}

impl Clock for TokioClock {
    fn now(&self) -> Micros {
        self.base + self.start.elapsed().as_micros() as Micros
    }
}

#[derive(Clone, Copy, Debug)]
enum Scenario {
    /// GCRA `rate` per second with `burst` and a delay (ms), refunds on 500 and dropped
    /// waiters; a fixed window of `window` per second stacked on it (refused at build), or
    /// not.
    Delay {
        rate: u32,
        burst: u32,
        delay: u64,
        window: Option<u32>,
    },
    /// GCRA 10 per second, burst 1, a delay of 500 ms, stacked on a fixed window of 3 per
    /// second: refused at build.
    DelayWindow,
    /// A concurrency limit of 2 with a `pro` plan of 3 per second (slots that live 1 s).
    SlotPlans,
    /// A concurrency limit of 1 metered by the request's cost, 0 (refused with 400, nothing
    /// counted) or 1.
    CostZero,
    /// One client, one request at a time, alternating between two replicas, on a
    /// concurrency limit of 1.
    Alternating,
    /// A static denylist of the client's network behind a trusted proxy, and a rate limit
    /// that skips a request without a key, or refuses it.
    Forwarded { skip: bool },
}

/// One request of a timed sequence.
#[derive(Clone, Copy, Debug)]
struct Shot {
    at_ms: u64,
    replica: usize,
    key: &'static str,
    cost: u32,
    fail: bool,
    pro: bool,
    hold_ms: u64,
    drop_after_ms: Option<u64>,
    padded: bool,
}

impl Shot {
    fn at(at_ms: u64, key: &'static str) -> Self {
        Self {
            at_ms,
            replica: 0,
            key,
            cost: 1,
            fail: false,
            pro: false,
            hold_ms: 0,
            drop_after_ms: None,
            padded: false,
        }
    }
}

/// Whether `seed` draws a timed sequence, and which.
fn draw(seed: u64) -> Option<(Scenario, Vec<Shot>)> {
    let mut rng = Rng(seed ^ 0x7157_ed5e_ed00_0001);
    // In real time on Redis they cost seconds: one seed in ten.
    if !rng.chance(10) {
        return None;
    }
    let scenario = match rng.below(100) {
        32..=39 => Scenario::DelayWindow,
        0..=31 => {
            let rate = rng.pick(&[5, 10, 20]);
            let burst = 1 + rng.below(3) as u32;
            let interval = 1_000 / u64::from(rate);
            Scenario::Delay {
                rate,
                burst,
                delay: rng.pick(&[2 * interval, 4 * interval, 400]),
                // As tight as the burst, or a little looser: a window that a delayed
                // request was counted in ends while it waits.
                window: rng.chance(50).then(|| rng.pick(&[burst, burst + 1])),
            }
        }
        40..=51 => Scenario::SlotPlans,
        52..=67 => Scenario::CostZero,
        68..=87 => Scenario::Alternating,
        _ => Scenario::Forwarded {
            skip: rng.chance(50),
        },
    };
    let shots = match scenario {
        Scenario::Delay { delay, .. } => {
            let mut shots = Vec::new();
            while shots.len() < 14 {
                let at_ms = rng.below(700);
                for _ in 0..1 + rng.below(4) {
                    let mut s = Shot::at(at_ms, rng.pick(&KEYS[..2]));
                    s.replica = rng.below(2) as usize;
                    s.cost = 1 + rng.below(2) as u32;
                    s.fail = rng.chance(25);
                    s.hold_ms = rng.below(30);
                    s.drop_after_ms = rng.chance(30).then(|| 1 + rng.below(delay));
                    shots.push(s);
                }
            }
            shots
        }
        // Refused at build: nothing is sent.
        Scenario::DelayWindow => Vec::new(),
        // Held past the plan's period (1 s), as long as slots live by it.
        Scenario::SlotPlans => (0..6)
            .map(|i| {
                let mut s = Shot::at(i * 220, KEYS[0]);
                s.replica = (i % 2) as usize;
                s.pro = true;
                s.hold_ms = 1_150;
                s
            })
            .collect(),
        Scenario::CostZero => {
            let plan = [
                (0, 1, 400),
                (50, 0, 50),
                (150, 1, 100),
                (200, 0, 100),
                (320, 1, 50),
                // Alone, once every other request ended: admitted, unless a request of cost
                // 0 was counted as holding the slot.
                (700, 1, 0),
            ];
            plan.iter()
                .map(|&(at, cost, hold)| {
                    let mut s = Shot::at(at, KEYS[0]);
                    s.replica = rng.below(2) as usize;
                    (s.cost, s.hold_ms) = (cost, hold);
                    s
                })
                .collect()
        }
        // Sent one after another by `alternate`.
        Scenario::Alternating => Vec::new(),
        Scenario::Forwarded { .. } => (0..6)
            .map(|i| {
                let mut s = Shot::at(i * 10, CLIENT);
                s.padded = i % 2 == 1;
                s
            })
            .collect(),
    };
    Some((scenario, shots))
}

/// The delay and window `Scenario::DelayWindow` stands for.
const DELAY_WINDOW: Scenario = Scenario::Delay {
    rate: 10,
    burst: 1,
    delay: 500,
    window: Some(3),
};

fn limits(scenario: Scenario) -> Result<Limits, ConfigError> {
    let tenant = || Tenant::header("x-key");
    let cost = || Metered::new().header(HeaderName::from_static("x-cost"));
    let mut limits = Limits::new();
    match scenario {
        Scenario::DelayWindow => return self::limits(DELAY_WINDOW),
        Scenario::Delay {
            rate,
            burst,
            delay,
            window,
        } => {
            let gcra = Limit::gcra("rate", Quota::per_second(rate)?.with_burst(burst)?)?
                .delay_up_to(Duration::from_millis(delay))?;
            limits.push_metered(
                gcra,
                Box::new(tenant()),
                cost()
                    .count_if(|r| r.status() != StatusCode::INTERNAL_SERVER_ERROR)
                    .on_drop(OnDrop::Refund),
            );
            if let Some(w) = window {
                limits = limits.limit(
                    Limit::fixed_window("window", Quota::per_second(w)?)?,
                    tenant(),
                );
            }
        }
        Scenario::SlotPlans => {
            let slots = Limit::concurrency("slots", 2)?.plan("pro", Quota::per_second(3)?)?;
            limits = limits.limit(slots, tenant());
        }
        Scenario::CostZero => {
            limits.push_metered(Limit::concurrency("slots", 1)?, Box::new(tenant()), cost());
        }
        Scenario::Alternating => limits = limits.limit(Limit::concurrency("slots", 1)?, tenant()),
        Scenario::Forwarded { skip } => {
            let trusted = || TrustedProxies::parse(&["10.0.0.0/8"]).unwrap();
            let mut rate = Limit::gcra("rate", Quota::per_second(50)?)?;
            if skip {
                rate = rate.on_missing_key(MissingKeyPolicy::Skip);
            }
            let net: Cidr = "203.0.113.0/24".parse().unwrap();
            limits = limits
                .limit(rate, ClientIp::x_forwarded_for(trusted()))
                .with_denylist(
                    Denylist::new().networks(ClientIp::x_forwarded_for(trusted()), [net]),
                );
        }
    }
    Ok(limits)
}

/// What the invariants know of `s` under `scenario`.
fn sent_of(trace: &Trace, scenario: Scenario, s: Shot) -> Sent {
    if let Scenario::DelayWindow = scenario {
        return sent_of(trace, DELAY_WINDOW, s);
    }
    let mut sent = trace.sent();
    match scenario {
        Scenario::DelayWindow => {}
        Scenario::Delay {
            rate,
            burst,
            window,
            ..
        } => {
            sent.rates = vec![("rate", Spec::gcra(rate, burst, SECOND), s.cost)];
            if let Some(w) = window {
                sent.rates.push(("window", Spec::window(w, SECOND), 1));
            }
            sent.refund = if s.fail { s.cost } else { 0 };
        }
        // The most slots over the plans: 3.
        Scenario::SlotPlans => sent.slots = Some(3),
        // A request of cost 0 is not counted as holding a slot.
        Scenario::CostZero => sent.slots = (s.cost > 0).then_some(1),
        Scenario::Alternating => {
            sent.slots = Some(1);
            sent.alternating = true;
        }
        Scenario::Forwarded { .. } => sent.denylisted = true,
    }
    sent
}

fn request(trace: &Trace, scenario: Scenario, s: Shot) -> Request<Body> {
    let forwarded = if s.padded {
        // Over 4 KB: the proxy appended the client's address to the client's own header.
        format!("{}{CLIENT}", "198.51.100.7, ".repeat(350))
    } else {
        CLIENT.to_owned()
    };
    let mut req = Request::get("/")
        .header("x-key", s.key)
        .header("x-cost", s.cost.to_string())
        .header("x-status", if s.fail { "500" } else { "200" })
        .header("x-forwarded-for", forwarded)
        .body(Body::empty())
        .unwrap();
    let peer: SocketAddr = PROXY.parse().unwrap();
    req.extensions_mut().insert(ConnectInfo(peer));
    if s.pro {
        req.extensions_mut().insert(Plan::new("pro"));
    }
    req.extensions_mut().insert(sent_of(trace, scenario, s));
    req
}

/// The error a layer of `scenario` must be refused at build with, if any: a delayed limit
/// stacked with a fixed window on one layer.
fn refusal(scenario: Scenario) -> Option<ConfigError> {
    match scenario {
        Scenario::DelayWindow
        | Scenario::Delay {
            window: Some(_), ..
        } => Some(ConfigError::DelayWithWindow {
            delayed: "rate".into(),
            window: "window".into(),
        }),
        _ => None,
    }
}

fn app<B: Backend>(
    scenario: Scenario,
    backend: B,
    trace: &Arc<Trace>,
) -> Result<Router, ConfigError> {
    let layer = RateLimitLayer::builder()
        .limits(limits(scenario)?)
        .backend(backend)
        .build()?;
    let (flight, trace) = (InFlight::new(None), Arc::clone(trace));
    Ok(Router::new()
        .route(
            "/",
            get(move |req: Request<Body>| handler(req, Arc::clone(&flight), Arc::clone(&trace))),
        )
        .layer(layer))
}

/// Sends `s` at its time; holds its response, or drops it if it is not answered in time.
/// What its answer shows against the scenario alone, if anything.
async fn shoot(
    (app, trace, verbose): (Router, Arc<Trace>, bool),
    scenario: Scenario,
    s: Shot,
    t0: tokio::time::Instant,
) -> Option<String> {
    tokio::time::sleep_until(t0 + Duration::from_millis(s.at_ms)).await;
    let call = app.oneshot(request(&trace, scenario, s));
    let res: Response = match s.drop_after_ms {
        Some(ms) => match tokio::time::timeout(Duration::from_millis(ms), call).await {
            Ok(res) => res.unwrap(),
            Err(_) => {
                if verbose {
                    println!("    {s:?} dropped at +{} µs", t0.elapsed().as_micros());
                }
                trace.dropped(s.key, s.cost);
                return None;
            }
        },
        None => call.await.unwrap(),
    };
    if verbose {
        let decision = res.extensions().get::<Decision>();
        let labels = decision.map_or(String::new(), |d| {
            d.limits()
                .iter()
                .map(|l| format!("{}={}", l.name(), l.label()))
                .collect::<Vec<_>>()
                .join(",")
        });
        println!(
            "    {s:?} -> {} {labels} waited {:?}, answered at +{} µs",
            res.status(),
            decision.and_then(Decision::delayed),
            t0.elapsed().as_micros()
        );
    }
    let status = res.status();
    tokio::time::sleep(Duration::from_millis(s.hold_ms)).await;
    let _ = axum::body::to_bytes(res.into_body(), usize::MAX).await;
    match scenario {
        // A cost of 0 on a concurrency limit is an invalid cost: 400, before the handler.
        Scenario::CostZero if s.cost == 0 && status != StatusCode::BAD_REQUEST => Some(format!(
            "{s:?}: a cost of 0 on slots answered {status}, not 400"
        )),
        Scenario::CostZero if s.at_ms == 700 && status != StatusCode::OK => Some(format!(
            "{s:?}: alone on a free slot answered {status}: a cost of 0 was counted"
        )),
        _ => None,
    }
}

/// One client: each request sent once the last response ended, to the other replica.
async fn alternate(apps: &[Router], trace: &Trace) {
    for i in 0..24 {
        let s = Shot::at(0, KEYS[0]);
        let res = apps[i % 2]
            .clone()
            .oneshot(request(trace, Scenario::Alternating, s))
            .await
            .unwrap();
        let decision = res.extensions().get::<Decision>().cloned();
        if res.status() == StatusCode::TOO_MANY_REQUESTS
            && refused_for(decision.as_ref(), "slots", DenyReason::InFlight)
        {
            trace.refused_own_slot(KEYS[0]);
        }
        let _ = axum::body::to_bytes(res.into_body(), usize::MAX).await;
    }
}

async fn play<B: Backend>(
    (scenario, shots, verbose): (Scenario, &[Shot], bool),
    backend: impl Fn() -> B,
    trace: &Arc<Trace>,
) -> Result<Vec<String>, ConfigError> {
    let apps = (0..2)
        .map(|_| app(scenario, backend(), trace))
        .collect::<Result<Vec<_>, _>>()?;
    if let Scenario::Alternating = scenario {
        alternate(&apps, trace).await;
        return Ok(Vec::new());
    }
    let t0 = tokio::time::Instant::now();
    let tasks: Vec<_> = shots
        .iter()
        .map(|&s| {
            let on = (apps[s.replica].clone(), Arc::clone(trace), verbose);
            tokio::spawn(shoot(on, scenario, s, t0))
        })
        .collect();
    let mut found = Vec::new();
    for t in tasks {
        found.extend(t.await.ok().flatten());
    }
    Ok(found)
}

/// Runs `seed`'s timed sequence on `kind`, if it draws one: its description and violations.
pub(crate) async fn sequence(
    seed: u64,
    kind: Kind,
    servers: &Servers,
    verbose: bool,
) -> Option<(String, Vec<String>)> {
    let (scenario, shots) = draw(seed)?;
    let what = format!("timed {scenario:?}");
    if verbose {
        println!("  {what}");
    }
    let mut found = Vec::new();
    let built = match kind {
        Kind::Memory => {
            tokio::time::pause();
            let clock = TokioClock {
                // Half a second past a whole one: the windows fall alike on every run, and a
                // window ends amid the requests and their waits.
                base: invariants::sys_now() / SECOND * SECOND + SECOND / 2,
                start: tokio::time::Instant::now(),
            };
            let frame = Frame::Memory {
                clock: Arc::new(clock.clone()),
                delays: false,
            };
            let trace = Trace::new(frame, None);
            let memory = Arc::new(MemoryBackend::builder().clock(clock).build());
            let played = play((scenario, &shots, verbose), || Arc::clone(&memory), &trace).await;
            tokio::time::resume();
            found.extend(trace.judge());
            played
        }
        Kind::Redis | Kind::Cluster => {
            let prefix = format!("comb{seed}t");
            let urls = match kind {
                Kind::Redis => servers.redis.as_ref().map(|s| vec![s.url()]),
                _ => servers
                    .cluster
                    .as_ref()
                    .map(tollgate_testsupport::RedisCluster::urls),
            }?;
            let backend = || super::redis_backend(kind, &urls, &prefix);
            let trace = Trace::new(Frame::Real, None);
            let played = play((scenario, &shots, verbose), backend, &trace).await;
            found.extend(trace.judge());
            let identities = [KEYS[0], KEYS[1], CLIENT];
            found.extend(invariants::raw_in_redis(&urls, &prefix, &identities));
            played
        }
    };
    // The layer is refused at build exactly when the combination is documented as refused.
    match (built, refusal(scenario)) {
        (Ok(seen), None) => found.extend(seen),
        (Err(e), Some(want)) if e == want => {}
        (Err(e), Some(want)) => found.push(format!("refused at build with {e}, not {want}")),
        (Err(e), None) => found.push(format!("refused at build: {e}")),
        (Ok(_), Some(want)) => found.push(format!("built, not refused with {want}")),
    }
    Some((what, found))
}
