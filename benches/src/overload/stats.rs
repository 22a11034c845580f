//! The figures of each phase of a run, and the tables and lines they are printed as.

use std::fmt::Write as _;
use std::time::Duration;

use super::load::{Outcome, Run, Sample};
use super::phases::{Phase, AFTER_SPIKE, SPIKE, STEADY};
use super::Class;

/// The window the recovery judges critical requests' p99 in, and its step.
const WINDOW: Duration = Duration::from_secs(1);
const STEP: Duration = Duration::from_millis(100);

/// The figures of one phase of one system.
#[derive(Clone, Debug)]
pub struct Row {
    /// The system's name.
    pub system: &'static str,
    /// The phase's name.
    pub phase: &'static str,
    /// Requests sent.
    pub sent: usize,
    /// Requests sent per second.
    pub rate: f64,
    /// Per class (in [`Class::ALL`]'s order), the share of its requests answered 2xx within
    /// the deadline, in percent; `None` when none was sent.
    pub success: [Option<f64>; 3],
    /// Requests answered 2xx within the deadline, per second, as a share of the capacity, in
    /// percent.
    pub goodput: f64,
    /// The median latency of requests answered 2xx.
    pub p50: Option<Duration>,
    /// The 99th percentile latency of requests answered 2xx.
    pub p99: Option<Duration>,
    /// `p99` over the unloaded p99.
    pub p99_unloaded: Option<f64>,
    /// Requests refused (429 or 503), in percent.
    pub refused: f64,
    /// Requests without a whole answer within the deadline, in percent.
    pub timeouts: f64,
    /// Connection errors and statuses other than 2xx, 429 and 503.
    pub errors: usize,
    /// The mean of the adaptive limit's values read in the phase, when the system has one.
    pub limit: Option<f64>,
    /// When the limit moved as the phase asks, from the phase's start: in a recovery phase,
    /// the first reading within 10% of the steady phase's mean limit; in a slower phase (S
    /// doubled), the first reading at or below 60% of the last reading before it. `None`:
    /// never in the phase, or no limit.
    pub limit_moved: Option<Duration>,
    /// The 99th percentile of how late the load generator started requests.
    pub late_p99: Option<Duration>,
    /// The server's CPU time in the phase over the requests sent in it.
    pub cpu_per_request: Option<Duration>,
    /// In a recovery phase, the time to recover from the phase before it.
    pub recovery: Option<Recovery>,
}

/// The time from a recovery phase's start until critical requests are fast again: the
/// start of the first 1 s window (windows start every 0.1 s) in which the p99 of critical
/// requests, a refused or timed-out one counted as infinitely slow, is within twice the
/// unloaded p99. At 0.5× C a window holds about 40 critical requests, so their p99 is their
/// slowest: every one of them succeeded that fast.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Recovery {
    /// Recovered this long after the phase started.
    After(Duration),
    /// Not recovered within the phase (no window of it passed).
    Not,
}

/// The p99 of admitted requests in the steady phase of `run`: the unloaded p99 when `run` had
/// no limiter.
pub fn steady_p99(run: &Run, phases: &[Phase]) -> Option<Duration> {
    let steady = phases.iter().position(|p| p.name == STEADY)?;
    let mut ok = admitted(run.samples.iter().filter(|s| s.phase == steady));
    percentile(&mut ok, 0.99)
}

