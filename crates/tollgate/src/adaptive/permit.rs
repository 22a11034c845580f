//! What a request holds of the adaptive limit: its [`Permit`] while it runs, or its place
//! in the queue while it waits ([`PermitWait`]).
//!
//! A permit is given back exactly once, when it is dropped: with the response body (its end,
//! or its drop), or with the response future when the request never reached the handler
//! (refused by another limit) or was dropped before its answer. Only a request whose handler
//! answered tells the controller its latency (from the handler's start to the response head);
//! one dropped before that tells nothing, unless it ran for the timeout or longer, which is
//! overload.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::time::{Instant, Sleep};

use super::classes::Priority;
use super::controller::Sample;
use super::gate::Gate;
use super::line::{Place, Turn};
use super::outcome::{AdaptiveDecision, ShedReason};

/// One request's hold on the adaptive limit.
pub(crate) struct Permit {
    gate: Arc<Gate>,
    fp: u64,
    epoch: u64,
    /// When the handler started.
    started: Option<Instant>,
    /// Whether the controller has its sample.
    told: bool,
    pub(crate) part: AdaptiveDecision,
}

impl Permit {
    pub(crate) fn new(gate: Arc<Gate>, fp: u64, epoch: u64, part: AdaptiveDecision) -> Self {
        Self {
            gate,
            fp,
            epoch,
            started: None,
            told: false,
            part,
        }
    }

    /// The handler starts now (once).
    pub(crate) fn start(&mut self) {
        self.started.get_or_insert_with(Instant::now);
    }

    /// The handler answered (its head, or its error: `failed` with a 5xx or an error).
    pub(crate) fn answered(&mut self, failed: bool) {
        let Some(started) = self.started.filter(|_| !self.told) else {
            return;
        };
        self.told = true;
        let sample = if failed {
            Sample::Failed
        } else {
            Sample::Answered(u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX))
        };
        self.gate.sample(self.epoch, sample);
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        // Dropped before its answer: no sample of a fast service; after the timeout, overload.
        let abandoned = match self.started {
            Some(started) if !self.told && started.elapsed() >= self.gate.s.timeout => {
                Some(Sample::Failed)
            }
            _ => None,
        };
        self.gate.release(self.fp, self.epoch, abandoned);
    }
}

impl std::fmt::Debug for Permit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Permit")
            .field("limit", &self.gate.name)
            .field("part", &self.part)
            .finish_non_exhaustive()
    }
}

/// A request waiting in the adaptive limit's queue.
pub(crate) struct PermitWait {
    gate: Arc<Gate>,
    place: Place,
    fp: u64,
    level: Priority,
    since: Instant,
    sleep: Pin<Box<Sleep>>,
    done: bool,
}

impl PermitWait {
    pub(crate) fn new(
        gate: Arc<Gate>,
        (place, fp): (Place, u64),
        level: Priority,
        wait: Duration,
    ) -> Self {
        let since = Instant::now();
        Self {
            gate,
            place,
            fp,
            level,
            since,
            sleep: Box::pin(tokio::time::sleep_until(since + wait)),
            done: false,
        }
    }

    /// Its turn: a permit, or the decision that shed it.
    pub(crate) fn poll_turn(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Result<Permit, AdaptiveDecision>> {
        if self.done {
            return Poll::Pending;
        }
        let turn = match self.gate.turn(self.place, cx.waker()) {
            Some(turn) => Some(turn),
            None if self.sleep.as_mut().poll(cx).is_ready() => Some(
                self.gate
                    .leave(self.place)
                    .unwrap_or(Turn::Shed(ShedReason::QueueTimeout)),
            ),
            None => None,
        };
        let Some(turn) = turn else {
            return Poll::Pending;
        };
        self.done = true;
        let waited = self.since.elapsed();
        Poll::Ready(match turn {
            Turn::Admitted(epoch) => {
                let part = AdaptiveDecision::new(self.level, None, false).queued_for(waited);
                Ok(Permit::new(Arc::clone(&self.gate), self.fp, epoch, part))
            }
            Turn::Shed(reason) => {
                self.gate.count_shed(self.level, reason);
                Err(AdaptiveDecision::new(self.level, Some(reason), false).queued_for(waited))
            }
        })
    }
}

impl Drop for PermitWait {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        // A turn given and never seen: the request was counted in flight, and is no longer.
        if let Some(Turn::Admitted(epoch)) = self.gate.leave(self.place) {
            self.gate.release(self.fp, epoch, None);
        }
    }
}
