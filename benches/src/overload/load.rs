//! The open-loop load generator: requests leave at a fixed rate whatever the answers, each in
//! a task of its own with a deadline, over pooled HTTP/1.1 connections (a connection whose
//! request timed out is closed, and a new one opened when none is idle).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use http_body_util::{BodyExt, Empty};
use hyper::body::Bytes;
use hyper::{Method, Request, StatusCode, Uri};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::phases::Phase;
use super::server::{LIMIT_PATH, SERVICE_TIME_PATH};
use super::{Capacity, Class, PRIORITY_HEADER};

type HttpClient = Client<HttpConnector, Empty<Bytes>>;

/// What became of one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// A 2xx answer, whole, within the deadline.
    Ok,
    /// Refused by a limiter: 429 or 503.
    Refused,
    /// Another status.
    Failed,
    /// No whole answer within the deadline.
    Timeout,
    /// A connection or protocol error.
    Error,
}

/// One request sent.
#[derive(Clone, Copy, Debug)]
pub struct Sample {
    /// The index of its phase.
    pub phase: usize,
    /// Its class.
    pub class: Class,
    /// When it was due, from the start of its phase.
    pub sent: Duration,
    /// From when it was due to its outcome (so a late start counts against it).
    pub latency: Duration,
    /// How late the load generator started it: a figure of the generator's health, not of the
    /// server's.
    pub late: Duration,
    /// What became of it.
    pub outcome: Outcome,
}

/// A run against one server.
#[derive(Debug)]
pub struct Run {
    /// Every request sent in the phases (not those of the warm-up).
    pub samples: Vec<Sample>,
    /// The server's CPU time (all threads, user and system) during each phase, when it could
    /// be read.
    pub cpu: Vec<Option<Duration>>,
    /// The adaptive limit's value, read every 100 ms, when the system has one.
    pub limits: Vec<LimitSample>,
}

/// An adaptive limit's value at one moment.
#[derive(Clone, Copy, Debug)]
pub struct LimitSample {
    /// The index of the phase it was read in.
    pub phase: usize,
    /// When, from the start of the phase.
    pub at: Duration,
    /// The limit.
    pub limit: usize,
}

/// How the load is sent.
#[derive(Clone, Copy, Debug)]
pub struct Settings {
    /// The server's capacity, that the phases' loads are multiples of.
    pub capacity: Capacity,
    /// A request without a whole answer by then has failed.
    pub timeout: Duration,
    /// Load at 0.5× C before the first phase, not counted.
    pub warmup: Duration,
    /// How the classes share a phase's load.
    pub mix: Mix,
}

/// How the classes share a phase's load.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mix {
    /// 20% critical, 50% default, 30% batch at every load up to 0.5× C; above it, critical
    /// requests keep the rate they have at 0.5× C (0.1× C) and the rest of the load is default
    /// and batch, 5 to 3: a spike of the traffic that can wait, as when a client's prefetches
    /// or a batch job floods a service while its users' requests go on. (At 10× C, 20% of the
    /// load would be twice what the server can do for critical requests alone: no limiter
    /// could serve them all.)
    Spike,
    /// 20% critical, 50% default, 30% batch at every load.
    Fixed,
}

impl Mix {
    /// `spike` or `fixed`.
    pub fn parse(name: &str) -> Option<Mix> {
        match name {
            "spike" => Some(Mix::Spike),
            "fixed" => Some(Mix::Fixed),
            _ => None,
        }
    }

    /// The class of the `i`th request of a segment sent at `rate` requests per second (the
    /// `n`th of the run), for a server of capacity `c` requests per second.
    fn class(self, i: u64, n: u64, rate: f64, c: f64) -> Class {
        let critical = 0.1 * c;
        if self == Mix::Fixed || rate <= 0.5 * c * (1.0 + 1e-9) {
            return Class::nth(n);
        }
        // Critical requests spread evenly at their own rate; the others 5 default to 3 batch.
        let share = critical / rate;
        let before = (i as f64 * share).floor() as u64;
        if ((i + 1) as f64 * share).floor() as u64 > before {
            return Class::Critical;
        }
        match (i - before) % 8 {
            1 | 4 | 6 => Class::Batch,
            _ => Class::Default,
        }
    }
}

