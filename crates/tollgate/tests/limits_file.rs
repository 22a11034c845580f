//! The limits file's delays, queues and penalty boxes: what each reads as, where each mistake
//! is said (line, column, and the limit's name), and each through a layer built from a file,
//! in memory, on a `FakeClock` that stands still (every check at the same instant, so every
//! figure is exact) and tokio's paused clock.

#![allow(clippy::unwrap_used)]

mod support;

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use tokio::time::Instant;
use tollgate::engine::{DEFAULT_MAX_WAITING, DEFAULT_SLOT_TTL};
use tollgate::{
    Algorithm, Decision, DenyReason, FakeClock, Limits, LimitsFile, LimitsFileError, MemoryBackend,
    Outcome, RateLimitLayer,
};
use tower::{Service, ServiceExt};

use support::{Res, Started};

fn parse(text: &str) -> Limits {
    LimitsFile::new().parse(text).unwrap()
}

fn error(text: &str) -> LimitsFileError {
    match LimitsFile::new().parse(text) {
        Ok(_) => panic!("accepted:\n{text}"),
        Err(e) => e,
    }
}

fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

// What each reads as.

#[test]
fn a_delay_and_its_bound_read_as_the_builder_s() {
    let text = "[[limit]]\nname = \"chat\"\nperiod = \"1s\"\nkey = \"ip\"\nquota = 5\n\
                delay = \"2s\"\nmax_waiting = 16\n";
    let limits = parse(text);
    let (chat, _) = limits.get("chat").unwrap();
    assert_eq!((chat.delay(), chat.waiting_bound()), (secs(2), 16));
    // Without `max_waiting`, the builder's bound.
    let limits = parse(
        &text
            .replace("max_waiting = 16\n", "")
            .replace("2s", "500ms"),
    );
    let (chat, _) = limits.get("chat").unwrap();
    assert_eq!(
        (chat.delay(), chat.waiting_bound()),
        (ms(500), DEFAULT_MAX_WAITING)
    );
    // A limit that says nothing never waits.
    let limits = parse("[[limit]]\nname = \"a\"\nperiod = \"1s\"\nkey = \"ip\"\nquota = 5\n");
    let (a, _) = limits.get("a").unwrap();
    assert_eq!(
        (a.delay(), a.queue(), a.penalty_box()),
        (Duration::ZERO, Duration::ZERO, None)
    );
}

#[test]
fn a_concurrency_limit_and_its_queue_read_as_the_builder_s() {
    let text = "[[limit]]\nname = \"exports\"\nalgorithm = \"concurrency\"\nkey = \"ip\"\n\
                quota = 2\nqueue = { wait = \"10s\", max_waiting = 8 }\n";
    let limits = parse(text);
    let (exports, _) = limits.get("exports").unwrap();
    assert_eq!(exports.algorithm(), Algorithm::Concurrency);
    assert_eq!(exports.quota().limit(), 2);
    assert_eq!(exports.quota().period(), DEFAULT_SLOT_TTL);
    assert_eq!((exports.queue(), exports.waiting_bound()), (secs(10), 8));
    let limits = parse(&text.replace(", max_waiting = 8", ""));
    let (exports, _) = limits.get("exports").unwrap();
    assert_eq!(
        (exports.queue(), exports.waiting_bound()),
        (secs(10), DEFAULT_MAX_WAITING)
    );
    // With plans and a slot lifetime: every plan's slots live as long.
    let text = "[[limit]]\nname = \"exports\"\nalgorithm = \"concurrency\"\nkey = \"ip\"\n\
                slot_ttl = \"1m\"\n[limit.quota]\ndefault = 2\npro = 8\n";
    let limits = parse(text);
    let (exports, _) = limits.get("exports").unwrap();
    assert_eq!(exports.queue(), Duration::ZERO);
    let quotas: Vec<(u32, Duration)> = [None, Some("pro")]
        .into_iter()
        .map(|plan| exports.quota_of(plan).1)
        .map(|q| (q.limit(), q.period()))
        .collect();
    assert_eq!(quotas, [(2, secs(60)), (8, secs(60))]);
}

