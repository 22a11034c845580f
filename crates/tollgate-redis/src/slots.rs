//! Concurrency slots in Redis: a sorted set per key, `<base>:slots`, of slot ids scored by
//! their deadline.
//!
//! `CHECK` takes a slot (it drops the expired ones, counts, and adds the request's id with a
//! deadline one slot lifetime away, by the server's clock). The layer gives it back with a
//! `ZREM` of that id when the response is done, and renews its deadline while the response
//! streams. An id is chosen by the client before the call, so a slot whose answer was lost
//! (the call timed out after it was sent, or the caller went away) is released by id too, once
//! Redis answers again: a pause of Redis does not leak slots until they expire.

use std::sync::Arc;
use std::time::Duration;

use tollgate_core::{Algorithm, Check, Micros};

use crate::backend::Inner;
use crate::keys::{self, BaseKey, Suffix};
use crate::script::{Prepared, Script};

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
    slot: u64,
    ttl: Micros,
}

impl Held {
    fn of(prefix: &str, name: &str, digest: &keys::KeyDigest, slot: u64, ttl: Micros) -> Self {
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

/// `ZREM`s `held` in a spawned task, again and again while Redis fails, until each slot would
/// have expired anyway.
pub(crate) fn release(inner: &Arc<Inner>, held: Vec<Held>) {
    spawn_for(inner, held, |inner, held| async move {
        for slot in held {
            let mut cmd = redis::cmd("ZREM");
            cmd.arg(&slot.key[..]).arg(slot.slot);
            retry(&inner, &cmd, slot.ttl).await;
        }
    });
}

/// Renews `held` in a spawned task (one attempt per slot: the next renewal comes a third of a
/// lifetime later).
pub(crate) fn renew(inner: &Arc<Inner>, held: Vec<Held>) {
    spawn_for(inner, held, |inner, held| async move {
        for slot in held {
            let mut call = inner.renew_script.call(1, 4, slot.key.len() + 40);
            call.arg(&slot.key[..]).arg("").arg(slot.ttl).arg(slot.slot);
            let _ = inner.invoke(&inner.renew_script, &call).await;
        }
    });
}

/// Sends `cmd` until Redis answers, waiting longer each time, for at most `within`
/// microseconds.
async fn retry(inner: &Arc<Inner>, cmd: &redis::Cmd, within: Micros) {
    let give_up = tokio::time::Instant::now() + Duration::from_micros(within);
    let mut wait = Duration::from_millis(50);
    loop {
        let attempt = tokio::time::timeout(
            inner.deadline.max(Duration::from_millis(100)),
            inner.query(cmd),
        )
        .await;
        if matches!(attempt, Ok(Ok(_))) || tokio::time::Instant::now() + wait >= give_up {
            return;
        }
        tokio::time::sleep(wait).await;
        wait = (wait * 2).min(Duration::from_secs(2));
    }
}

/// The renewal script (with the prelude that reads `now`).
pub(crate) fn renew_script() -> Script {
    Script::new(RENEW)
}
