//! Concurrency slots in Redis: a sorted set per key, `<base>:slots`, of slot ids scored by
//! their deadline.
//!
//! `CHECK` takes a slot (it drops the expired ones, counts, and adds the request's id with a
//! deadline one slot lifetime away, by the server's clock). The layer gives it back with a
//! `ZREM` of that id when the response is done, and renews its deadline while the response
//! streams. An id is chosen by the client before the call, so a slot whose answer was lost
//! (the call timed out after it was sent, or the caller went away) is released by id too, once
//! Redis answers again: a pause of Redis does not leak slots until they expire.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::{oneshot, Notify};
use tokio::time::Instant;

use tollgate_engine::{Algorithm, Check, Micros};

#[cfg(test)]
use crate::keys::DIGEST_LEN;
use crate::keys::{BaseKey, KeyDigest, Suffix};
use crate::scripts::check::EncodedCheck;
use crate::scripts::{renew, slot_id};
use crate::transport::Transport;

/// The concurrency slots of one backend: releases (retried) and renewals, on the transport.
pub(crate) struct SlotKeeper {
    transport: Arc<Transport>,
    prefix: String,
    /// Releases sent and not answered yet: a concurrency check waits for them.
    releases: Releases,
}

/// One slot: its key, id and lifetime.
#[derive(Debug, Clone)]
pub(crate) struct Held {
    key: Vec<u8>,
    digest: KeyDigest,
    slot: u128,
    ttl: Micros,
}

impl SlotKeeper {
    pub(crate) fn new(transport: Arc<Transport>, prefix: String) -> Self {
        Self {
            transport,
            prefix,
            releases: Releases::default(),
        }
    }

    fn held(&self, name: &str, digest: &KeyDigest, slot: u128, ttl: Micros) -> Held {
        Held {
            key: BaseKey::new(&self.prefix, name, digest)
                .with(Suffix::Slots)
                .as_bytes()
                .to_vec(),
            digest: *digest,
            slot,
            ttl,
        }
    }