#[test]
fn a_penalty_reads_as_the_builder_s() {
    let text = "[[limit]]\nname = \"login\"\nperiod = \"1m\"\nkey = \"ip\"\nquota = 5\n\
                penalty = { after = 3, within = \"1m\", block = \"10m\", max = \"1h\" }\n";
    let limits = parse(text);
    let p = *limits.get("login").unwrap().0.penalty_box().unwrap();
    assert_eq!(
        (p.refusals(), p.window(), p.block(), p.max_block()),
        (3, secs(60), secs(600), secs(3_600))
    );
    // Without `max`, blocks do not escalate.
    let limits = parse(&text.replace(", max = \"1h\"", ""));
    let p = *limits.get("login").unwrap().0.penalty_box().unwrap();
    assert_eq!((p.block(), p.max_block()), (secs(600), secs(600)));
}

// Where each mistake is said.

/// A limit of lines 1 to 5 (`extra` replaces none of them), then `extra`'s lines from 6.
fn limit_with(head: &[&str], extra: &[&str]) -> String {
    let mut lines: Vec<&str> = vec!["[[limit]]", "name = \"a\""];
    lines.extend_from_slice(head);
    lines.extend_from_slice(extra);
    lines.join("\n") + "\n"
}

const GCRA: [&str; 3] = ["period = \"1s\"", "key = \"ip\"", "quota = 5"];
const CONCURRENCY: [&str; 3] = ["algorithm = \"concurrency\"", "key = \"ip\"", "quota = 2"];

/// Each case: the lines after the first five, the line and column of the mistake, and what
/// the error says.
fn assert_errors(head: &[&str], cases: &[(&[&str], usize, usize, &str)]) {
    for &(extra, line, column, message) in cases {
        let text = limit_with(head, extra);
        let e = error(&text);
        assert_eq!((e.line(), e.column()), (line, column), "{text}{e}");
        assert_eq!(e.message(), message, "{text}");
    }
}

#[test]
fn a_delay_mistake_is_at_its_value() {
    assert_errors(
        &GCRA,
        &[
            (
                &["delay = \"2 s\""],
                6,
                9,
                "limit \"a\": delay \"2 s\" must be a number and a unit (ms, s, m, h, d)",
            ),
            (
                &["delay = \"99999d\""],
                6,
                9,
                "limit \"a\": invalid delay: a delay must not exceed 100 years",
            ),
            (
                &["delay = \"2s\"", "max_waiting = 0"],
                7,
                15,
                "limit \"a\": invalid delay: max_waiting must be at least 1",
            ),
            (
                &["max_waiting = 5"],
                6,
                15,
                "limit \"a\": `max_waiting` bounds the requests a `delay` makes wait: it needs \
                 one (a queue takes its own: queue = { wait = \"5s\", max_waiting = N })",
            ),
            (
                &["delay = 2"],
                6,
                9,
                "limit \"a\": invalid type: integer `2`, expected a string",
            ),
        ],
    );
    // A fixed window or a sliding log has no exact delay.
    for algorithm in ["fixed_window", "sliding_log"] {
        let head = [
            &format!("algorithm = \"{algorithm}\"") as &str,
            GCRA[0],
            GCRA[1],
            GCRA[2],
        ];
        let e = error(&limit_with(&head, &["delay = \"2s\""]));
        assert_eq!((e.line(), e.column()), (7, 9), "{e}");
        assert_eq!(
            e.message(),
            format!(
                "limit \"a\": a {algorithm} limit cannot delay requests: only GCRA reserves an \
                 emission time (a concurrency limit can queue them instead)"
            )
        );
    }
}

