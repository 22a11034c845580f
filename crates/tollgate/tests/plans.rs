//! Quotas per plan, limits replaced at run time, and the limits file, in memory.

#![allow(clippy::unwrap_used)]

mod support;

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use http::{Request, Response, StatusCode};
use tokio::sync::Semaphore;
use tollgate::engine::{Backend, BackendError, Check, Verdicts};
use tollgate::key::Tenant;
use tollgate::{
    Decision, FakeClock, Limit, Limits, LimitsFile, MemoryBackend, Plan, Quota, RateLimitLayer,
};
use tower::{service_fn, Layer, Service, ServiceExt};

type Svc = tower::util::BoxCloneService<Request<Body>, Response<Body>, Infallible>;

fn app<B: Backend>(layer: RateLimitLayer<B>) -> Svc {
    let handler = service_fn(|req: Request<Body>| async move {
        let left = req
            .extensions()
            .get::<Decision>()
            .and_then(Decision::remaining);
        Ok::<_, Infallible>(Response::new(Body::from(format!("{left:?}"))))
    });
    tower::util::BoxCloneService::new(layer.layer(handler).map_response(|r| r.map(Body::new)))
}

fn memory() -> (MemoryBackend<FakeClock>, FakeClock) {
    // On a minute boundary, so that a minute's window lasts a whole minute.
    let clock = FakeClock::new(1_700_000_040_000_000);
    (MemoryBackend::builder().clock(clock.clone()).build(), clock)
}

fn req(key: &str, plan: Option<&str>) -> Request<Body> {
    let mut req = Request::get("/")
        .header("x-key", key)
        .body(Body::empty())
        .unwrap();
    if let Some(plan) = plan {
        req.extensions_mut().insert(Plan::new(plan));
    }
    req
}

async fn send(svc: &mut Svc, key: &str, plan: Option<&str>) -> Response<Body> {
    svc.ready()
        .await
        .unwrap()
        .call(req(key, plan))
        .await
        .unwrap()
}

/// How many of `n` requests are admitted.
async fn admitted(svc: &mut Svc, key: &str, plan: Option<&str>, n: usize) -> usize {
    let mut ok = 0;
    for _ in 0..n {
        if send(svc, key, plan).await.status() == StatusCode::OK {
            ok += 1;
        }
    }
    ok
}

fn header(res: &Response<Body>, name: &str) -> Option<String> {
    res.headers()
        .get(name)
        .map(|v| v.to_str().unwrap().to_owned())
}

fn window(name: &str, default: u32) -> Limit {
    Limit::fixed_window(name, Quota::per_minute(default).unwrap()).unwrap()
}

fn per_key(limit: Limit) -> Limits {
    Limits::new().limit(limit, Tenant::header("x-key"))
}

/// A key's window of 3 a minute, 2 on plan "free" and 5 on plan "pro", in memory.
fn free_and_pro() -> Svc {
    let (backend, _clock) = memory();
    let limit = window("per-key", 3)
        .plan("free", Quota::per_minute(2).unwrap())
        .unwrap()
        .plan("pro", Quota::per_minute(5).unwrap())
        .unwrap();
    let layer = RateLimitLayer::builder()
        .limits(per_key(limit))
        .backend(backend)
        .build()
        .unwrap();
    app(layer)
}

#[tokio::test]
async fn each_plan_gets_its_quota_and_others_the_default() {
    let mut svc = free_and_pro();
    assert_eq!(admitted(&mut svc, "a", Some("free"), 10).await, 2);
    assert_eq!(admitted(&mut svc, "b", Some("pro"), 10).await, 5);
    assert_eq!(admitted(&mut svc, "c", None, 10).await, 3);
    assert_eq!(admitted(&mut svc, "d", Some("enterprise"), 10).await, 3);
    // The fields advertise the quota the request got.
    let pro = send(&mut svc, "e", Some("pro")).await;
    assert_eq!(
        header(&pro, "ratelimit-policy").as_deref(),
        Some("\"per-key\";q=5;w=60")
    );
    assert_eq!(
        header(&pro, "ratelimit").as_deref(),
        Some("\"per-key\";r=4;t=60")
    );
    let none = send(&mut svc, "f", None).await;
    assert_eq!(
        header(&none, "ratelimit-policy").as_deref(),
        Some("\"per-key\";q=3;w=60")
    );
    let refused = send(&mut svc, "a", Some("free")).await;
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        header(&refused, "ratelimit-policy").as_deref(),
        Some("\"per-key\";q=2;w=60")
    );
}

