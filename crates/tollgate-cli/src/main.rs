//! `tollgate`: checks a limits file before a deploy, and reads one key's state in Redis.
//!
//! ```text
//! tollgate check FILE
//! tollgate peek --redis URL [--limits FILE] [--prefix PREFIX] [--plan PLAN] LIMIT IDENTITY
//! tollgate peek --cluster URL[,URL...] ...
//! ```
//!
//! `check` exits 0 and prints the effective limits as a table (name, algorithm, quota per
//! plan, key, failure policy, shadow) and the allowlist; a broken file makes it print the
//! error, with its line and column, and exit 1. Principals need no Rust type here: every
//! principal name the file uses is taken as a string id.
//!
//! `peek` reads what the next one-unit request of IDENTITY (an address, a tenant's or a
//! principal's name) would find under LIMIT, as the layer's `peek` does: the limit's algorithm,
//! quota and key come from the limits file (`--limits`, else `$TOLLGATE_LIMITS`, else
//! `limits.toml`), the state from Redis. It writes nothing. Exit codes: 0 answered, 1 a broken
//! file or an unknown limit or identity, 2 a usage error, 3 Redis failed.

use std::process::ExitCode;
use std::time::Duration;

use tollgate::core::{Backend, Check, FailurePolicy, KeyState, Limit, Quota};
use tollgate::key::Identity;
use tollgate::{Algorithm, Limits, LimitsFile};
use tollgate_redis::RedisBackend;

const USAGE: &str = "usage:
  tollgate check FILE
  tollgate peek (--redis URL | --cluster URL[,URL...]) [--limits FILE] [--prefix PREFIX]
                [--plan PLAN] LIMIT IDENTITY";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("check") => match &args[1..] {
            [file] => check(file),
            _ => usage("check takes one FILE"),
        },
        Some("peek") => peek(&args[1..]),
        Some("-h" | "--help" | "help") => {
            println!("{USAGE}");
            ExitCode::SUCCESS
        }
        _ => usage("a command: check or peek"),
    }
}

fn usage(what: &str) -> ExitCode {
    eprintln!("tollgate: {what}\n{USAGE}");
    ExitCode::from(2)
}

fn load(file: &str) -> Result<Limits, ExitCode> {
    LimitsFile::new().any_principal().read(file).map_err(|e| {
        eprintln!("{file}: {e}");
        ExitCode::from(1)
    })
}

fn check(file: &str) -> ExitCode {
    let limits = match load(file) {
        Ok(limits) => limits,
        Err(code) => return code,
    };
    let mut rows = vec![[
        "name".to_owned(),
        "algorithm".to_owned(),
        "quota".to_owned(),
        "key".to_owned(),
        "failure".to_owned(),
        "shadow".to_owned(),
    ]];
    for (limit, key) in limits.entries() {
        rows.push([
            limit.name().to_owned(),
            algorithm(limit.algorithm()).to_owned(),
            quotas(limit),
            key.describe(),
            failure(limit.failure_policy()),
            if limit.is_shadow() { "yes" } else { "no" }.to_owned(),
        ]);
    }
    let widths: Vec<usize> = (0..6)
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
    let rules = limits.allowlist().describe();
    if !rules.is_empty() {
        println!();
        println!("allowlist (admitted, counted by no limit):");
        for rule in rules {
            println!("  {rule}");
        }
    }
    println!();
    let n = limits.len();
    println!("{file}: ok, {n} limit{}", if n == 1 { "" } else { "s" });
    ExitCode::SUCCESS
}

fn algorithm(a: Algorithm) -> &'static str {
    match a {
        Algorithm::Gcra => "gcra",
        Algorithm::FixedWindow => "fixed_window",
        Algorithm::SlidingLog => "sliding_log",
        Algorithm::Concurrency => "concurrency",
        _ => "other",
    }
}

/// `default 5/1m, pro 50/1m`; a GCRA burst other than the limit as `burst N`.
fn quotas(limit: &Limit) -> String {
    let one = |name: &str, q: &Quota| {
        let mut s = format!("{name} {}/{}", q.limit(), period(q.period()));
        if limit.algorithm() == Algorithm::Gcra && q.burst() != q.limit() {
            s.push_str(&format!(" burst {}", q.burst()));
        }
        s
    };
    std::iter::once(one("default", limit.quota()))
        .chain(limit.plans().map(|(name, q)| one(name, q)))
        .collect::<Vec<_>>()
        .join(", ")
}