/// The server a run is sent to.
#[derive(Clone, Copy, Debug)]
pub struct Target {
    /// Its port on 127.0.0.1.
    pub port: u16,
    /// Its process, whose CPU time is read.
    pub pid: u32,
}

struct Segment {
    /// `None` for the warm-up.
    phase: Option<usize>,
    rate: f64,
    length: Duration,
    slowdown: u32,
}

/// Sends the warm-up then `phases` to `target`, and waits for every request's outcome.
///
/// # Errors
///
/// When the server's service time cannot be set (its control route fails).
pub async fn run(target: Target, settings: Settings, phases: &[Phase]) -> Result<Run, String> {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let client: HttpClient = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(usize::MAX)
        .build(connector);
    let base = format!("http://127.0.0.1:{}", target.port);
    let uri: Uri = format!("{base}/")
        .parse()
        .map_err(|e| format!("{base}/: {e}"))?;

    let c = settings.capacity.per_second();
    let warmup = Segment {
        phase: None,
        rate: 0.5 * c,
        length: settings.warmup,
        slowdown: 1,
    };
    let segments = std::iter::once(warmup).chain(phases.iter().enumerate().map(|(i, p)| Segment {
        phase: Some(i),
        rate: p.load * c,
        length: p.length,
        slowdown: p.slowdown,
    }));

    let stop = Arc::new(AtomicBool::new(false));
    let poller = tokio::spawn(poll_limit(
        client.clone(),
        format!("{base}{LIMIT_PATH}"),
        Arc::clone(&stop),
    ));
    let mut phase_starts = Vec::new();
    let mut tasks = JoinSet::new();
    let mut samples = Vec::new();
    let mut cpu_marks = Vec::new();
    let mut slowdown = 1;
    let mut n = 0_u64;
    let mut start = Instant::now();
    for segment in segments {
        if segment.slowdown != slowdown {
            slowdown = segment.slowdown;
            let service = settings.capacity.service * slowdown;
            set_service(&client, &base, service).await?;
        }
        if segment.phase.is_some() {
            cpu_marks.push(cpu_time(target.pid));
            phase_starts.push((start, segment.length));
        }
        let end = start + segment.length;
        let total = (segment.rate * segment.length.as_secs_f64()).round() as u64;
        let mut i = 0;
        loop {
            let now = Instant::now();
            let due = if now >= end {
                total
            } else {
                ((now - start).as_secs_f64() * segment.rate) as u64 + 1
            };
            while i < due.min(total) {
                let at = start + Duration::from_secs_f64(i as f64 / segment.rate);
                let request = Planned {
                    phase: segment.phase,
                    class: settings.mix.class(i, n, segment.rate, c),
                    at,
                    sent: at - start,
                    deadline: at + settings.timeout,
                };
                tasks.spawn(send(client.clone(), uri.clone(), request));
                i += 1;
                n += 1;
            }
            while let Some(done) = tasks.try_join_next() {
                samples.extend(done.ok().flatten());
            }
            if now >= end {
                break;
            }
            tokio::time::sleep_until((now + Duration::from_millis(1)).min(end)).await;
        }
        start = end;
    }
    cpu_marks.push(cpu_time(target.pid));
    stop.store(true, Ordering::Relaxed);
    while let Some(done) = tasks.join_next().await {
        samples.extend(done.ok().flatten());
    }
    let cpu = cpu_marks
        .windows(2)
        .map(|w| match (w[0], w[1]) {
            (Some(a), Some(b)) => b.checked_sub(a),
            _ => None,
        })
        .collect();
    let limits = poller
        .await
        .unwrap_or_default()
        .into_iter()
        .filter_map(|(at, limit)| {
            let phase = phase_starts
                .iter()
                .position(|&(start, length)| at >= start && at < start + length)?;
            let at = at - phase_starts[phase].0;
            Some(LimitSample { phase, at, limit })
        })
        .collect();
    Ok(Run {
        samples,
        cpu,
        limits,
    })
}

