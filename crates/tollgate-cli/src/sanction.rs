//! The subcommands on one identity under one limit: `peek` reads its state, `reset` forgets
//! it, `deny` and `undeny` set and lift a deny.

use std::process::ExitCode;
use std::time::Duration;

use tollgate::engine::{
    Admin, Algorithm, Check, Clock, KeyState, Limit, Quota, Standing, SystemClock, MAX_DENY,
};
use tollgate::key::Identity;

use crate::redis::{connect, failed, target_key};
use crate::table::period;
use crate::top::utc;
use crate::TargetArgs;

/// `90`, `90s`, `15m`, `1h` or `7d`.
pub(crate) fn parse_for(text: &str) -> Result<Duration, String> {
    let (digits, unit) = match text.find(|c: char| !c.is_ascii_digit()) {
        Some(at) => text.split_at(at),
        None => (text, "s"),
    };
    let n: u64 = digits
        .parse()
        .map_err(|_| format!("{text:?} is not a duration such as 90s, 15m, 1h or 7d"))?;
    let secs = match unit {
        "s" => 1,
        "m" => 60,
        "h" => 3_600,
        "d" => 86_400,
        _ => return Err(format!("{text:?}: the unit must be s, m, h or d")),
    };
    match n.checked_mul(secs).map(Duration::from_secs) {
        Some(Duration::ZERO) => Err("a deny must last longer than zero".to_owned()),
        Some(d) if d <= MAX_DENY => Ok(d),
        _ => Err(format!(
            "{text:?} is too long: a deny lasts at most {}d (100 years)",
            MAX_DENY.as_secs() / 86_400
        )),
    }
}

/// Prints what the target's next one-unit request would find, under `plan`'s quota.
pub(crate) fn peek(target: &TargetArgs, plan: Option<&str>) -> Result<(), ExitCode> {
    let name = target.limit.as_str();
    let (limit, key, identity) = target_key(&target.limits, name, &target.identity)?;
    let quota = match plan {
        None => *limit.quota(),
        Some(plan) => match limit.plans().find(|(n, _)| *n == plan) {
            Some((_, q)) => *q,
            None => {
                eprintln!("limit {name:?} has no plan {plan:?}");
                return Err(ExitCode::from(1));
            }
        },
    };
    let (backend, runtime) = connect(&target.redis, &target.prefix)?;
    let check = Check::new(&limit, &key).with_quota(quota);
    let state = runtime
        .block_on(backend.peek(&check))
        .map_err(|e| failed(&e))?;
    print_state(name, &identity, &limit, &quota, &state);
    Ok(())
}

/// Forgets what the target has used.
pub(crate) fn reset(target: &TargetArgs) -> Result<(), ExitCode> {
    let name = target.limit.as_str();
    let (limit, key, identity) = target_key(&target.limits, name, &target.identity)?;
    if limit.algorithm() == Algorithm::Concurrency {
        eprintln!(
            "limit {name:?} is a concurrency limit: its slots are requests still in flight, \
             given back when they end, and cannot be reset"
        );
        return Err(ExitCode::from(1));
    }
    let (backend, runtime) = connect(&target.redis, &target.prefix)?;
    let check = Check::new(&limit, &key);
    runtime
        .block_on(backend.reset(&check))
        .map_err(|e| failed(&e))?;
    println!("reset {identity} under {name}: its next request finds the whole quota");
    // A reset leaves a deny: say so, or the operator would think the identity free.
    if let Ok(KeyState {
        standing: Some(Standing::Denied),
        retry_after,
        ..
    }) = runtime.block_on(backend.peek(&check))
    {
        println!(
            "it is still denied {} (undeny lifts it)",
            until(retry_after)
        );
    }
    Ok(())
}

/// Denies the target for `duration`.
pub(crate) fn deny(target: &TargetArgs, duration: Duration) -> Result<(), ExitCode> {
    let name = target.limit.as_str();
    let (limit, key, identity) = target_key(&target.limits, name, &target.identity)?;
    let (backend, runtime) = connect(&target.redis, &target.prefix)?;
    let check = Check::new(&limit, &key);
    runtime
        .block_on(backend.deny(&check, duration))
        .map_err(|e| failed(&e))?;
    println!("denied {identity} under {name} for {}", period(duration));
    Ok(())
}

/// Lifts a deny of the target, and says whether there was one.
pub(crate) fn undeny(target: &TargetArgs) -> Result<(), ExitCode> {
    let name = target.limit.as_str();
    let (limit, key, identity) = target_key(&target.limits, name, &target.identity)?;
    let (backend, runtime) = connect(&target.redis, &target.prefix)?;
    let check = Check::new(&limit, &key);
    // `Admin::undeny` answers the same whether there was a deny or not: a peek first tells.
    let before = runtime
        .block_on(backend.peek(&check))
        .map_err(|e| failed(&e))?;
    runtime
        .block_on(backend.undeny(&check))
        .map_err(|e| failed(&e))?;
    if before.standing == Some(Standing::Denied) {
        println!("lifted the deny of {identity} under {name}");
    } else {
        println!("{identity} was not denied under {name}: nothing to lift");
    }
    Ok(())
}

/// `until <UTC> (in <seconds>s)`, `after` from now; `until it is lifted` without an end.
fn until(after: Option<Duration>) -> String {
    let Some(after) = after else {
        return "until it is lifted".to_owned();
    };
    let at = SystemClock::new()
        .now()
        .saturating_add(u64::try_from(after.as_micros()).unwrap_or(u64::MAX));
    format!("until {} (in {:.0}s)", utc(at), after.as_secs_f64().ceil())
}

fn print_state(name: &str, identity: &Identity, limit: &Limit, quota: &Quota, s: &KeyState) {
    let concurrency = limit.algorithm() == Algorithm::Concurrency;
    if concurrency {
        println!("limit      {name} (concurrency {} at once)", quota.limit());
    } else {
        println!(
            "limit      {name} ({} {}/{})",
            limit.algorithm().as_str(),
            quota.limit(),
            period(quota.period())
        );
    }
    println!("identity   {identity}");
    match s.standing {
        Some(Standing::Denied) => println!("denied     {}", until(s.retry_after)),
        Some(Standing::Blocked) => println!("blocked    {}", until(s.retry_after)),
        _ => {}
    }
    if concurrency {
        let in_flight = u64::from(quota.limit()).saturating_sub(s.remaining);
        if s.standing.is_none() {
            println!("in flight  {in_flight}");
        }
        println!("remaining  {}", s.remaining);
        return;
    }
    if limit.algorithm() == Algorithm::Gcra {
        println!("burst      {}", quota.burst());
    }
    println!("remaining  {}", s.remaining);
    println!("reset      {:.3}s", s.reset.as_secs_f64());
    match s.retry_after {
        Some(after) => println!("retry      {:.3}s", after.as_secs_f64()),
        None => println!("retry      -"),
    }
}