#[test]
fn a_queue_mistake_is_at_its_value() {
    assert_errors(
        &CONCURRENCY,
        &[
            (
                &["queue = { wait = \"5 s\", max_waiting = 3 }"],
                6,
                18,
                "limit \"a\": wait \"5 s\" must be a number and a unit (ms, s, m, h, d)",
            ),
            (
                &["queue = { wait = \"5s\", max_waiting = 0 }"],
                6,
                38,
                "limit \"a\": invalid delay: max_waiting must be at least 1",
            ),
            (
                &["queue = { wait = \"5s\",", "  max = 3 }"],
                7,
                3,
                "limit \"a\": unknown field `max`, expected `wait` or `max_waiting`",
            ),
            (
                &["queue = { max_waiting = 3 }"],
                6,
                9,
                "limit \"a\": missing field `wait`",
            ),
            (
                &["delay = \"2s\""],
                6,
                9,
                "limit \"a\": a concurrency limit cannot delay requests: only GCRA reserves an \
                 emission time (a concurrency limit can queue them instead)",
            ),
            (
                &["period = \"1m\""],
                6,
                10,
                "limit \"a\": a concurrency limit has no period: its quota is requests in \
                 flight (`slot_ttl` says how long a slot lives unless renewed)",
            ),
            (
                &["slot_ttl = \"500ms\""],
                6,
                12,
                "limit \"a\": a slot_ttl must be 1s or longer (a slot is renewed every third of it)",
            ),
            (
                &["cost = 2"],
                6,
                8,
                "limit \"a\": cost 2 is invalid: it must be between 1 and 1",
            ),
        ],
    );
    // A rate limit's units come back with time: it has no queue, no slot lifetime.
    assert_errors(
        &GCRA,
        &[
            (
                &["queue = { wait = \"5s\" }"],
                6,
                9,
                "limit \"a\": a gcra limit cannot queue requests: only a concurrency limit \
                 waits for a slot (GCRA can delay them instead)",
            ),
            (
                &["slot_ttl = \"1m\""],
                6,
                12,
                "limit \"a\": only a concurrency limit has a `slot_ttl`",
            ),
        ],
    );
    // Without `period`, at its `[[limit]]`.
    let e = error(&limit_with(&GCRA[1..], &[]));
    assert_eq!((e.line(), e.column()), (1, 1), "{e}");
    assert_eq!(
        e.message(),
        "limit \"a\": a limit needs a `period` (\"1m\", \"1h\", ...)"
    );
}

#[test]
fn a_penalty_mistake_is_at_its_value() {
    let penalty = |fields: &str| format!("penalty = {{ {fields} }}");
    let cases = [
        (
            penalty("after = 0, within = \"1m\", block = \"10m\""),
            21,
            "invalid penalty: a penalty needs at least one refusal",
        ),
        (
            penalty("after = 3, within = \"0s\", block = \"10m\""),
            33,
            "invalid penalty: a penalty's window and block must be longer than zero",
        ),
        (
            penalty("after = 3, within = \"1m\", block = \"10 m\""),
            47,
            "block \"10 m\" must be a number and a unit (ms, s, m, h, d)",
        ),
        (
            penalty("after = 3, within = \"1m\", block = \"99999d\""),
            47,
            "invalid penalty: a penalty's window and block must not exceed 100 years",
        ),
        (
            penalty("after = 3, within = \"1m\", block = \"10m\", max = \"5m\""),
            60,
            "invalid penalty: a penalty's longest block must not be shorter than its first",
        ),
        (
            penalty("after = 3, within = \"1m\""),
            11,
            "missing field `block`",
        ),
        (
            penalty("after = 3, within = \"1m\", block = \"10m\", escalate = \"1h\""),
            54,
            "unknown field `escalate`, expected one of `after`, `within`, `block`, `max`",
        ),
        (
            penalty("after = -1, within = \"1m\", block = \"10m\""),
            21,
            "invalid value: integer `-1`, expected u32",
        ),
    ];
    for (line, column, message) in &cases {
        let text = limit_with(&GCRA, &[line]);
        let e = error(&text);
        assert_eq!((e.line(), e.column()), (6, *column), "{text}{e}");
        assert_eq!(e.message(), format!("limit \"a\": {message}"), "{text}");
    }
    // A busy key is not misbehaving.
    let text = limit_with(&CONCURRENCY, &[&cases[4].0.replace(", max = \"5m\"", "")]);
    let e = error(&text);
    assert_eq!((e.line(), e.column()), (6, 11), "{e}");
    assert_eq!(
        e.message(),
        "limit \"a\": this limit cannot have a penalty: a concurrency limit's refusals are busy \
         keys, not misbehaving ones"
    );
}