#[tokio::test]
async fn refusals_alike_but_for_the_plan_each_advertise_their_own_quota() {
    // A flood's refusals reuse the last one's fields while they would be written the same:
    // two plans' refusals with the same limit, wait and figures differ in their policy.
    let mut svc = free_and_pro();
    assert_eq!(admitted(&mut svc, "a", Some("free"), 2).await, 2);
    assert_eq!(admitted(&mut svc, "b", Some("pro"), 5).await, 5);
    for (key, plan, policy) in [
        ("a", "free", "\"per-key\";q=2;w=60"),
        ("a", "free", "\"per-key\";q=2;w=60"),
        ("b", "pro", "\"per-key\";q=5;w=60"),
        ("a", "free", "\"per-key\";q=2;w=60"),
    ] {
        let refused = send(&mut svc, key, Some(plan)).await;
        assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(header(&refused, "retry-after").as_deref(), Some("60"));
        assert_eq!(
            header(&refused, "ratelimit").as_deref(),
            Some("\"per-key\";r=0;t=60")
        );
        assert_eq!(
            header(&refused, "ratelimit-policy").as_deref(),
            Some(policy)
        );
    }
}

#[tokio::test]
async fn a_function_of_the_request_chooses_the_plan_when_it_has_none() {
    let (backend, _clock) = memory();
    let limit = window("per-key", 2)
        .plan("partner", Quota::per_minute(4).unwrap())
        .unwrap()
        .plan("pro", Quota::per_minute(6).unwrap())
        .unwrap();
    let layer = RateLimitLayer::builder()
        .limits(per_key(limit))
        .plan_fn(|req| {
            req.headers()
                .contains_key("x-partner")
                .then(|| Plan::new("partner"))
        })
        .backend(backend)
        .build()
        .unwrap();
    let mut svc = app(layer);
    let partner = |key: &str| {
        let mut r = req(key, None);
        r.headers_mut().insert("x-partner", "1".parse().unwrap());
        r
    };
    let mut ok = 0;
    for _ in 0..10 {
        let res = svc.ready().await.unwrap().call(partner("a")).await.unwrap();
        ok += usize::from(res.status() == StatusCode::OK);
    }
    assert_eq!(ok, 4);
    // The extension wins over the function.
    let mut ok = 0;
    for _ in 0..10 {
        let mut r = partner("b");
        r.extensions_mut().insert(Plan::new("pro"));
        let res = svc.ready().await.unwrap().call(r).await.unwrap();
        ok += usize::from(res.status() == StatusCode::OK);
    }
    assert_eq!(ok, 6);
    assert_eq!(admitted(&mut svc, "c", None, 10).await, 2);
}

#[tokio::test]
async fn a_gcra_plan_and_a_sliding_log_plan_are_exact_too() {
    let (backend, _clock) = memory();
    let gcra = Limit::gcra("burst", Quota::per_minute(2).unwrap())
        .unwrap()
        .plan("pro", Quota::per_minute(6).unwrap())
        .unwrap();
    let log = Limit::sliding_log("log", Quota::per_minute(4).unwrap())
        .unwrap()
        .plan("pro", Quota::per_minute(8).unwrap())
        .unwrap();
    let layer = RateLimitLayer::builder()
        .limit(gcra, Tenant::header("x-key"))
        .backend(backend.clone())
        .build()
        .unwrap();
    let mut svc = app(layer);
    assert_eq!(admitted(&mut svc, "a", None, 10).await, 2);
    assert_eq!(admitted(&mut svc, "b", Some("pro"), 10).await, 6);
    let layer = RateLimitLayer::builder()
        .limit(log, Tenant::header("x-key"))
        .backend(backend)
        .build()
        .unwrap();
    let mut svc = app(layer);
    assert_eq!(admitted(&mut svc, "a", None, 10).await, 4);
    assert_eq!(admitted(&mut svc, "b", Some("pro"), 10).await, 8);
}

