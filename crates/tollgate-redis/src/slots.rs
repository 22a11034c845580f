//! Concurrency slots in Redis: a sorted set per key, `<base>:slots`, of slot ids scored by
//! their deadline.
//!
//! `CHECK` takes a slot (it drops the expired ones, counts, and adds the request's id with a
//! deadline one slot lifetime away, by the server's clock). The layer gives it back with a
//! `ZREM` of that id when the response is done, and renews its deadline while the response
//! streams. An id is chosen by the client before the call, so a slot whose answer was lost
//! (the call timed out after it was sent, or the caller went away) is released by id too, once
//! Redis answers again: a pause of Redis does not leak slots until they expire.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use tollgate_core::{Algorithm, Check, Micros};

use crate::backend::Inner;
use crate::keys::{self, BaseKey, Suffix};
use crate::script::{slot_member, Prepared, Script};

/// Moves each slot's deadline one lifetime past the server's `TIME`, if the slot is still held.
/// `KEYS[1]`: the slots key; `ARGV[2]`: the lifetime in microseconds; `ARGV[3]`: the slot id.
pub(crate) const RENEW: &str = r"
local ttl = tonumber(ARGV[2])
if redis.call('ZADD', KEYS[1], 'XX', 'CH', fmt(now + ttl), ARGV[3]) == 1 then
  redis.call('PEXPIRE', KEYS[1], ttl_ms(ttl))
end
return 1
";

/// One slot: its key, id and lifetime.
#[derive(Debug, Clone)]
pub(crate) struct Held {
    key: Vec<u8>,
    slot: u128,
    ttl: Micros,
}

impl Held {
    fn of(prefix: &str, name: &str, digest: &keys::KeyDigest, slot: u128, ttl: Micros) -> Self {
        Self {
            key: BaseKey::new(prefix, name, digest)
                .with(Suffix::Slots)
                .as_bytes()
                .to_vec(),
            slot,
            ttl,
        }
    }

    /// The slots that `checks` hold.
    pub(crate) fn from_checks(inner: &Inner, checks: &[Check<'_>]) -> Vec<Self> {
        let prefix = inner.prefix.as_str();
        checks
            .iter()
            .filter(|c| c.limit.algorithm() == Algorithm::Concurrency)
            .map(|c| {
                let digest = inner.digests.digest(c.limit.name(), c.key);
                Self::of(
                    prefix,
                    c.limit.name(),
                    &digest,
                    c.slot,
                    c.limit.quota().period_micros(),
                )
            })
            .collect()
    }

    /// The slots a prepared batch may take.
    pub(crate) fn from_batch(prefix: &str, batch: &[Prepared]) -> Vec<Self> {
        batch
            .iter()
            .filter(|p| p.algorithm == Algorithm::Concurrency)
            .map(|p| Self::of(prefix, &p.name, &p.digest, p.slot, p.quota.period_micros()))
            .collect()
    }
}

/// Gives back, in the background, the slots a batch may have taken unless it is disarmed:
/// dropped with the call (the caller went away), or kept when the call failed after it may have
/// been sent.
pub(crate) struct Unclaimed {
    inner: Arc<Inner>,
    held: Vec<Held>,
}

impl Unclaimed {
    pub(crate) fn new(inner: &Arc<Inner>, held: Vec<Held>) -> Self {
        Self {
            inner: Arc::clone(inner),
            held,
        }
    }

    /// The call was answered: what it took is the caller's to give back.
    pub(crate) fn disarm(mut self) {
        self.held.clear();
    }
}

impl Drop for Unclaimed {
    fn drop(&mut self) {
        release(&self.inner, std::mem::take(&mut self.held));
    }
}

/// Runs `work` on `held` in a spawned task. Without a runtime (a process shutting down),
/// nothing is sent: the slots expire.
fn spawn_for<F, Fut>(inner: &Arc<Inner>, held: Vec<Held>, work: F)
where
    F: FnOnce(Arc<Inner>, Vec<Held>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    if held.is_empty() {
        return;
    }
    if let Ok(runtime) = tokio::runtime::Handle::try_current() {
        runtime.spawn(work(Arc::clone(inner), held));
    }
}

/// The slot releases this replica has sent and Redis has not answered yet.
///
/// A release travels on the shared connection, a check on the checks' own: without this, the
/// next request of a client that read its response to the end could reach Redis before the
/// release of the slot it held, and find it still taken. A check of a concurrency limit made
/// while releases are in flight waits for their first attempt (at most its deadline).
#[derive(Debug, Default)]
pub(crate) struct Releases {
    pending: AtomicUsize,
    done: Notify,
}

impl Releases {
    /// Whether a release is in flight.
    pub(crate) fn pending(&self) -> bool {
        self.pending.load(Ordering::Acquire) > 0
    }