    /// The slots that `checks` hold; `digest` gives the digest of a (limit name, key).
    pub(crate) fn of_checks(
        &self,
        checks: &[Check<'_>],
        digest: impl Fn(&str, &[u8]) -> KeyDigest,
    ) -> Vec<Held> {
        checks
            .iter()
            .filter(|c| c.limit.algorithm() == Algorithm::Concurrency)
            .map(|c| {
                let d = digest(c.limit.name(), c.key);
                // The limit's slot lifetime, whatever the plan the slot was taken under.
                self.held(c.limit.name(), &d, c.slot, c.limit.quota().period_micros())
            })
            .collect()
    }

    /// The slots a batch may take: given back unless the call is answered (see [`Unclaimed`]).
    pub(crate) fn unclaimed(self: &Arc<Self>, batch: &[EncodedCheck]) -> Option<Unclaimed> {
        batch
            .iter()
            .any(|p| p.algorithm == Algorithm::Concurrency)
            .then(|| Unclaimed {
                slots: Arc::clone(self),
                held: batch
                    .iter()
                    .filter(|p| p.algorithm == Algorithm::Concurrency)
                    // The slot's lifetime, as the check encodes it (the limit's, under
                    // every plan).
                    .map(|p| self.held(&p.name, &p.digest, p.slot, p.params[0]))
                    .collect(),
            })
    }

    /// The digests of `batch`'s concurrency keys that have a release in flight: a check of
    /// them waits for it ([`released`](Self::released)).
    pub(crate) fn releasing(&self, batch: &[EncodedCheck]) -> Vec<KeyDigest> {
        let mut digests: Vec<KeyDigest> = Vec::new();
        for p in batch {
            if p.algorithm == Algorithm::Concurrency && self.releases.pending(&[p.digest]) {
                digests.push(p.digest);
            }
        }
        digests
    }

    /// Resolves once no release of `digests` is in flight, or at `until`.
    pub(crate) async fn released(&self, digests: &[KeyDigest], until: Instant) {
        self.releases.answered(digests, until).await;
    }

    /// `ZREM`s `held` in a spawned task, again and again while Redis fails, until each slot
    /// would have expired anyway. Counted in [`Releases`] until each slot's first attempt is
    /// answered (or failed, by the deadline): the receiver answers then. Without a runtime (a
    /// process shutting down), nothing is sent: the slots expire.
    pub(crate) fn release(self: &Arc<Self>, held: Vec<Held>) -> Option<oneshot::Receiver<()>> {
        if held.is_empty() {
            return None;
        }
        let runtime = tokio::runtime::Handle::try_current().ok()?;
        let (landed, landing) = oneshot::channel();
        let in_flight = InFlight::new(self, &held, landed);
        let slots = Arc::clone(self);
        runtime.spawn(async move {
            let mut failed = Vec::new();
            for slot in held {
                let cmd = zrem(&slot);
                if !slots.attempt(&cmd).await {
                    failed.push((cmd, slot.ttl));
                }
            }
            drop(in_flight);
            for (cmd, ttl) in failed {
                slots.retry(&cmd, ttl).await;
            }
        });
        Some(landing)
    }

    /// Renews `held` in a spawned task (one attempt per slot, within the deadline: the next
    /// renewal comes a third of a lifetime later).
    pub(crate) fn renew(self: &Arc<Self>, held: Vec<Held>) {
        if held.is_empty() {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let transport = Arc::clone(&self.transport);
        runtime.spawn(async move {
            for slot in held {
                let call = renew::call(&slot.key, slot.slot, slot.ttl);
                let renewal = transport.invoke(renew::script(), &call);
                let _ = transport.within_deadline(renewal, "to renew a slot").await;
            }
        });
    }

    /// One attempt at `cmd`, within the deadline (at least 100 ms); whether Redis answered.
    async fn attempt(&self, cmd: &redis::Cmd) -> bool {
        let within = self.transport.deadline().max(Duration::from_millis(100));
        matches!(
            tokio::time::timeout(within, self.transport.query(cmd)).await,
            Ok(Ok(_))
        )
    }

    /// Sends `cmd` until Redis answers, waiting longer each time, for at most `within`
    /// microseconds.
    async fn retry(&self, cmd: &redis::Cmd, within: Micros) {
        let give_up = Instant::now() + Duration::from_micros(within);
        let mut wait = Duration::from_millis(50);
        while Instant::now() + wait < give_up {
            tokio::time::sleep(wait).await;
            if self.attempt(cmd).await {
                return;
            }
            wait = (wait * 2).min(Duration::from_secs(2));
        }
    }
}

/// Gives back, in the background, the slots a batch may have taken unless it is disarmed:
/// dropped with the call (the caller went away), or kept when the call failed after it may have
/// been sent.
pub(crate) struct Unclaimed {
    slots: Arc<SlotKeeper>,
    held: Vec<Held>,
}

impl Unclaimed {
    /// The call was answered: what it took is the caller's to give back.
    pub(crate) fn disarm(mut self) {
        self.held.clear();
    }
}

impl Drop for Unclaimed {
    fn drop(&mut self) {
        self.slots.release(std::mem::take(&mut self.held));
    }
}

/// The slot releases this replica has sent and Redis has not answered yet, per key.
///
/// A release travels on the shared connection, a check on the checks' own: without this, the
/// next request of a client that did not wait for the end of its response (or a check made
/// while another request's response ends) could reach Redis before the release of a slot of
/// its key, and find it still taken. A check of a concurrency limit made while releases of
/// one of its keys are in flight waits for their first attempt (at most its deadline); a
/// release of another key does not hold it.
#[derive(Debug, Default)]
struct Releases {
    /// Releases in flight, of every key: none is the commonest case, and costs no lock.
    pending: AtomicUsize,
    /// Releases in flight per key (by digest); a key leaves at none.
    keys: Mutex<HashMap<KeyDigest, usize>>,
    /// Woken whenever a release's first attempt ends.
    done: Notify,
}

impl Releases {
    fn lock(&self) -> MutexGuard<'_, HashMap<KeyDigest, usize>> {
        self.keys.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Counts the releases of `digests` as in flight.
    fn begin(&self, digests: &[KeyDigest]) {
        let mut keys = self.lock();
        for d in digests {
            *keys.entry(*d).or_insert(0) += 1;
        }
        self.pending.fetch_add(digests.len(), Ordering::AcqRel);
    }

    /// The releases of `digests` have had their first attempt.
    fn end(&self, digests: &[KeyDigest]) {
        {
            let mut keys = self.lock();
            for d in digests {
                if let Some(n) = keys.get_mut(d) {
                    *n -= 1;
                    if *n == 0 {
                        keys.remove(d);
                    }
                }
            }
            self.pending.fetch_sub(digests.len(), Ordering::AcqRel);
        }
        self.done.notify_waiters();
    }

    /// Whether a release of one of `digests` is in flight.
    fn pending(&self, digests: &[KeyDigest]) -> bool {
        if self.pending.load(Ordering::Acquire) == 0 {
            return false;
        }
        let keys = self.lock();
        digests.iter().any(|d| keys.contains_key(d))
    }

    /// Resolves once no release of `digests` is in flight, or at `until`.
    async fn answered(&self, digests: &[KeyDigest], until: Instant) {
        loop {
            let done = self.done.notified();
            tokio::pin!(done);
            done.as_mut().enable();
            if !self.pending(digests) {
                return;
            }
            if tokio::time::timeout_at(until, done).await.is_err() {
                return;
            }
        }
    }
}

/// One release in flight, counted until dropped (also when its task is cancelled); its
/// sender, dropped with it, tells the layer that the release has landed.
struct InFlight {
    slots: Arc<SlotKeeper>,
    digests: Vec<KeyDigest>,
    _landed: oneshot::Sender<()>,
}

impl InFlight {
    fn new(slots: &Arc<SlotKeeper>, held: &[Held], landed: oneshot::Sender<()>) -> Self {
        let digests: Vec<KeyDigest> = held.iter().map(|h| h.digest).collect();
        slots.releases.begin(&digests);
        Self {
            slots: Arc::clone(slots),
            digests,
            _landed: landed,
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.slots.releases.end(&self.digests);
    }
}

fn zrem(slot: &Held) -> redis::Cmd {
    let mut cmd = redis::cmd("ZREM");
    cmd.arg(&slot.key[..]).arg(slot_id::member(slot.slot));
    cmd
}

#[cfg(test)]
mod tests {
    use futures_util::FutureExt;

    use super::*;

    /// A check waits for the releases of its own keys only: one of another key in flight
    /// does not hold it, and a key's wait ends when the last of its releases is answered.
    #[tokio::test(start_paused = true)]
    async fn a_check_waits_only_for_the_releases_of_its_own_keys() {
        let releases = Releases::default();
        let (a, b) = ([1u8; DIGEST_LEN], [2u8; DIGEST_LEN]);
        let until = Instant::now() + Duration::from_millis(50);
        releases.begin(&[a, a]);
        assert!(!releases.pending(&[b]));
        assert_eq!(releases.answered(&[b], until).now_or_never(), Some(()));
        assert!(releases.pending(&[b, a]));
        let keys = [a];
        let mut waiting = Box::pin(releases.answered(&keys, until));
        assert_eq!((&mut waiting).now_or_never(), None);
        releases.end(&[a]);
        assert_eq!((&mut waiting).now_or_never(), None);
        releases.end(&[a]);
        assert_eq!((&mut waiting).now_or_never(), Some(()));
        assert!(releases.lock().is_empty());
        assert_eq!(releases.pending.load(Ordering::Acquire), 0);
        // A release never answered holds a check of its key until the check's deadline.
        releases.begin(&[b]);
        let start = Instant::now();
        releases
            .answered(&[b], start + Duration::from_millis(50))
            .await;
        assert_eq!(start.elapsed(), Duration::from_millis(50));
    }
}