#[tokio::test]
async fn a_raised_quota_keeps_what_each_key_used() {
    let (backend, clock) = memory();
    let layer = RateLimitLayer::builder()
        .limits(per_key(window("per-key", 5)))
        .backend(backend)
        .build()
        .unwrap();
    let reloader = layer.reloader();
    let mut svc = app(layer.clone());
    assert_eq!(admitted(&mut svc, "a", None, 7).await, 5);
    assert_eq!(admitted(&mut svc, "b", None, 2).await, 2);
    clock.advance(Duration::from_secs(10));
    reloader.reload(per_key(window("per-key", 10))).unwrap();
    // Used 5 of 5, raised to 10: exactly 5 more in the same window; 2 of 5: 8 more.
    assert_eq!(admitted(&mut svc, "a", None, 20).await, 5);
    assert_eq!(admitted(&mut svc, "b", None, 20).await, 8);
    // Lowered to 3: both have used more than that, until the window turns.
    reloader.reload(per_key(window("per-key", 3))).unwrap();
    assert_eq!(admitted(&mut svc, "a", None, 5).await, 0);
    clock.advance(Duration::from_secs(50));
    assert_eq!(admitted(&mut svc, "a", None, 5).await, 3);
    // A plan raised from a reload the same way.
    let with_plan = |pro| {
        per_key(
            window("per-key", 3)
                .plan("pro", Quota::per_minute(pro).unwrap())
                .unwrap(),
        )
    };
    reloader.reload(with_plan(4)).unwrap();
    assert_eq!(admitted(&mut svc, "p", Some("pro"), 6).await, 4);
    reloader.reload(with_plan(6)).unwrap();
    assert_eq!(admitted(&mut svc, "p", Some("pro"), 6).await, 2);
}

#[tokio::test]
async fn sliding_log_entries_and_gcra_times_carry_across_a_change() {
    let (backend, clock) = memory();
    let log = |n| {
        Limits::new().limit(
            Limit::sliding_log("log", Quota::per_minute(n).unwrap()).unwrap(),
            Tenant::header("x-key"),
        )
    };
    let layer = RateLimitLayer::builder()
        .limits(log(4))
        .backend(backend.clone())
        .build()
        .unwrap();
    let mut svc = app(layer.clone());
    assert_eq!(admitted(&mut svc, "a", None, 6).await, 4);
    clock.advance(Duration::from_secs(30));
    layer.reloader().reload(log(6)).unwrap();
    assert_eq!(admitted(&mut svc, "a", None, 6).await, 2);
    // The first four leave a minute after they came, the other two 30 s later.
    clock.advance(Duration::from_secs(30));
    assert_eq!(admitted(&mut svc, "a", None, 6).await, 4);

    // GCRA carries the units used: 5 of 5 a minute used at once, raised to 10 a minute,
    // leaves exactly 5.
    let gcra = |n| {
        Limits::new().limit(
            Limit::gcra("gcra", Quota::per_minute(n).unwrap()).unwrap(),
            Tenant::header("x-key"),
        )
    };
    let layer = RateLimitLayer::builder()
        .limits(gcra(5))
        .backend(backend.clone())
        .build()
        .unwrap();
    let mut svc = app(layer.clone());
    assert_eq!(admitted(&mut svc, "g", None, 6).await, 5);
    layer.reloader().reload(gcra(10)).unwrap();
    assert_eq!(admitted(&mut svc, "g", None, 8).await, 5);
    // Then one every 6 s.
    clock.advance(Duration::from_secs(6));
    assert_eq!(admitted(&mut svc, "g", None, 3).await, 1);
    // Lowered to 2 a minute: the 10 units used are 5 minutes at 30 s each, more than the
    // bucket's minute, so refused. A refusal writes nothing, so the stored TAT is still the
    // old quota's until an admission carries it: it drains at the old rate meanwhile.
    layer.reloader().reload(gcra(2)).unwrap();
    assert_eq!(admitted(&mut svc, "g", None, 3).await, 0);
    clock.advance(Duration::from_secs(59));
    // 1 s left of the old minute: 1 unit used at 30 s, room for 1 more.
    assert_eq!(admitted(&mut svc, "g", None, 3).await, 1);

    // A key whose plan changes carries what it used the same way.
    let plans = Limit::gcra("plans", Quota::per_minute(2).unwrap())
        .unwrap()
        .plan("pro", Quota::per_minute(6).unwrap())
        .unwrap();
    let layer = RateLimitLayer::builder()
        .limit(plans, Tenant::header("x-key"))
        .backend(backend)
        .build()
        .unwrap();
    let mut svc = app(layer);
    assert_eq!(admitted(&mut svc, "u", None, 3).await, 2);
    assert_eq!(admitted(&mut svc, "u", Some("pro"), 10).await, 4);
}

