//! What a limit of the file does with a request beyond its quota, besides refusing it: wait
//! (a GCRA limit's `delay`, a concurrency limit's `queue`) or block the key after repeated
//! refusals (`penalty`). Each mistake is said at the value that makes it.

use std::ops::Range;
use std::time::Duration;

use tollgate_engine::{ConfigError, Limit, Penalty, DEFAULT_MAX_WAITING, MAX_PERIOD};
use toml::Spanned;

use super::error::Mistake;
use super::spec::{parse_period, LimitSpec, PenaltySpec, QueueSpec};

/// `limit` with the delay, queue and penalty that `spec` gives it.
pub(super) fn apply(mut limit: Limit, spec: &LimitSpec) -> Result<Limit, Mistake> {
    let name = spec.name.get_ref().as_str();
    let at = |span: Range<usize>, e: &dyn std::fmt::Display| Mistake::in_limit(name, span, e);
    if let Some(delay) = &spec.delay {
        let wait = duration("delay", delay).map_err(|e| at(delay.span(), &e))?;
        limit = limit.delay_up_to(wait).map_err(|e| at(delay.span(), &e))?;
    }
    if let Some(n) = &spec.max_waiting {
        if spec.delay.is_none() {
            return Err(at(
                n.span(),
                &"`max_waiting` bounds the requests a `delay` makes wait: it needs one \
                  (a queue takes its own: queue = { wait = \"5s\", max_waiting = N })",
            ));
        }
        limit = limit
            .max_waiting(*n.get_ref())
            .map_err(|e| at(n.span(), &e))?;
    }
    if let Some(queue) = &spec.queue {
        limit = with_queue(limit, queue).map_err(|(span, e)| at(span, &e))?;
    }
    if let Some(penalty) = &spec.penalty {
        limit = with_penalty(limit, penalty).map_err(|(span, e)| at(span, &e))?;
    }
    Ok(limit)
}

/// A length of time the file gives, named `what` in its error.
fn duration(what: &str, text: &Spanned<String>) -> Result<Duration, String> {
    parse_period(what, text.get_ref())
}

type Wrong = (Range<usize>, String);

/// `queue = { wait = "5s", max_waiting = 50 }` (at most [`DEFAULT_MAX_WAITING`] waiting
/// unless it says).
fn with_queue(limit: Limit, table: &Spanned<QueueSpec>) -> Result<Limit, Wrong> {
    let queue = table.get_ref();
    let wait = duration("wait", &queue.wait).map_err(|e| (queue.wait.span(), e))?;
    let max_waiting = queue
        .max_waiting
        .as_ref()
        .map_or(DEFAULT_MAX_WAITING, |n| *n.get_ref());
    limit
        .queue_up_to(wait, max_waiting)
        .map_err(|e| match (&e, &queue.max_waiting) {
            (ConfigError::InvalidDelay(_), Some(n)) if *n.get_ref() == 0 => {
                (n.span(), e.to_string())
            }
            (ConfigError::InvalidDelay(_), _) => (queue.wait.span(), e.to_string()),
            _ => (table.span(), e.to_string()),
        })
}

/// `penalty = { after = 3, within = "1m", block = "10m", max = "1h" }` (`max` optional: a
/// block that does not escalate).
fn with_penalty(limit: Limit, table: &Spanned<PenaltySpec>) -> Result<Limit, Wrong> {
    let p = table.get_ref();
    let within = duration("within", &p.within).map_err(|e| (p.within.span(), e))?;
    let block = duration("block", &p.block).map_err(|e| (p.block.span(), e))?;
    let max = match &p.max {
        Some(max) => Some(duration("max", max).map_err(|e| (max.span(), e))?),
        None => None,
    };
    let mut penalty = Penalty::after(*p.after.get_ref())
        .within(within)
        .block_for(block);
    if let Some(max) = max {
        penalty = penalty.escalating_up_to(max);
    }
    limit.penalty(penalty).map_err(|e| {
        // The core says what is wrong; the file says where, in the order the core checks.
        let span = match e {
            ConfigError::InvalidPenalty(_) if *p.after.get_ref() == 0 => p.after.span(),
            ConfigError::InvalidPenalty(_) if within.is_zero() || within > MAX_PERIOD => {
                p.within.span()
            }
            ConfigError::InvalidPenalty(_) if block.is_zero() || block > MAX_PERIOD => {
                p.block.span()
            }
            ConfigError::InvalidPenalty(_) => p.max.as_ref().map_or(table.span(), Spanned::span),
            _ => table.span(),
        };
        (span, e.to_string())
    })
}