    /// Resolves once no release is in flight, or at `until`.
    pub(crate) async fn answered(&self, until: Instant) {
        loop {
            let done = self.done.notified();
            tokio::pin!(done);
            done.as_mut().enable();
            if !self.pending() {
                return;
            }
            if tokio::time::timeout_at(until, done).await.is_err() {
                return;
            }
        }
    }
}

/// One release in flight, counted until dropped (also when its task is cancelled).
struct InFlight(Arc<Inner>);

impl InFlight {
    fn new(inner: &Arc<Inner>) -> Self {
        inner.releases.pending.fetch_add(1, Ordering::AcqRel);
        Self(Arc::clone(inner))
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if self.0.releases.pending.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.releases.done.notify_waiters();
        }
    }
}

/// `ZREM`s `held` in a spawned task, again and again while Redis fails, until each slot would
/// have expired anyway. Counted in [`Releases`] until each slot's first attempt is answered.
pub(crate) fn release(inner: &Arc<Inner>, held: Vec<Held>) {
    if held.is_empty() || tokio::runtime::Handle::try_current().is_err() {
        return;
    }
    let in_flight = InFlight::new(inner);
    spawn_for(inner, held, |inner, held| async move {
        let mut failed = Vec::new();
        for slot in held {
            let cmd = zrem(&slot);
            if !attempt(&inner, &cmd).await {
                failed.push((cmd, slot.ttl));
            }
        }
        drop(in_flight);
        for (cmd, ttl) in failed {
            retry(&inner, &cmd, ttl).await;
        }
    });
}

fn zrem(slot: &Held) -> redis::Cmd {
    let mut cmd = redis::cmd("ZREM");
    cmd.arg(&slot.key[..]).arg(slot_member(slot.slot));
    cmd
}

/// Renews `held` in a spawned task (one attempt per slot, within the deadline: the next
/// renewal comes a third of a lifetime later).
pub(crate) fn renew(inner: &Arc<Inner>, held: Vec<Held>) {
    spawn_for(inner, held, |inner, held| async move {
        for slot in held {
            let mut call = inner.renew_script.call(1, 4, slot.key.len() + 40);
            call.arg(&slot.key[..])
                .arg("")
                .arg(slot.ttl)
                .arg(slot_member(slot.slot));
            let renewal = inner.invoke(&inner.renew_script, &call);
            let _ = inner.within_deadline(renewal, "to renew a slot").await;
        }
    });
}

/// One attempt at `cmd`, within the deadline (at least 100 ms); whether Redis answered.
async fn attempt(inner: &Arc<Inner>, cmd: &redis::Cmd) -> bool {
    let within = inner.deadline.max(Duration::from_millis(100));
    matches!(
        tokio::time::timeout(within, inner.query(cmd)).await,
        Ok(Ok(_))
    )
}

/// Sends `cmd` until Redis answers, waiting longer each time, for at most `within`
/// microseconds.
async fn retry(inner: &Arc<Inner>, cmd: &redis::Cmd, within: Micros) {
    let give_up = Instant::now() + Duration::from_micros(within);
    let mut wait = Duration::from_millis(50);
    while Instant::now() + wait < give_up {
        tokio::time::sleep(wait).await;
        if attempt(inner, cmd).await {
            return;
        }
        wait = (wait * 2).min(Duration::from_secs(2));
    }
}

/// The renewal script (with the prelude that reads `now`).
pub(crate) fn renew_script() -> Script {
    Script::new(RENEW)
}