/// A period in the largest unit that divides it: `1d`, `1h`, `30s`, `500ms`.
fn period(d: Duration) -> String {
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

fn failure(p: FailurePolicy) -> String {
    match p {
        FailurePolicy::FailOpen => "open".to_owned(),
        FailurePolicy::FailClosed => "closed".to_owned(),
        FailurePolicy::Fallback { replicas } => format!("fallback {replicas}"),
        _ => "other".to_owned(),
    }
}

#[derive(Default)]
struct PeekArgs {
    redis: Option<String>,
    cluster: Option<String>,
    limits: Option<String>,
    prefix: Option<String>,
    plan: Option<String>,
    positional: Vec<String>,
}

fn peek(args: &[String]) -> ExitCode {
    let mut p = PeekArgs::default();
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        let slot = match arg.as_str() {
            "--redis" => &mut p.redis,
            "--cluster" => &mut p.cluster,
            "--limits" => &mut p.limits,
            "--prefix" => &mut p.prefix,
            "--plan" => &mut p.plan,
            flag if flag.starts_with("--") => return usage(&format!("unknown option {flag}")),
            _ => {
                p.positional.push(arg.clone());
                continue;
            }
        };
        match it.next() {
            Some(value) => *slot = Some(value.clone()),
            None => return usage(&format!("{arg} needs a value")),
        }
    }
    let [limit_name, identity] = p.positional.as_slice() else {
        return usage("peek takes LIMIT and IDENTITY");
    };
    let file = p
        .limits
        .clone()
        .or_else(|| std::env::var("TOLLGATE_LIMITS").ok())
        .unwrap_or_else(|| "limits.toml".to_owned());
    let limits = match load(&file) {
        Ok(limits) => limits,
        Err(code) => return code,
    };
    let Some((limit, key)) = limits.get(limit_name) else {
        eprintln!("{file}: no limit named {limit_name:?}");
        return ExitCode::from(1);
    };
    let quota = match &p.plan {
        None => *limit.quota(),
        Some(plan) => match limit.plans().find(|(n, _)| n == plan) {
            Some((_, q)) => *q,
            None => {
                eprintln!("limit {limit_name:?} has no plan {plan:?}");
                return ExitCode::from(1);
            }
        },
    };
    let identity = Identity::from(identity.as_str());
    let key = match key.key_of(&identity) {
        Ok(key) => key,
        Err(e) => {
            eprintln!("{identity}: not a key of limit {limit_name:?} ({e})");
            return ExitCode::from(1);
        }
    };
    let mut builder = RedisBackend::builder();
    builder = match (&p.redis, &p.cluster) {
        (Some(url), None) => builder.url(url),
        (None, Some(urls)) => builder.cluster(urls.split(',')),
        _ => return usage("peek needs --redis URL or --cluster URL[,URL...]"),
    };
    if let Some(prefix) = &p.prefix {
        builder = builder.prefix(prefix);
    }
    let backend = match builder.deadline(Duration::from_secs(2)).build() {
        Ok(backend) => backend,
        Err(e) => {
            eprintln!("redis: {e}");
            return ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("tollgate: {e}");
            return ExitCode::from(3);
        }
    };
    let check = Check::new(limit, key.as_bytes()).with_quota(quota);
    match runtime.block_on(backend.peek(&check)) {
        Ok(state) => {
            print_state(limit_name, &identity, limit, &quota, &state);
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("{e}");
            ExitCode::from(3)
        }
    }
}

fn print_state(name: &str, identity: &Identity, limit: &Limit, quota: &Quota, s: &KeyState) {
    println!(
        "limit      {name} ({} {}/{})",
        algorithm(limit.algorithm()),
        quota.limit(),
        period(quota.period())
    );
    println!("identity   {identity}");
    println!("remaining  {}", s.remaining);
    println!("reset      {:.3}s", s.reset.as_secs_f64());
    match s.retry_after {
        Some(after) => println!("retry      {:.3}s", after.as_secs_f64()),
        None => println!("retry      -"),
    }
}
