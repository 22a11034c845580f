//! `check`'s output: the effective limits of a file as a table, then its allowlist and
//! denylist.

use std::path::Path;
use std::time::Duration;

use tollgate::engine::{FailurePolicy, Limit, MissingKeyPolicy, Quota};
use tollgate::{Algorithm, Limits};

/// Prints `limits`, read from `file`.
pub(crate) fn print(file: &Path, limits: &Limits) {
    let mut rows = vec![[
        "name",
        "algorithm",
        "quota",
        "key",
        "cost",
        "missing key",
        "failure",
        "shadow",
        "wait",
        "penalty",
    ]
    .map(str::to_owned)];
    for (limit, key) in limits.entries() {
        rows.push([
            limit.name().to_owned(),
            limit.algorithm().as_str().to_owned(),
            quotas(limit),
            key.describe(),
            // A limits file's costs are fixed: `cost = N`, 1 unless it says.
            format!("fixed {}", limit.cost()),
            missing_key(limit.missing_key_policy()).to_owned(),
            failure(limit.failure_policy()),
            match limit.enforced_percent() {
                0 => "yes".to_owned(),
                100 => "no".to_owned(),
                // Rolled out to a share of keys: the rest are shadow.
                p => format!("enforce {p}%"),
            },
            wait(limit),
            penalty(limit),
        ]);
    }
    let widths: Vec<usize> = (0..rows[0].len())
        .map(|c| rows.iter().map(|r| r[c].chars().count()).max().unwrap_or(0))
        .collect();
    for row in &rows {
        let line: Vec<String> = row
            .iter()
            .zip(&widths)
            .map(|(cell, w)| format!("{cell:<w$}"))
            .collect();
        println!("{}", line.join("  ").trim_end());
    }
    let lists = [
        (
            "allowlist (admitted, counted by no limit)",
            limits.allowlist().describe(),
        ),
        (
            "denylist (refused with 403 unless allowlisted, counted by no limit)",
            limits.denylist().describe(),
        ),
    ];
    for (title, rules) in lists.into_iter().filter(|(_, r)| !r.is_empty()) {
        println!();
        println!("{title}:");
        for rule in rules {
            println!("  {rule}");
        }
    }
    println!();
    let n = limits.len();
    println!(
        "{}: ok, {n} limit{}",
        file.display(),
        if n == 1 { "" } else { "s" }
    );
}

/// `default 5/1m, pro 50/1m`; a GCRA burst other than the limit as `burst N`; a concurrency
/// limit's as `default 2 in flight, pro 8 in flight; slot ttl 30s`.
fn quotas(limit: &Limit) -> String {
    let concurrent = limit.algorithm() == Algorithm::Concurrency;
    let one = |name: &str, q: &Quota| {
        if concurrent {
            return format!("{name} {} in flight", q.limit());
        }
        let mut s = format!("{name} {}/{}", q.limit(), period(q.period()));
        if limit.algorithm() == Algorithm::Gcra && q.burst() != q.limit() {
            s.push_str(&format!(" burst {}", q.burst()));
        }
        s
    };
    let quotas = std::iter::once(one("default", limit.quota()))
        .chain(limit.plans().map(|(name, q)| one(name, q)))
        .collect::<Vec<_>>()
        .join(", ");
    if concurrent {
        format!("{quotas}; slot ttl {}", period(limit.quota().period()))
    } else {
        quotas
    }
}

/// How long a request may wait instead of being refused: `delay 2s, max 16 waiting`,
/// `queue 10s, max 8 waiting`, or `-`.
fn wait(limit: &Limit) -> String {
    let (word, wait) = if limit.delay_micros() > 0 {
        ("delay", limit.delay())
    } else if limit.queue_micros() > 0 {
        ("queue", limit.queue())
    } else {
        return "-".to_owned();
    };
    format!(
        "{word} {}, max {} waiting",
        period(wait),
        limit.waiting_bound()
    )
}

/// The penalty box: `3 in 1m: block 10m`, `3 in 1m: block 10m, doubling to 1h`, or `-`.
fn penalty(limit: &Limit) -> String {
    let Some(p) = limit.penalty_box() else {
        return "-".to_owned();
    };
    let mut s = format!(
        "{} in {}: block {}",
        p.refusals(),
        period(p.window()),
        period(p.block())
    );
    if p.max_block() > p.block() {
        s.push_str(&format!(", doubling to {}", period(p.max_block())));
    }
    s
}

/// A period in the largest unit that divides it: `1d`, `1h`, `30s`, `500ms`.
pub(crate) fn period(d: Duration) -> String {
    let ms = d.as_millis();
    for (unit, n) in [
        ("d", 86_400_000),
        ("h", 3_600_000),
        ("m", 60_000),
        ("s", 1_000),
    ] {
        if ms >= n && ms.is_multiple_of(n) {
            return format!("{}{unit}", ms / n);
        }
    }
    if ms > 0 && d.as_micros().is_multiple_of(1000) {
        return format!("{ms}ms");
    }
    format!("{}us", d.as_micros())
}

/// The limits file's words for the policy.
fn missing_key(p: &MissingKeyPolicy) -> &'static str {
    match p {
        MissingKeyPolicy::Reject => "reject",
        MissingKeyPolicy::Skip => "skip",
        MissingKeyPolicy::SharedBucket => "shared_bucket",
        _ => "other",
    }
}

fn failure(p: FailurePolicy) -> String {
    match p {
        FailurePolicy::FailOpen => "open".to_owned(),
        FailurePolicy::FailClosed => "closed".to_owned(),
        FailurePolicy::Fallback { replicas } => format!("fallback {replicas}"),
        _ => "other".to_owned(),
    }
}
