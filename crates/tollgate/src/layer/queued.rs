//! A request that waits in a queued concurrency limit's line (`queue.rs`), and its checks
//! when its turn comes.
//!
//! It holds its request, the service polled ready for it and its facts (its place among
//! them), and nothing of any limit. At the front of its line it checks again, whole: at
//! once when it comes to the front or a slot of its key is given back in this process, and
//! otherwise every [`poll_after`] (from 5 ms, doubling to 100 ms, ±20%), which is how it
//! learns of a slot given back on another replica. Its last check is made when its wait
//! is over, wherever it stands; that check refuses as a full key always did.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use http::Request;
use tokio::time::{Instant, Sleep};
use tollgate_engine::{Backend, Check, Micros, MAX_CHECKS};

use super::decide::Decided;
use super::facts::{Facts, KeptKeys};
use super::queue::Turn;
use super::state::Shared;
use crate::key::Key;

/// The first poll of a shared backend by the front of a line.
const FIRST_POLL: Duration = Duration::from_millis(5);
/// The longest time between two polls.
const LAST_POLL: Duration = Duration::from_millis(100);

/// How long the front of a line waits before its `attempt`-th poll (from 0): [`FIRST_POLL`]
/// doubled per attempt up to [`LAST_POLL`], then ±20% drawn from `seed` (the request's
/// random slot id), so that replicas' polls of one key spread out.
pub(crate) fn poll_after(attempt: u32, seed: u128) -> Duration {
    let base = FIRST_POLL
        .saturating_mul(1 << attempt.min(16))
        .min(LAST_POLL);
    // SplitMix64 of the seed and the attempt: a fraction in [0, 1).
    let mut z = (seed as u64 ^ (seed >> 64) as u64)
        .wrapping_add(u64::from(attempt).wrapping_mul(0x9e37_79b9_7f4a_7c15));
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    let fraction = (z >> 11) as f64 / (1u64 << 53) as f64;
    base.mul_f64(0.8 + 0.4 * fraction)
}

/// A request waiting in a line, with everything its call needs once its turn comes.
pub(crate) struct Queued<S, B: Backend, ReqBody> {
    pub(crate) req: Request<ReqBody>,
    pub(crate) inner: S,
    /// Its facts; `facts.queueing` holds its place.
    pub(crate) facts: Facts,
    pub(crate) kept: KeptKeys,
    pub(crate) shared: Arc<Shared<B>>,
    since: Instant,
    /// When its wait is over.
    until: Instant,
    /// Its next poll, once it is at the front.
    next_poll: Option<Instant>,
    polls: u32,
    /// Wakes it for its next poll or the end of its wait.
    sleep: Pin<Box<Sleep>>,
    /// Its check in flight.
    check: Option<B::Future>,
}

impl<S, B: Backend, ReqBody> Queued<S, B, ReqBody> {
    /// `req`, waiting in the line `facts.queueing` holds a place in, up to its limit's
    /// queue's wait from now.
    pub(crate) fn new(
        req: Request<ReqBody>,
        inner: S,
        (facts, kept): (Facts, KeptKeys),
        shared: Arc<Shared<B>>,
    ) -> Self {
        let since = Instant::now();
        let wait = facts.queueing.as_ref().map_or(0, |q| {
            facts.set.limits[q.ticket.entry()].limit.queue_micros()
        });
        let until = since + Duration::from_micros(wait);
        Self {
            req,
            inner,
            facts,
            kept,
            shared,
            since,
            until,
            next_poll: None,
            polls: 0,
            sleep: Box::pin(tokio::time::sleep_until(until)),
            check: None,
        }
    }