#[tokio::test]
async fn a_changed_period_or_algorithm_starts_empty() {
    let (backend, _clock) = memory();
    let layer = RateLimitLayer::builder()
        .limits(per_key(window("per-key", 3)))
        .backend(backend)
        .build()
        .unwrap();
    let mut svc = app(layer.clone());
    assert_eq!(admitted(&mut svc, "a", None, 5).await, 3);
    let hourly = Limit::fixed_window("per-key", Quota::per_hour(3).unwrap()).unwrap();
    layer.reloader().reload(per_key(hourly)).unwrap();
    assert_eq!(admitted(&mut svc, "a", None, 5).await, 3);
    let gcra = Limit::gcra("per-key", Quota::per_hour(3).unwrap()).unwrap();
    layer.reloader().reload(per_key(gcra)).unwrap();
    assert_eq!(admitted(&mut svc, "a", None, 5).await, 3);
}

#[tokio::test]
async fn a_set_that_cannot_be_built_is_refused_whole_and_counted() {
    let recorder = support::Recorder::install();
    let (backend, _clock) = memory();
    let layer = RateLimitLayer::builder()
        .limits(per_key(window("per-key", 2)))
        .backend(backend)
        .build()
        .unwrap();
    let reloader = layer.reloader();
    let duplicate = per_key(window("per-key", 9))
        .limit(window("other", 9), Tenant::header("x-key"))
        .limit(window("per-key", 9), Tenant::header("x-key"));
    let err = reloader.reload(duplicate).unwrap_err();
    assert_eq!(
        err.to_string(),
        "limits refused, the old ones stay: two limits are named \"per-key\""
    );
    assert!(reloader.reload(Limits::new()).is_err());
    let file = LimitsFile::new();
    // The deprecated form counts a file that does not parse as a failed reload.
    #[allow(deprecated)]
    let err = reloader
        .reload_toml_str(&file, "[[limit]]\nname = \"x\"\nperiod = \"1q\"\n")
        .unwrap_err();
    assert!(err.to_string().contains("line 1 column 1"), "{err}");
    let mut svc = app(layer.clone());
    assert_eq!(admitted(&mut svc, "a", None, 5).await, 2);
    assert_eq!(layer.limits().len(), 1);
    assert_eq!(layer.limits()[0].quota().limit(), 2);
    reloader.reload(per_key(window("per-key", 4))).unwrap();
    assert_eq!(admitted(&mut svc, "a", None, 5).await, 2);
    let snapshot = recorder.snapshot();
    let reloads =
        |result: &str| snapshot.counter("tollgate_config_reloads_total", &[("result", result)]);
    assert_eq!(reloads("error"), Some(3));
    assert_eq!(reloads("ok"), Some(1));
}

/// A backend whose answers wait for a permit, so that a test can change the limits while a
/// request is in flight.
#[derive(Clone)]
struct Gated(MemoryBackend<FakeClock>, Arc<Semaphore>);

impl Backend for Gated {
    type Future =
        std::pin::Pin<Box<dyn std::future::Future<Output = Result<Verdicts, BackendError>> + Send>>;
    fn check(&self, checks: &[Check<'_>]) -> Self::Future {
        let answer = self.0.check_now(checks);
        let gate = Arc::clone(&self.1);
        Box::pin(async move {
            gate.acquire().await.unwrap().forget();
            answer
        })
    }
    fn kind(&self) -> &'static str {
        "gated"
    }
}

