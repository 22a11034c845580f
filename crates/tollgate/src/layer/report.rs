//! A refused request counted under the limits that refused it (see `refused.rs`), and the
//! counters handed to the backend's reports once per tick without waiting.

use std::task::{Context, Poll, Waker};

use tollgate_engine::topk::Counter;
use tollgate_engine::{AdminFuture, Micros, Refused, Reports};

use super::limits::{LimitSet, SetLimit};
use super::refused::Refusals;
use crate::decision::{Decision, Outcome};

/// Counts a refused request (its key for the limit at `i`: `keys(i)`) under every enforced
/// limit of `set` that refused it (a shadow limit's would-be refusal is no refusal), and hands
/// a limit's counters to `reports` once a tick has passed.
pub(crate) fn count_refused<'k>(
    refused: &Refusals,
    reports: Option<&dyn Reports>,
    decision: &Decision,
    set: &LimitSet,
    keys: impl Fn(usize) -> Option<&'k [u8]>,
) {
    if !refused.enabled() {
        return;
    }
    for (i, (entry, d)) in set.limits.iter().zip(decision.limits()).enumerate() {
        if d.is_shadow() || !matches!(d.outcome(), Outcome::Denied { .. }) {
            continue;
        }
        // Every enforced limit keeps its key while refusals are counted.
        let Some(key) = keys(i) else {
            continue;
        };
        if let Some((counters, now)) = refused.count(entry.limit.name(), &entry.refused, key) {
            if let Some(reports) = reports {
                hand(reports, refused.keep(), entry, counters, now);
            }
        }
    }
}

/// Hands `counters` to `reports` (keeping at most `keep` identities) without waiting: a
/// networked backend's call goes on in a task (outside a Tokio runtime it is dropped).
fn hand(
    reports: &dyn Reports,
    keep: usize,
    entry: &SetLimit,
    counters: Vec<Counter<Vec<u8>>>,
    now: Micros,
) {
    let name = entry.limit.name();
    let mut merge = reports.merge(name, keep, named(entry, counters), now);
    match merge.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(Ok(())) => {}
        Poll::Ready(Err(e)) => {
            tracing::debug!(limit = name, error = %e, "refusals not reported")
        }
        Poll::Pending => spawn(merge, name),
    }
}

fn spawn(merge: AdminFuture<()>, limit: &str) {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    let limit = limit.to_owned();
    runtime.spawn(async move {
        if let Err(e) = merge.await {
            tracing::debug!(limit, error = %e, "refusals not reported");
        }
    });
}

/// `counters` of `entry`'s keys, named as requests carry them.
pub(super) fn named(entry: &SetLimit, counters: Vec<Counter<Vec<u8>>>) -> Vec<Refused> {
    counters
        .into_iter()
        .map(|c| {
            let identity = entry.key.identity_of(&c.key);
            Refused::new(identity, c.count, c.error, c.first_seen, c.last_seen)
        })
        .collect()
}