    /// Waits for the request's turn and checks it; ready with its decision once it is
    /// admitted, or refused by anything but its full key, or its wait is over.
    pub(crate) fn poll_turn(&mut self, cx: &mut Context<'_>) -> Poll<Decided> {
        loop {
            if let Some(check) = self.check.as_mut() {
                let result = ready!(Pin::new(check).poll(cx));
                self.check = None;
                let waited = self.since.elapsed().as_micros();
                if let Some(q) = self.facts.queueing.as_mut() {
                    q.waited = Micros::try_from(waited).unwrap_or(Micros::MAX).max(1);
                }
                let decided =
                    self.shared
                        .decide(&result, &self.req, &mut self.facts, &mut self.kept);
                // What became of the slots it was woken for, to hand on what it left.
                let took = decided.as_ref().map(|d| matches!(d, Decided::Admit(..)));
                if let Some(q) = self.facts.queueing.as_mut() {
                    q.ticket.checked(took);
                }
                if let Some(decided) = decided {
                    return Poll::Ready(decided);
                }
                // Still full: the next poll, later.
                let after = poll_after(self.polls, self.facts.slot);
                self.polls = self.polls.saturating_add(1);
                self.next_poll = Some(Instant::now() + after);
            }
            // Never without a place: taken as at the front, woken.
            let turn = self.facts.queueing.as_mut().map_or(
                Turn {
                    front: true,
                    woken: 1,
                },
                |q| q.ticket.turn(cx),
            );
            let now = Instant::now();
            let last = now >= self.until;
            let woken = turn.woken > 0;
            let due = turn.front && (woken || self.next_poll.is_some_and(|t| t <= now));
            if last || due {
                if let Some(q) = self.facts.queueing.as_mut() {
                    q.last = last;
                }
                self.check = Some(self.shared.recheck(&self.facts, &self.kept));
                continue;
            }
            if turn.front && self.next_poll.is_none() {
                self.next_poll = Some(now + poll_after(self.polls, self.facts.slot));
                self.polls = self.polls.saturating_add(1);
            }
            let wake_at = match self.next_poll {
                Some(poll) if turn.front => poll.min(self.until),
                _ => self.until,
            };
            if self.sleep.deadline() != wake_at {
                self.sleep.as_mut().reset(wake_at);
            }
            ready!(self.sleep.as_mut().poll(cx));
        }
    }
}

impl<B: Backend> Shared<B> {
    /// The backend call that checks a waiting request again, whole: every limit it was
    /// checked under, with its key, quota, cost and slot id from its facts (a delayed
    /// limit's delay only where it holds a place among that limit's waiters).
    pub(crate) fn recheck(&self, facts: &Facts, kept: &KeptKeys) -> B::Future {
        let set = &facts.set;
        let mut checks = [Check::new(&set.limits[0].limit, b""); MAX_CHECKS];
        for (j, &i) in facts.limit_of[..facts.n].iter().enumerate() {
            let limit = &set.limits[i].limit;
            // A layer with a queue keeps every limit's key.
            let key = kept.get(i).map_or(&b""[..], Key::as_bytes);
            let mut check = Check::new(limit, key)
                .with_quota(*limit.quota_at(usize::from(facts.quota_of[i])))
                .with_cost(facts.cost[i])
                .with_slot(facts.slot);
            let delay = limit.delay_micros();
            let placed = facts.seats.as_ref().is_some_and(|p| p.holds(i));
            if delay > 0 && (!check.enforce || placed) {
                check = check.with_delay(delay);
            }
            checks[j] = check;
        }
        facts
            .span
            .in_scope(|| self.backend.check(&checks[..facts.n]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layer::queue::Queueing;
    use bytes::Bytes;
    use http::Response;
    use http_body_util::Full;
    use tollgate_engine::MemoryBackend;

    type Handler = tower::util::ServiceFn<
        fn(Request<Full<Bytes>>) -> std::future::Ready<Result<Response<Full<Bytes>>, ()>>,
    >;

    /// What one request waiting in a line holds, in bytes, on a 64-bit target (written in
    /// docs/benchmarks.md): the boxed state (the request's head, the service, its facts,
    /// room for its check's future) and its timer, its boxed place (`Queueing`), and its
    /// entry in the line; besides, its key's bytes twice (the ticket's copy and the kept
    /// key), and once per key with a line (the line's map's own copy).
    #[test]
    fn a_queued_request_holds_under_one_and_a_quarter_kilobytes() {
        let state = std::mem::size_of::<Queued<Handler, MemoryBackend, Full<Bytes>>>();
        let sleep = std::mem::size_of::<Sleep>();
        let place = std::mem::size_of::<Queueing>();
        // A `Place` in the line's `VecDeque`: number, count, waker.
        let entry = std::mem::size_of::<(u64, u32, Option<std::task::Waker>)>();
        let total = state + sleep + place + entry;
        println!(
            "queued: state {state} + sleep {sleep} + place {place} + entry {entry} = {total} bytes, plus its key"
        );
        assert!(total < 1280, "{total}");
    }

    #[test]
    fn polls_double_from_5_to_100_ms_within_a_fifth() {
        for seed in [
            1u128,
            2,
            u128::MAX,
            0x1234_5678_9abc_def0_1122_3344_5566_7788,
        ] {
            for (attempt, base) in [
                (0, 5),
                (1, 10),
                (2, 20),
                (3, 40),
                (4, 80),
                (5, 100),
                (40, 100),
            ] {
                let after = poll_after(attempt, seed);
                let base = Duration::from_millis(base);
                assert!(
                    after >= base.mul_f64(0.8) && after < base.mul_f64(1.2),
                    "{after:?}"
                );
            }
        }
        // Two requests poll at different times.
        assert_ne!(poll_after(5, 1), poll_after(5, 2));
    }
}
