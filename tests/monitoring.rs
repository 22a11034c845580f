//! The alert rules (`deploy/prometheus/`) and the dashboard (`deploy/grafana/`) name only what
//! tollgate exports: every metric name in those files, and every value they select of the
//! labels `outcome`, `reason`, `result` and `quantile`, is in a scrape of
//! examples/llm_chat.rs's `GET /metrics`, taken after traffic that produces every family:
//! admissions and refusals, a settle dropped because Redis stopped, bypasses while it is
//! down, the canary, and a reload.

#![allow(clippy::unwrap_used)]

#[allow(dead_code)]
#[path = "../examples/llm_chat.rs"]
mod llm_chat;

use std::collections::BTreeSet;
use std::future::Future;
use std::num::NonZeroU32;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{Request, StatusCode};
use axum::Router;
use http_body::Frame;
use http_body_util::BodyExt;
use metrics_exporter_prometheus::PrometheusBuilder;
use tokio::sync::oneshot;
use tollgate::{Canary, CanaryStatus, Limits, RateLimitLayer};
use tollgate_redis::RedisBackend;
use tollgate_testsupport::RedisServer;
use tower::ServiceExt;

/// The labels whose values the rules and the dashboard select: each value they name must be
/// one tollgate exports.
const SELECTED_LABELS: [&str; 4] = ["outcome", "reason", "result", "quantile"];

/// The example's limits, on a backend whose deadline a loaded machine meets (a check that
/// times out fails open and would spoil the counts asserted below).
fn limits(server: &RedisServer) -> (RedisBackend, RateLimitLayer<RedisBackend>) {
    let backend = RedisBackend::builder()
        .url(server.url())
        .deadline(Duration::from_secs(5))
        .build()
        .unwrap();
    let settings = llm_chat::Settings {
        redis: llm_chat::Redis::Url(server.url()),
        ca: None,
        tokens_per_hour: 20_000,
        replicas: NonZeroU32::new(2).unwrap(),
        in_flight: 4,
        port: 0,
    };
    let limits = llm_chat::limits(backend.clone(), &settings).unwrap();
    (backend, limits)
}

/// The status and the body of `req` sent to `app`.
async fn send(app: &Router, req: Request<Body>) -> (StatusCode, String) {
    let res = app.clone().oneshot(req).await.unwrap();
    let status = res.status();
    let bytes = res.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8(bytes.to_vec()).unwrap())
}

fn chat(shop: &str) -> Request<Body> {
    Request::post("/api/chat")
        .header("x-shop-domain", shop)
        .body(Body::empty())
        .unwrap()
}

async fn scrape(app: &Router) -> String {
    let (status, text) = send(app, Request::get("/metrics").body(Body::empty()).unwrap()).await;
    assert_eq!(status, StatusCode::OK);
    text
}

/// A request body that arrives when its sender sends it: the request is admitted, and its
/// handler waits, until then.
struct Later(Option<oneshot::Receiver<Bytes>>);

impl http_body::Body for Later {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        let Some(rx) = self.0.as_mut() else {
            return Poll::Ready(None);
        };
        match Pin::new(rx).poll(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(sent) => {
                self.0 = None;
                Poll::Ready(sent.ok().map(|b| Ok(Frame::data(b))))
            }
        }
    }
}

/// Metric names of a scrape: every sample line's name.
fn scraped_names(scrape: &str) -> BTreeSet<String> {
    scrape
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| l.split(['{', ' ']).next().unwrap().to_owned())
        .collect()
}

/// Every `tollgate_…` word of `text`: the metric names it uses.
fn named_metrics(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find("tollgate_") {
        let before = rest[..at].chars().next_back();
        let word: String = rest[at..]
            .chars()
            .take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_')
            .collect();
        rest = &rest[at + word.len()..];
        // A word that merely ends in `tollgate_` is something else.
        if before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_') {
            continue;
        }
        names.insert(word);
    }
    names
}

/// Every value of `label` that `text` selects: `label="v"`, `label=~"a|b"`, `label!="v"`.
fn selected_values(text: &str, label: &str) -> BTreeSet<String> {
    let mut values = BTreeSet::new();
    for op in ["=\"", "=~\"", "!=\"", "!~\""] {
        let pattern = format!("{label}{op}");
        let mut rest = text;
        while let Some(at) = rest.find(&pattern) {
            rest = &rest[at + pattern.len()..];
            let end = rest.find('"').unwrap();
            values.extend(rest[..end].split('|').map(str::to_owned));
            rest = &rest[end..];
        }
    }
    values
}