/// The rows of `run`, one per phase.
pub fn rows(
    system: &'static str,
    run: &Run,
    phases: &[Phase],
    capacity_per_second: f64,
    unloaded: Option<Duration>,
) -> Vec<Row> {
    phases
        .iter()
        .enumerate()
        .map(|(i, phase)| {
            let samples: Vec<&Sample> = run.samples.iter().filter(|s| s.phase == i).collect();
            let secs = phase.length.as_secs_f64();
            let count = |o: Outcome| samples.iter().filter(|s| s.outcome == o).count();
            let share = |n: usize| percent(n, samples.len()).unwrap_or(0.0);
            let success = Class::ALL.map(|class| {
                let of: Vec<_> = samples.iter().filter(|s| s.class == class).collect();
                percent(
                    of.iter().filter(|s| s.outcome == Outcome::Ok).count(),
                    of.len(),
                )
            });
            let mut ok = admitted(samples.iter().copied());
            let p50 = percentile(&mut ok, 0.50);
            let p99 = percentile(&mut ok, 0.99);
            let cpu = run.cpu.get(i).copied().flatten();
            let mut late: Vec<Duration> = samples.iter().map(|s| s.late).collect();
            Row {
                system,
                phase: phase.name,
                sent: samples.len(),
                rate: samples.len() as f64 / secs,
                success,
                goodput: 100.0 * count(Outcome::Ok) as f64 / secs / capacity_per_second,
                p50,
                p99,
                p99_unloaded: p99
                    .zip(unloaded)
                    .map(|(p, u)| p.as_secs_f64() / u.as_secs_f64()),
                refused: share(count(Outcome::Refused)),
                timeouts: share(count(Outcome::Timeout)),
                errors: count(Outcome::Error) + count(Outcome::Failed),
                late_p99: percentile(&mut late, 0.99),
                limit: limit_mean(run, i),
                limit_moved: limit_moved(run, phases, i),
                cpu_per_request: cpu.and_then(|c| c.checked_div(samples.len().try_into().ok()?)),
                recovery: phase
                    .recovery
                    .then(|| unloaded.map(|u| recovery(&samples, phase.length, u * 2)))
                    .flatten(),
            }
        })
        .collect()
}

/// The mean of the adaptive limit's readings in phase `i`; `None` without any.
fn limit_mean(run: &Run, i: usize) -> Option<f64> {
    let read: Vec<f64> = run
        .limits
        .iter()
        .filter(|l| l.phase == i)
        .map(|l| l.limit as f64)
        .collect();
    (!read.is_empty()).then(|| read.iter().sum::<f64>() / read.len() as f64)
}

/// See [`Row::limit_moved`].
fn limit_moved(run: &Run, phases: &[Phase], i: usize) -> Option<Duration> {
    let phase = phases.get(i)?;
    let mut read = run.limits.iter().filter(|l| l.phase == i);
    if phase.recovery {
        let steady = phases.iter().position(|p| p.name == STEADY)?;
        let mean = limit_mean(run, steady)?;
        read.find(|l| (l.limit as f64 - mean).abs() <= 0.1 * mean)
            .map(|l| l.at)
    } else if phase.slowdown > 1 {
        let before = run.limits.iter().rfind(|l| l.phase + 1 == i)?.limit as f64;
        read.find(|l| l.limit as f64 <= 0.6 * before).map(|l| l.at)
    } else {
        None
    }
}

fn admitted<'a>(samples: impl Iterator<Item = &'a Sample>) -> Vec<Duration> {
    samples
        .filter(|s| s.outcome == Outcome::Ok)
        .map(|s| s.latency)
        .collect()
}

fn percent(n: usize, of: usize) -> Option<f64> {
    (of > 0).then(|| 100.0 * n as f64 / of as f64)
}

/// The nearest-rank percentile `q` of `values` (sorted in place).
fn percentile(values: &mut [Duration], q: f64) -> Option<Duration> {
    if values.is_empty() {
        return None;
    }
    values.sort_unstable();
    let rank = ((q * values.len() as f64).ceil() as usize).clamp(1, values.len());
    Some(values[rank - 1])
}

fn recovery(samples: &[&Sample], length: Duration, limit: Duration) -> Recovery {
    let critical: Vec<(Duration, Duration)> = samples
        .iter()
        .filter(|s| s.class == Class::Critical)
        .map(|s| {
            let latency = match s.outcome {
                Outcome::Ok => s.latency,
                _ => Duration::MAX,
            };
            (s.sent, latency)
        })
        .collect();
    let mut from = Duration::ZERO;
    while from + WINDOW <= length {
        let mut latencies: Vec<Duration> = critical
            .iter()
            .filter(|(sent, _)| *sent >= from && *sent < from + WINDOW)
            .map(|(_, latency)| *latency)
            .collect();
        if percentile(&mut latencies, 0.99).is_some_and(|p99| p99 <= limit) {
            return Recovery::After(from);
        }
        from += STEP;
    }
    Recovery::Not
}