/// Reads the server's adaptive limit every 100 ms until `stop`; nothing when the server has
/// none (404).
async fn poll_limit(
    client: HttpClient,
    uri: String,
    stop: Arc<AtomicBool>,
) -> Vec<(Instant, usize)> {
    let mut read = Vec::new();
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    while !stop.load(Ordering::Relaxed) {
        tick.tick().await;
        let Ok(request) = Request::builder().uri(&uri).body(Empty::new()) else {
            break;
        };
        let answer = tokio::time::timeout(Duration::from_millis(500), async {
            let response = client.request(request).await.ok()?;
            let status = response.status();
            let body = response.into_body().collect().await.ok()?.to_bytes();
            Some((status, body))
        })
        .await;
        match answer {
            Ok(Some((StatusCode::NOT_FOUND, _))) => break,
            Ok(Some((status, body))) if status.is_success() => {
                let limit = std::str::from_utf8(&body).ok().and_then(|t| t.parse().ok());
                read.extend(limit.map(|l| (Instant::now(), l)));
            }
            _ => {}
        }
    }
    read
}

struct Planned {
    phase: Option<usize>,
    class: Class,
    at: Instant,
    sent: Duration,
    deadline: Instant,
}

/// One request; `None` for the warm-up's, which count for nothing.
async fn send(client: HttpClient, uri: Uri, planned: Planned) -> Option<Sample> {
    let started = Instant::now();
    let request = Request::builder()
        .uri(uri)
        .header(PRIORITY_HEADER, planned.class.name())
        .body(Empty::new());
    let outcome = match request {
        Err(_) => Outcome::Error,
        Ok(request) => {
            match tokio::time::timeout_at(planned.deadline, exchange(&client, request)).await {
                Err(_) => Outcome::Timeout,
                // Polled only after its deadline: the answer came too late.
                Ok(_) if Instant::now() > planned.deadline => Outcome::Timeout,
                Ok(Err(_)) => Outcome::Error,
                Ok(Ok(status)) if status.is_success() => Outcome::Ok,
                Ok(Ok(StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE)) => {
                    Outcome::Refused
                }
                Ok(Ok(_)) => Outcome::Failed,
            }
        }
    };
    Some(Sample {
        phase: planned.phase?,
        class: planned.class,
        sent: planned.sent,
        latency: Instant::now().saturating_duration_since(planned.at),
        late: started.saturating_duration_since(planned.at),
        outcome,
    })
}

/// Sends `request` and reads its answer to the end.
async fn exchange(
    client: &HttpClient,
    request: Request<Empty<Bytes>>,
) -> Result<StatusCode, Box<dyn std::error::Error + Send + Sync>> {
    let response = client.request(request).await?;
    let status = response.status();
    response.into_body().collect().await?;
    Ok(status)
}

/// Sets the server's service time through its control route.
async fn set_service(client: &HttpClient, base: &str, service: Duration) -> Result<(), String> {
    let path = format!("{base}{SERVICE_TIME_PATH}/{}", service.as_micros());
    let request = Request::builder()
        .method(Method::POST)
        .uri(&path)
        .body(Empty::new())
        .map_err(|e| format!("{path}: {e}"))?;
    match tokio::time::timeout(Duration::from_secs(5), exchange(client, request)).await {
        Ok(Ok(status)) if status.is_success() => Ok(()),
        Ok(Ok(status)) => Err(format!("{path}: {status}")),
        Ok(Err(e)) => Err(format!("{path}: {e}")),
        Err(_) => Err(format!("{path}: no answer within 5 s")),
    }
}

/// A process's CPU time so far, all its threads, in nanoseconds of run time
/// (`/proc/<pid>/task/*/schedstat`, whose first field is the time a thread has run): finer
/// than the clock ticks of `/proc/<pid>/stat`. Threads that have ended no longer count, which
/// the server's (a fixed tokio pool) do not.
fn cpu_time(pid: u32) -> Option<Duration> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).ok()?;
    let mut ns = 0_u64;
    for task in tasks.flatten() {
        let stat = std::fs::read_to_string(task.path().join("schedstat")).ok()?;
        ns += stat.split(' ').next()?.parse::<u64>().ok()?;
    }
    Some(Duration::from_nanos(ns))
}