#[tokio::test]
async fn a_request_in_flight_finishes_under_the_limits_it_started_with() {
    let (backend, _clock) = memory();
    let gate = Arc::new(Semaphore::new(0));
    let layer = RateLimitLayer::builder()
        .limits(per_key(window("old", 2)))
        .backend(Gated(backend, Arc::clone(&gate)))
        .build()
        .unwrap();
    let mut svc = app(layer.clone());
    let in_flight = svc.ready().await.unwrap().call(req("a", None));
    layer.reloader().reload(per_key(window("new", 7))).unwrap();
    gate.add_permits(2);
    let res = in_flight.await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(
        header(&res, "ratelimit-policy").as_deref(),
        Some("\"old\";q=2;w=60")
    );
    let decision = res.extensions().get::<Decision>().unwrap();
    assert_eq!(decision.limits()[0].name(), "old");
    // The next request gets the new limits.
    let res = send(&mut svc, "a", None).await;
    assert_eq!(
        header(&res, "ratelimit-policy").as_deref(),
        Some("\"new\";q=7;w=60")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn reloads_under_load_lose_no_request_and_count_none_twice() {
    const TASKS: usize = 8;
    const PER_TASK: usize = 500;
    const SWAPS: usize = 100;
    let (backend, _clock) = memory();
    // A day's window: the count survives every swap of the quota between two large values.
    let day = |n| {
        Limits::new().limit(
            Limit::fixed_window("day", Quota::per_day(n).unwrap()).unwrap(),
            tollgate::key::Global,
        )
    };
    let layer = RateLimitLayer::builder()
        .limits(day(1_000_000))
        .backend(backend)
        .build()
        .unwrap();
    let ok = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for _ in 0..TASKS {
        let mut svc = app(layer.clone());
        let ok = Arc::clone(&ok);
        tasks.push(tokio::spawn(async move {
            for _ in 0..PER_TASK {
                let res = send(&mut svc, "k", None).await;
                assert_eq!(res.status(), StatusCode::OK);
                ok.fetch_add(1, Ordering::Relaxed);
                tokio::task::yield_now().await;
            }
        }));
    }
    let reloader = layer.reloader();
    let swapper = tokio::spawn(async move {
        for i in 0..SWAPS {
            reloader
                .reload(day(if i % 2 == 0 { 2_000_000 } else { 1_000_000 }))
                .unwrap();
            tokio::task::yield_now().await;
        }
    });
    for t in tasks {
        t.await.unwrap();
    }
    swapper.await.unwrap();
    let sent = (TASKS * PER_TASK) as u32;
    assert_eq!(ok.load(Ordering::Relaxed), u64::from(sent));
    // Exactly what was sent was counted: a quota of sent + 3 admits exactly 3 more.
    layer.reloader().reload(day(sent + 3)).unwrap();
    let mut svc = app(layer);
    let mut more = 0;
    for _ in 0..10 {
        if send(&mut svc, "k", None).await.status() == StatusCode::OK {
            more += 1;
        }
    }
    assert_eq!(more, 3);
}

#[derive(Clone)]
struct UserId(u64);

impl tollgate::key::PrincipalId for UserId {
    fn principal_id(&self) -> Result<tollgate::key::Key<'_>, tollgate::key::MissingKey> {
        self.0.principal_id()
    }
}

const FILE: &str = r#"
[[limit]]
name = "per-user"
algorithm = "fixed_window"
period = "1m"
key = "principal"
failure = "closed"
[limit.quota]
default = 2
pro = 4

[[limit]]
name = "per-shop"
algorithm = "gcra"
period = "1h"
key = { header = "x-shop", max_len = 32 }
missing_key = "skip"
failure = { fallback = 2 }
[limit.quota]
default = { limit = 60, burst = 10 }

[[limit]]
name = "per-ip"
algorithm = "sliding_log"
period = "10s"
key = { ip = { header = "x-forwarded-for", trusted = ["10.0.0.0/8"], ipv6_prefix = 56 } }
shadow = true
[limit.quota]
default = 100

[[limit]]
name = "everyone"
period = "1d"
key = "global"
[limit.quota]
default = 1000000
"#;

#[tokio::test]
async fn the_limits_file_describes_every_kind_of_key_and_policy() {
    let limits = LimitsFile::new().principal::<UserId>().parse(FILE).unwrap();
    let names: Vec<&str> = limits.iter().map(Limit::name).collect();
    assert_eq!(names, ["per-user", "per-shop", "per-ip", "everyone"]);
    let all: Vec<Limit> = limits.iter().cloned().collect();
    assert_eq!(all[0].quota_of(Some("pro")).1.limit(), 4);
    assert_eq!(all[0].failure_policy(), tollgate::FailurePolicy::FailClosed);
    assert_eq!(all[1].quota().burst(), 10);
    assert_eq!(all[1].quota().period(), Duration::from_secs(3600));
    assert!(all[2].is_shadow());
    assert_eq!(all[2].algorithm(), tollgate::Algorithm::SlidingLog);
    assert_eq!(all[3].algorithm(), tollgate::Algorithm::Gcra);

    let (backend, _clock) = memory();
    let layer = RateLimitLayer::builder()
        .limits(limits)
        .backend(backend)
        .build()
        .unwrap();
    let mut svc = app(layer);
    let as_user = |id, plan: Option<&str>| {
        let mut r = Request::get("/").body(Body::empty()).unwrap();
        r.extensions_mut().insert(UserId(id));
        r.extensions_mut()
            .insert(std::net::SocketAddr::from(([10, 1, 2, 3], 4000)));
        if let Some(p) = plan {
            r.extensions_mut().insert(Plan::new(p));
        }
        r
    };
    let mut codes = Vec::new();
    for _ in 0..5 {
        let res = svc
            .ready()
            .await
            .unwrap()
            .call(as_user(7, Some("pro")))
            .await;
        codes.push(res.unwrap().status().as_u16());
    }
    assert_eq!(codes, [200, 200, 200, 200, 429]);
    // No user: the principal's limit refuses it (missing key, rejected).
    let mut r = Request::get("/").body(Body::empty()).unwrap();
    r.extensions_mut()
        .insert(std::net::SocketAddr::from(([10, 1, 2, 3], 4000)));
    let res = svc.ready().await.unwrap().call(r).await.unwrap();
    assert_eq!(res.status(), StatusCode::BAD_REQUEST);
}

#[test]
fn limits_file_errors_say_where() {
    let file = LimitsFile::new();
    let at = |text: &str| {
        let e = file.parse(text).unwrap_err();
        (e.line(), e.column(), e.message().to_owned())
    };
    // TOML that does not parse.
    let (line, column, _) = at("[[limit]]\nname = \"a\"\nperiod = 1m\n");
    assert_eq!((line, column), (3, 10));
    // A field the format does not have.
    let (line, _, message) =
        at("[[limit]]\nname = \"a\"\nperiod = \"1m\"\nkey = \"global\"\nqota = 3\n");
    assert_eq!(line, 5);
    assert!(message.contains("unknown field `qota`"), "{message}");
    // A limit that cannot be built: at the value that is wrong, here its name.
    let text = "[[limit]]\nname = \"a\"\nperiod = \"1m\"\nkey = \"global\"\nquota = { default = 5 }\n\n[[limit]]\nname = \"b c\"\nperiod = \"1m\"\nkey = \"global\"\nquota = { default = 5 }\n";
    let (line, column, message) = at(text);
    assert_eq!((line, column), (8, 8));
    assert!(message.contains("limit \"b c\""), "{message}");
    // No default quota.
    let (_, _, message) =
        at("[[limit]]\nname = \"a\"\nperiod = \"1m\"\nkey = \"global\"\nquota = { pro = 5 }\n");
    assert!(message.contains("needs a `default`"), "{message}");
    // A principal the loader bound to no type.
    let (_, _, message) = at(
        "[[limit]]\nname = \"a\"\nperiod = \"1m\"\nkey = \"principal\"\nquota = { default = 5 }\n",
    );
    assert!(message.contains("bound to no type"), "{message}");
    // A fixed window whose plans have another period cannot be written: one period per limit.
    // Duplicate names.
    let (line, _, message) = at(&format!(
        "{0}{0}",
        "[[limit]]\nname = \"a\"\nperiod = \"1m\"\nkey = \"global\"\nquota = { default = 5 }\n"
    ));
    // At the second name, which says the line of the first.
    assert_eq!(line, 7);
    assert!(
        message.contains("two limits are named \"a\" (the first at line 2)"),
        "{message}"
    );
}

#[tokio::test]
#[allow(deprecated)] // The deprecated constructors keep working.
async fn a_layer_from_a_toml_text_or_file() {
    let text = "[[limit]]\nname = \"all\"\nalgorithm = \"fixed_window\"\nperiod = \"1d\"\nkey = \"global\"\n[limit.quota]\ndefault = 2\n";
    let layer = RateLimitLayer::from_toml_str(text).unwrap();
    assert_eq!(layer.limits()[0].name(), "all");
    let mut svc = app(layer);
    assert_eq!(admitted(&mut svc, "a", None, 5).await, 2);
    let path = std::env::temp_dir().join(format!("tollgate-limits-{}.toml", std::process::id()));
    std::fs::write(&path, text).unwrap();
    let layer = RateLimitLayer::from_toml_file(&path).unwrap();
    assert_eq!(layer.limits()[0].quota().limit(), 2);
    std::fs::remove_file(&path).unwrap();
    let missing = RateLimitLayer::from_toml_file(&path).unwrap_err();
    assert!(
        missing.to_string().starts_with("limits file: cannot read "),
        "{missing}"
    );
}