/// A recovery not seen in a phase: later than the last window's start.
fn not_recovered(phase_length: Duration) -> String {
    format!(">{:.1}", phase_length.saturating_sub(WINDOW).as_secs_f64())
}

fn ms(d: Option<Duration>) -> String {
    d.map_or("-".into(), |d| format!("{:.1}", d.as_secs_f64() * 1e3))
}

fn pct(p: Option<f64>) -> String {
    p.map_or("-".into(), |p| format!("{p:.1}"))
}

/// The header of the table of rows (Markdown).
pub fn header() -> String {
    "| system | phase | req/s | critical ok % | default ok % | batch ok % | goodput % of C | p50 ms | p99 ms | p99 × unloaded | refused % | timed out % | errors | server CPU µs/req | recovery s | limit | limit moved s | sent late p99 ms |\n\
     |---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
        .into()
}

/// One row of the table.
pub fn line(row: &Row, phase_length: Duration) -> String {
    let recovery = match row.recovery {
        None => "".into(),
        Some(Recovery::After(d)) => format!("{:.1}", d.as_secs_f64()),
        Some(Recovery::Not) => not_recovered(phase_length),
    };
    let [critical, default, batch] = row.success.map(pct);
    let cpu = row
        .cpu_per_request
        .map_or("-".into(), |c| format!("{:.0}", c.as_secs_f64() * 1e6));
    format!(
        "| {} | {} | {:.0} | {critical} | {default} | {batch} | {:.1} | {} | {} | {} | {:.1} | {:.1} | {} | {cpu} | {recovery} | {} | {} | {} |",
        row.system,
        row.phase,
        row.rate,
        row.goodput,
        ms(row.p50),
        ms(row.p99),
        row.p99_unloaded.map_or("-".into(), |x| format!("{x:.1}")),
        row.refused,
        row.timeouts,
        row.errors,
        row.limit.map_or(String::new(), |l| format!("{l:.0}")),
        row.limit_moved
            .map_or(String::new(), |d| format!("{:.1}", d.as_secs_f64())),
        ms(row.late_p99),
    )
}

/// The server CPU per request a limiter adds: per system, in the steady and 10× phases and
/// over the whole run, its CPU time over the requests sent minus the same for `none`.
pub fn cpu_table(rows: &[Row], systems: &[&str]) -> String {
    let per_request = |system: &str, phase: Option<&str>| -> Option<f64> {
        let (cpu, sent) = rows
            .iter()
            .filter(|r| r.system == system && phase.is_none_or(|p| r.phase == p))
            .try_fold((0.0, 0usize), |(cpu, sent), r| {
                let c = r.cpu_per_request?.as_secs_f64() * r.sent as f64;
                Some((cpu + c, sent + r.sent))
            })?;
        (sent > 0).then(|| cpu / sent as f64 * 1e6)
    };
    let mut out = String::from(
        "| system | steady µs/req over none | 10x µs/req over none | whole run µs/req over none |\n|---|---|---|---|\n",
    );
    for system in systems.iter().filter(|s| **s != "none") {
        let over = |phase| {
            per_request(system, phase)
                .zip(per_request("none", phase))
                .map_or("-".into(), |(a, b)| format!("{:+.1}", a - b))
        };
        let _ = writeln!(
            out,
            "| {system} | {} | {} | {} |",
            over(Some(STEADY)),
            over(Some(SPIKE)),
            over(None)
        );
    }
    out
}

/// The summary line of a system: `<prefix>: critical P% at 10x, goodput G% of capacity, p99
/// X× unloaded, recovery R s`.
pub fn summary(prefix: &str, system: &str, rows: &[Row], phase_length: Duration) -> String {
    let find = |phase| rows.iter().find(|r| r.system == system && r.phase == phase);
    let spike = find(SPIKE);
    let critical = pct(spike.and_then(|r| r.success[Class::Critical.index()]));
    let goodput = pct(spike.map(|r| r.goodput));
    let p99 = spike
        .and_then(|r| r.p99_unloaded)
        .map_or("-".into(), |x| format!("{x:.1}"));
    let recovery = match find(AFTER_SPIKE).and_then(|r| r.recovery) {
        Some(Recovery::After(d)) => format!("{:.1}", d.as_secs_f64()),
        Some(Recovery::Not) => not_recovered(phase_length),
        None => "-".into(),
    };
    format!(
        "{prefix}: critical {critical}% at 10x, goodput {goodput}% of capacity, p99 {p99}× unloaded, recovery {recovery} s"
    )
}