// Through a layer built from a file.

fn memory() -> (MemoryBackend<FakeClock>, FakeClock) {
    let clock = FakeClock::new(1_700_000_000_000_000);
    let backend = MemoryBackend::builder().clock(clock.clone()).build();
    (backend, clock)
}

fn req(id: usize) -> Request<Full<Bytes>> {
    Request::builder()
        .header("x-id", id.to_string())
        .body(Full::new(Bytes::new()))
        .unwrap()
}

/// Sends `n` requests at once (each decided, or put in line, as it is called) and waits for
/// every answer; each body is dropped at once, so its slot goes back.
async fn concurrently<S>(svc: &mut S, n: usize) -> Vec<(u16, Duration)>
where
    S: Service<Request<Full<Bytes>>, Response = Res, Error = Infallible>,
    S::Future: Send + 'static,
{
    let start = Instant::now();
    let mut tasks = Vec::new();
    for id in 0..n {
        let fut = svc.ready().await.unwrap().call(req(id));
        tasks.push(tokio::spawn(async move {
            let status = fut.await.unwrap().status().as_u16();
            (status, start.elapsed())
        }));
    }
    let mut out = Vec::new();
    for task in tasks {
        out.push(task.await.unwrap());
    }
    out
}

fn starts(started: &Started) -> Vec<(usize, Duration)> {
    let mut s = started.lock().unwrap().clone();
    s.sort();
    s
}

#[tokio::test(start_paused = true)]
async fn a_delay_from_the_file_makes_requests_wait_for_their_time() {
    // One a second, burst 1, up to 2 s of delay: the first at once, the next two at 1 and
    // 2 s, the fourth (3 s) refused.
    let text = "[[limit]]\nname = \"chat\"\nperiod = \"1s\"\nkey = \"global\"\nquota = 1\n\
                delay = \"2s\"\n";
    let (status, started) = four_at_once(text).await;
    assert_eq!(status, [200, 200, 200, 429]);
    assert_eq!(starts(&started), [(0, secs(0)), (1, secs(1)), (2, secs(2))]);

    // With `max_waiting = 1`, one request of the key waits; the next is checked without the
    // delay, and refused.
    let (status, started) = four_at_once(&format!("{text}max_waiting = 1\n")).await;
    assert_eq!(status, [200, 200, 429, 429]);
    assert_eq!(starts(&started), [(0, secs(0)), (1, secs(1))]);
}

/// Four requests at once through a layer of the limits in `text` on memory: their statuses,
/// and when each that got through started.
async fn four_at_once(text: &str) -> (Vec<u16>, Started) {
    let (backend, _) = memory();
    let layer = RateLimitLayer::builder()
        .limits(parse(text))
        .backend(backend)
        .build()
        .unwrap();
    let started = Started::default();
    let mut svc = support::recording(&layer, Instant::now(), Arc::clone(&started), Duration::ZERO);
    let status = concurrently(&mut svc, 4)
        .await
        .iter()
        .map(|a| a.0)
        .collect();
    (status, started)
}

