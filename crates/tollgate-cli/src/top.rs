//! `top`: who a limit refused most, as the replicas reported it to Redis.

use std::process::ExitCode;

use tollgate::engine::{Clock, Refused, Reports, SystemClock};

use crate::redis::{connect, failed, limit_of};
use crate::TopArgs;

pub(crate) fn run(args: &TopArgs) -> Result<(), ExitCode> {
    limit_of(&args.limits, &args.limit)?;
    let (backend, runtime) = connect(&args.redis, &args.prefix)?;
    let now = SystemClock::new().now();
    let top = runtime
        .block_on(backend.top(&args.limit, args.n, now))
        .map_err(|e| failed(&e))?;
    print(&args.limit, &top);
    Ok(())
}

fn print(limit: &str, top: &[Refused]) {
    println!("limit  {limit}: {} refused identities", top.len());
    println!(
        "{:>9} {:>7}  {:<20}  {:<20}  identity",
        "refused", "error", "first seen (UTC)", "last seen (UTC)"
    );
    for r in top {
        println!(
            "{:>9} {:>7}  {:<20}  {:<20}  {}",
            r.count,
            r.error,
            utc(r.first_seen),
            utc(r.last_seen),
            r.identity
        );
    }
}

/// Microseconds since the Unix epoch as `YYYY-MM-DDTHH:MM:SSZ`.
pub(crate) fn utc(micros: u64) -> String {
    let secs = micros / 1_000_000;
    let (days, rest) = (secs / 86_400, secs % 86_400);
    // Days to a civil date, counted in 400-year eras from 0000-03-01.
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rest / 3_600,
        rest / 60 % 60,
        rest % 60
    )
}