/// The line on a system's adaptive limit, when it has one: the steady phase's mean, how soon
/// after the spike it was back within 10% of it, and how soon the slower dependency took it to
/// 60% of where it stood.
pub fn limit_summary(prefix: &str, system: &str, rows: &[Row]) -> Option<String> {
    let find = |phase: &str| rows.iter().find(|r| r.system == system && r.phase == phase);
    let steady = find(STEADY)?.limit?;
    let secs = |r: Option<&Row>| {
        r.and_then(|r| r.limit_moved)
            .map_or("never".into(), |d| format!("{:.1} s", d.as_secs_f64()))
    };
    let slow = rows
        .iter()
        .find(|r| r.system == system && r.phase == "slow-dep");
    Some(format!(
        "{prefix} limit: steady {steady:.0}; after the spike within 10% of it in {}; slower dependency: mean {} (60% of before in {})",
        secs(find(AFTER_SPIKE)),
        slow.and_then(|r| r.limit).map_or("-".into(), |l| format!("{l:.0}")),
        secs(slow),
    ))
}

/// Each figure's median over rounds of the same rows (the same systems and phases, in the
/// same order): a stall of the machine in one round moves no median of three. A recovery not
/// seen counts as the slowest; `p99 × unloaded` is the median p99 over `unloaded`, the p99
/// every round was judged against.
pub fn median(rounds: &[Vec<Row>], unloaded: Option<Duration>) -> Vec<Row> {
    let Some(first) = rounds.first() else {
        return Vec::new();
    };
    (0..first.len())
        .map(|i| {
            let all: Vec<&Row> = rounds.iter().filter_map(|r| r.get(i)).collect();
            let of = |f: &dyn Fn(&Row) -> Option<f64>| middle(all.iter().filter_map(|r| f(r)));
            let secs = |f: &dyn Fn(&Row) -> Option<Duration>| {
                of(&|r| f(r).map(|d| d.as_secs_f64())).map(Duration::from_secs_f64)
            };
            let recovery = of(&|r| {
                r.recovery.map(|rec| match rec {
                    Recovery::After(d) => d.as_secs_f64(),
                    Recovery::Not => f64::INFINITY,
                })
            })
            .map(|s| match Duration::try_from_secs_f64(s) {
                Ok(d) => Recovery::After(d),
                Err(_) => Recovery::Not,
            });
            Row {
                system: first[i].system,
                phase: first[i].phase,
                sent: of(&|r| Some(r.sent as f64)).map_or(0, |n| n as usize),
                rate: of(&|r| Some(r.rate)).unwrap_or(0.0),
                success: [0, 1, 2].map(|c| of(&|r| r.success[c])),
                goodput: of(&|r| Some(r.goodput)).unwrap_or(0.0),
                p50: secs(&|r| r.p50),
                p99: secs(&|r| r.p99),
                p99_unloaded: secs(&|r| r.p99)
                    .zip(unloaded)
                    .map(|(p, u)| p.as_secs_f64() / u.as_secs_f64()),
                refused: of(&|r| Some(r.refused)).unwrap_or(0.0),
                timeouts: of(&|r| Some(r.timeouts)).unwrap_or(0.0),
                errors: of(&|r| Some(r.errors as f64)).map_or(0, |n| n as usize),
                late_p99: secs(&|r| r.late_p99),
                limit: of(&|r| r.limit),
                limit_moved: secs(&|r| r.limit_moved),
                cpu_per_request: secs(&|r| r.cpu_per_request),
                recovery,
            }
        })
        .collect()
}

/// The median of `values` (the mean of the two middle ones when their number is even).
pub fn middle(values: impl Iterator<Item = f64>) -> Option<f64> {
    let mut v: Vec<f64> = values.collect();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    match n {
        0 => None,
        _ if n % 2 == 1 => Some(v[n / 2]),
        _ => Some((v[n / 2 - 1] + v[n / 2]) / 2.0),
    }
}