#[tokio::test(start_paused = true)]
async fn a_queue_from_the_file_serves_a_full_key_s_requests_in_turn() {
    // One in flight, each held 100 ms; two may wait up to 1 s: the fourth finds the line full
    // and is refused at once.
    let text = "[[limit]]\nname = \"exports\"\nalgorithm = \"concurrency\"\nkey = \"global\"\n\
                quota = 1\nqueue = { wait = \"1s\", max_waiting = 2 }\n";
    let (backend, _) = memory();
    let layer = RateLimitLayer::builder()
        .limits(parse(text))
        .backend(backend)
        .build()
        .unwrap();
    let started = Started::default();
    let mut svc = support::recording(&layer, Instant::now(), Arc::clone(&started), ms(100));
    let answers = concurrently(&mut svc, 4).await;
    assert_eq!(
        answers,
        [(200, ms(100)), (200, ms(200)), (200, ms(300)), (429, ms(0))]
    );
    assert_eq!(starts(&started), [(0, ms(0)), (1, ms(100)), (2, ms(200))]);
}

/// One request's status, its `Retry-After` in seconds, and why the limit refused it.
async fn one<S>(svc: &mut S) -> (u16, Option<u64>, Option<DenyReason>)
where
    S: Service<Request<Full<Bytes>>, Response = Res, Error = Infallible>,
{
    let res = svc.ready().await.unwrap().call(req(0)).await.unwrap();
    let retry = res
        .headers()
        .get("retry-after")
        .map(|v| v.to_str().unwrap().parse().unwrap());
    let decision = res.extensions().get::<Decision>().unwrap();
    let reason = match decision.limits()[0].outcome() {
        Outcome::Denied { reason, .. } => Some(*reason),
        _ => None,
    };
    (res.status().as_u16(), retry, reason)
}

const LOGIN: &str = "[[limit]]\nname = \"login\"\nperiod = \"1m\"\nkey = \"global\"\nquota = 1\n";

#[tokio::test(start_paused = true)]
async fn a_penalty_from_the_file_blocks_at_exactly_the_n_th_refusal() {
    let text = format!(
        "{LOGIN}penalty = {{ after = 3, within = \"1m\", block = \"10m\", max = \"1h\" }}\n"
    );
    let (backend, clock) = memory();
    let layer = RateLimitLayer::builder()
        .limits(parse(&text))
        .backend(backend)
        .build()
        .unwrap();
    let mut svc = support::recording(&layer, Instant::now(), Started::default(), Duration::ZERO);
    let over = Some(DenyReason::OverLimit);
    let blocked = Some(DenyReason::Blocked);
    let mut answers = Vec::new();
    for _ in 0..5 {
        answers.push(one(&mut svc).await);
    }
    // Admitted, refused twice (a minute to wait), and the third refusal starts a 10-minute
    // block, which the next request meets too.
    assert_eq!(
        answers,
        [
            (200, None, None),
            (429, Some(60), over),
            (429, Some(60), over),
            (429, Some(600), blocked),
            (429, Some(600), blocked),
        ]
    );
    clock.advance(secs(599));
    assert_eq!(one(&mut svc).await, (429, Some(1), blocked));
    clock.advance(secs(1));
    assert_eq!(one(&mut svc).await, (200, None, None));
    // Three refusals more while the first block is remembered: the next one is twice as
    // long (`max = "1h"`).
    for _ in 0..2 {
        assert_eq!(one(&mut svc).await, (429, Some(60), over));
    }
    assert_eq!(one(&mut svc).await, (429, Some(1_200), blocked));
}

#[tokio::test(start_paused = true)]
async fn a_reload_from_the_file_changes_the_penalty_s_refusals() {
    let file = |after: u32| {
        parse(&format!(
            "{LOGIN}penalty = {{ after = {after}, within = \"1m\", block = \"10m\" }}\n"
        ))
    };
    let (backend, _) = memory();
    let layer = RateLimitLayer::builder()
        .limits(file(3))
        .backend(backend)
        .build()
        .unwrap();
    let mut svc = support::recording(&layer, Instant::now(), Started::default(), Duration::ZERO);
    let over = Some(DenyReason::OverLimit);
    assert_eq!(one(&mut svc).await, (200, None, None));
    assert_eq!(one(&mut svc).await, (429, Some(60), over));
    // Under `after = 3` the next refusal would be a plain one; under 2, it is the second
    // within the minute, and starts the block.
    layer.reloader().reload(file(2)).unwrap();
    assert_eq!(
        layer.limits()[0].penalty_box().map(|p| p.refusals()),
        Some(2)
    );
    assert_eq!(
        one(&mut svc).await,
        (429, Some(600), Some(DenyReason::Blocked))
    );
}