/// Every string of a JSON document, unescaped (the dashboard's expressions among them).
fn json_strings(value: &serde_json::Value, out: &mut String) {
    match value {
        serde_json::Value::String(s) => {
            out.push_str(s);
            out.push('\n');
        }
        serde_json::Value::Array(items) => items.iter().for_each(|v| json_strings(v, out)),
        serde_json::Value::Object(map) => map.values().for_each(|v| json_strings(v, out)),
        _ => {}
    }
}

fn files(dir: &str, ext: &str) -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join(dir);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == ext))
        .collect();
    files.sort();
    files
}

/// The text of the rules and their tests, and every string of the dashboards.
fn deploy_texts() -> Vec<(PathBuf, String)> {
    let mut texts = Vec::new();
    for path in files("deploy/prometheus", "yml") {
        texts.push((path.clone(), std::fs::read_to_string(&path).unwrap()));
    }
    for path in files("deploy/grafana", "json") {
        let json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let mut text = String::new();
        json_strings(&json, &mut text);
        texts.push((path, text));
    }
    texts
}

#[tokio::test]
async fn every_metric_the_rules_and_the_dashboard_name_is_in_a_scrape_of_llm_chat() {
    // As the example's `main`: the process's recorder, rendered at `GET /metrics`.
    let prometheus = PrometheusBuilder::new().install_recorder().unwrap();
    let mut redis = RedisServer::start();
    let (backend, limits) = limits(&redis);
    let app = llm_chat::app(limits.clone(), prometheus.clone());

    // 35 requests of one shop: exactly 30 admitted (the last ones near the limit), then
    // refused; the first refusal is kept in the deny cache.
    let mut codes = Vec::new();
    for _ in 0..35 {
        codes.push(send(&app, chat("busy.myshopify.com")).await.0.as_u16());
    }
    assert_eq!(codes[..30], [200; 30]);
    assert_eq!(codes[30..], [429; 5]);

    // The canary, at the example's interval: it takes its unit, then is denied.
    let canary = Canary::new(backend.clone(), llm_chat::CANARY_INTERVAL);
    assert_eq!(canary.check_once().await, CanaryStatus::Denied);

    // A request admitted while Redis is up whose handler answers after Redis stopped: the
    // settle of its tokens (17 reserved by its content-length, 3 used) cannot be applied.
    let (body, rx) = {
        let (tx, rx) = oneshot::channel();
        (tx, Body::new(Later(Some(rx))))
    };
    let shop = "settle.myshopify.com";
    let req = Request::post("/api/chat")
        .header("x-shop-domain", shop)
        .header("content-length", 17)
        .body(rx)
        .unwrap();
    let pending = tokio::spawn({
        let app = app.clone();
        async move { send(&app, req).await }
    });
    // Admitted once Redis counts its unit (polled, as the refunds of tests/llm_chat.rs).
    let mut remaining = 0;
    for _ in 0..500 {
        remaining = limits.peek("chat-per-shop", shop).await.unwrap().remaining;
        if remaining == 29 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(remaining, 29);
    redis.stop();
    body.send(Bytes::from_static(b"{\"message\":\"abc\"}"))
        .unwrap();
    let (status, reply) = pending.await.unwrap();
    assert_eq!(status, StatusCode::OK, "{reply}");
    assert!(reply.ends_with("\"tokens\":3}"), "{reply}");

    // Redis is down: chat-per-shop fails open (a bypass), the other two count in memory.
    let (status, reply) = send(&app, chat("down.myshopify.com")).await;
    assert_eq!(status, StatusCode::OK, "{reply}");
    assert!(reply.contains("\"limited\":false"), "{reply}");
    assert!(!canary.check_once().await.is_ok());

    // llm_chat has no limits file to reload: the reload counter is the layer's, so the
    // example's layer is reloaded here once, as examples/plans.rs does on SIGHUP, with a set
    // it refuses (no limits); its limits stay.
    assert!(limits.reloader().reload(Limits::new()).is_err());

    // The dropped settle is counted when its call fails, after the response: wait for it.
    let mut text = scrape(&app).await;
    for _ in 0..500 {
        if text.contains("tollgate_settles_dropped_total{") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
        text = scrape(&app).await;
    }
    for line in [
        "tollgate_decisions_total{limit=\"chat-per-shop\",outcome=\"allowed\"} 31",
        "tollgate_decisions_total{limit=\"chat-per-shop\",outcome=\"denied\"} 5",
        "tollgate_decisions_total{limit=\"chat-per-shop\",outcome=\"bypassed\"} 1",
        "tollgate_decisions_total{limit=\"tokens-per-shop\",outcome=\"fallback\"} 1",
        "tollgate_canary_ok{backend=\"redis\"} 0",
        "tollgate_canary_interval_seconds{backend=\"redis\"} 10",
        "tollgate_config_reloads_total{result=\"error\"} 1",
        "tollgate_backend_up{backend=\"redis\"} 0",
        // Admissions that left at most 20 % of the burst of 30: remaining 6 down to 0.
        "tollgate_near_limit_total{limit=\"chat-per-shop\"} 7",
        "tollgate_lease_admissions_total{limit=\"chat-per-shop\"} 0",
        "tollgate_capacity_refusals_total{limit=\"chat-per-shop\"} 0",
        "tollgate_delay_seconds_count{limit=\"chat-in-flight\"} 0",
    ] {
        assert!(text.lines().any(|l| l == line), "no {line:?} in\n{text}");
    }

    // Exactly one settle dropped: the tokens' (its reason, `failed` or `circuit_open`, is
    // whichever the stopped server's first failure made it).
    let dropped: f64 = text
        .lines()
        .filter(|l| l.starts_with("tollgate_settles_dropped_total{limit=\"tokens-per-shop\""))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap())
        .sum();
    assert_eq!(dropped, 1.0, "{text}");
    assert!(!text.contains("tollgate_settles_dropped_total{limit=\"chat"));

    // Three families the example never increments are in the scrape all the same, at 0: the
    // layer registers them with a limit's first request. llm_chat has no lease
    // (`tollgate_lease_admissions_total`), no in-memory key cap
    // (`tollgate_capacity_refusals_total`) and no delayed or queued limit
    // (`tollgate_delay_seconds`, a summary: its quantiles, `_sum` and `_count`).
    let scraped = scraped_names(&text);
    let mut missing = Vec::new();
    for (path, file) in deploy_texts() {
        let named = named_metrics(&file);
        assert!(!named.is_empty(), "{} names no metric", path.display());
        for name in named {
            if !scraped.contains(&name) {
                missing.push(format!("{}: {name}", path.display()));
            }
        }
        // The test inputs' label values are examples of what exports; the rules' and the
        // dashboard's selections must all exist.
        if path.to_string_lossy().ends_with(".test.yml") {
            continue;
        }
        for label in SELECTED_LABELS {
            for value in selected_values(&file, label) {
                if !text.contains(&format!("{label}=\"{value}\"")) {
                    missing.push(format!("{}: {label}=\"{value}\"", path.display()));
                }
            }
        }
    }
    assert!(
        missing.is_empty(),
        "named but not exported:\n{}\nscrape:\n{text}",
        missing.join("\n")
    );
}

#[test]
fn names_and_selections_are_read_from_the_files() {
    let text = "sum(rate(tollgate_bypass_total[5m])) / x_tollgate_no{outcome=~\"denied|blocked\"} \
                tollgate_delay_seconds_sum{quantile=\"0.99\",result!=\"ok\"}";
    assert_eq!(
        named_metrics(text).into_iter().collect::<Vec<_>>(),
        ["tollgate_bypass_total", "tollgate_delay_seconds_sum"]
    );
    assert_eq!(
        selected_values(text, "outcome")
            .into_iter()
            .collect::<Vec<_>>(),
        ["blocked", "denied"]
    );
    assert_eq!(
        selected_values(text, "result")
            .into_iter()
            .collect::<Vec<_>>(),
        ["ok"]
    );
    assert_eq!(
        scraped_names("# TYPE a counter\na_total{x=\"1\"} 3\nb 1\n")
            .into_iter()
            .collect::<Vec<_>>(),
        ["a_total", "b"]
    );
}