#[test]
fn a_field_of_the_wrong_shape_names_the_limit_it_is_in() {
    let text = "[[limit]]\nname = \"a\"\nperiod = \"1s\"\nkey = \"ip\"\nquota = 5\n\n\
                [[limit]]\nname = \"b\"\nperiod = \"1s\"\nkey = \"ip\"\n[limit.quota]\n\
                default = 5\npenalty = { after = 3 }\n\n\
                [[allowlist]]\nkey = \"ip\"\nnetworks = [\"10.0.0.0/8\"]\n";
    // In `b`'s quota table (a table's fields follow its header), `penalty` is a plan.
    let e = error(text);
    assert_eq!((e.line(), e.column()), (13, 11), "{e}");
    assert_eq!(
        e.message(),
        "limit \"b\": a quota is a number, or { limit = N, burst = M } (`penalty` is a field \
         of the limit: write it above `[limit.quota]`, whose lines are plans)"
    );
    // In the allowlist, after every limit: no limit's name.
    let text = text.replace("penalty = { after = 3 }\n", "") + "value = []\n";
    let e = error(&text);
    assert_eq!((e.line(), e.column()), (17, 1), "{e}");
    assert_eq!(
        e.message(),
        "unknown field `value`, expected one of `key`, `networks`, `values`"
    );
}

#[test]
fn a_field_misspelt_below_the_quota_table_is_no_plan() {
    let text = "[[limit]]\nname = \"api\"\nperiod = \"1m\"\nkey = \"ip\"\n[limit.quota]\n\
                default = 5\nqota = 3\n";
    let e = error(text);
    assert_eq!((e.line(), e.column()), (7, 1), "{e}");
    assert_eq!(
        e.message(),
        "limit \"api\": plan \"qota\" is one edit from `quota`: did you mean `quota`? A plan \
         cannot be named like a field of the limit (below `[limit.quota]` each line is a plan)"
    );
    // A field's own name, with a value that is a quota, is no plan either.
    let e = error(&text.replace("qota = 3", "shadow = 3"));
    assert_eq!((e.line(), e.column()), (7, 1), "{e}");
    assert_eq!(
        e.message(),
        "limit \"api\": `shadow` is a field of the limit, read here as a plan: write it above \
         `[limit.quota]`, whose lines are plans"
    );
    // A plan with a name of its own is one.
    let limits = parse(&text.replace("qota = 3", "pro = 3"));
    assert_eq!(limits.len(), 1);
}

#[test]
fn a_key_given_twice_is_named_with_its_limit() {
    let text = "[[limit]]\nname = \"api\"\nperiod = \"1m\"\nkey = \"ip\"\nquota = 5\n\
                period = \"1h\"\n";
    let e = error(text);
    assert_eq!((e.line(), e.column()), (6, 1), "{e}");
    assert_eq!(
        e.message(),
        "limit \"api\": `period` is given twice (duplicate key)"
    );
    // A plan given twice, in the second limit.
    let text = "[[limit]]\nname = \"a\"\nperiod = \"1m\"\nkey = \"ip\"\nquota = 5\n\n\
                [[limit]]\nname = \"b\"\nperiod = \"1m\"\nkey = \"ip\"\n[limit.quota]\n\
                default = 5\npro = 10\npro = 20\n";
    let e = error(text);
    assert_eq!((e.line(), e.column()), (14, 1), "{e}");
    assert_eq!(
        e.message(),
        "limit \"b\": `pro` is given twice (duplicate key)"
    );
}
