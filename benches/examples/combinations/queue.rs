//! Queued concurrency limits in the combination harness: requests sent on tasks of their
//! own, the model's lines (per replica and key, first come first served), and what a
//! waiter's answer must say.
//!
//! In memory Tokio's clock is paused for the whole sequence and moves only a millisecond at
//! a time, by the harness: a slot given back on a replica must wake its first waiter at once,
//! a wait must end exactly when it is up. After every operation the harness lets time pass
//! until nothing is due: no key with a free slot and a waiter, no first waiter that its
//! other limits (or a deny, or a block) refuse, no wait that is up. Then waiters can only
//! wait, so the next operation meets the state the model holds.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use axum::http::header::RETRY_AFTER;
use axum::http::StatusCode;
use axum::response::Response;
use tokio::time::Instant;
use tollgate::{Decision, DenyReason};
use tollgate_engine::{Backend, Status};
use tower::ServiceExt;

use super::{refused_for, Kind, Req, Run, Standing};

/// A request waiting in a queued limit's line, as the model sees it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Waiter {
    pub(crate) r: Req,
    /// The reload generation it came under: it is checked again under that set of limits.
    pub(crate) generation: usize,
    pub(crate) joined: Instant,
    /// It waited through a restart of Redis: a check may have failed open.
    pub(crate) through_restart: bool,
}

/// Where a waiter stood when it was answered.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Waited {
    pub(crate) generation: usize,
    /// Tokio's time since it took its place.
    pub(crate) elapsed: Duration,
    /// At the front of its line.
    pub(crate) front: bool,
    /// Its wait was up.
    pub(crate) last: bool,
    pub(crate) through_restart: bool,
}

/// How many yields let every task that was woken run to its next wait (in memory nothing
/// else waits).
const YIELDS: usize = 32;
/// How many steps (1 ms each) may pass with something due and nothing answered: a first
/// waiter polls at most 120 ms after its last poll.
const STUCK: u32 = 400;

impl<B: Backend> Run<'_, B> {
    /// The queue's wait.
    fn wait(&self) -> Duration {
        Duration::from_micros(self.shape.queue.map_or(0, |q| q.0))
    }

    /// Lets the tasks that were woken run.
    pub(crate) async fn let_tasks_run(&self) {
        for _ in 0..YIELDS {
            tokio::task::yield_now().await;
        }
    }

    /// One millisecond: of Tokio's paused clock in memory, of real time on Redis.
    async fn tick(&self) {
        if self.kind == Kind::Memory {
            tokio::time::advance(Duration::from_millis(1)).await;
        } else {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    /// Whether the model admits `r`'s rate limit under `generation` now, and no deny nor
    /// block refuses it.
    fn rate_admits(&self, r: Req, generation: usize) -> bool {
        let quota = self.quota_at(r.pro, generation);
        let cost = if self.shape.metered() { r.cost } else { 1 };
        let algorithm = self.shape.algorithm;
        if !self.shape.enforces(r.key, generation) {
            // A shadow limit for this key: only a deny by hand refuses it.
            return !matches!(self.model.standing(r.key), Some(Standing::Denied(_)));
        }
        self.model.standing(r.key).is_none()
            && self.model.check(algorithm, r.key, (&quota, 0), cost).0 == Status::Allowed
    }

    /// Whether a request waits in a line of `key`, on any replica.
    pub(crate) fn has_waiters(&self, key: &str) -> bool {
        self.lines
            .iter()
            .any(|((_, k), l)| *k == key && !l.is_empty())
    }

    fn slot_free(&self, key: &str) -> bool {
        let held = self.model.keys.get(key).map_or(0, |k| k.held);
        self.shape.slots.is_some_and(|n| held < n)
    }

    /// Whether `r` waits in its key's line on its replica: behind others there without a
    /// check if the line has room; else when only its key's full slots refuse it.
    fn waits(&self, r: Req) -> bool {
        let Some((_, max)) = self.shape.queue else {
            return false;
        };
        if (r.key == super::VIP && self.shape.allowlist)
            || self.shape.denylisted(r.key, self.generation)
        {
            return false;
        }
        let in_line = self.lines.get(&(r.replica, r.key)).map_or(0, VecDeque::len);
        if in_line > 0 {
            return in_line < max as usize;
        }
        self.rate_admits(r, self.generation) && !self.slot_free(r.key)
    }

    /// Sends `r` on a task of its own: answered at once, or a waiter.
    pub(crate) async fn send_queued(&mut self, r: Req) {
        // Answers that came meanwhile first: their places left the lines.
        self.take_answers().await;
        let id = self.sent;
        self.sent += 1;
        // A shed request is answered at once, and takes no place.
        self.expect_shed = self.sheds(r);
        let waits = !self.expect_shed && self.waits(r);
        let req = self.request_of(r);
        let app = self.replicas[r.replica].app.clone();
        let answered = Arc::clone(&self.answered);
        tokio::spawn(async move {
            let res = app.oneshot(req).await.unwrap();
            answered.lock().unwrap().push((id, res));
        });
        let waiter = Waiter {
            r,
            generation: self.generation,
            joined: Instant::now(),
            through_restart: false,
        };
        self.direct = Some((id, r));
        if self.kind == Kind::Memory {
            self.let_tasks_run().await;
            self.take_answers().await;
            let at_once = self.direct.is_none();
            if self.shape.exact() && at_once == waits && self.judged(r.key) {
                self.fail(format!(
                    "{r:?}: {}; the model says it {}",
                    if at_once { "answered at once" } else { "waits" },
                    if waits {
                        "waits"
                    } else {
                        "is answered at once"
                    }
                ));
            }
        } else if waits {
            // Redis: its first check goes out before the next operation, mostly (an answer
            // without a wait is judged as it comes: `judge_waiter`).
            tokio::time::sleep(Duration::from_millis(2)).await;
        } else {
            // Redis: its answer comes after a round trip.
            for _ in 0..3_000 {
                self.take_answers().await;
                if self.direct.is_none() {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            if self.direct.is_some() {
                self.fail(format!(
                    "{r:?}: not answered in 3 s; the model says it does not wait"
                ));
            }
        }
        if self.direct.take().is_some() {
            self.tally.waiting += 1;
            self.lines
                .entry((r.replica, r.key))
                .or_default()
                .push_back(id);
            self.waiters.insert(id, waiter);
        }
    }

    /// Judges every answer that came, in the order they came. Each was checked before the
    /// harness ended any of them: a slot given back by one is given back in the model only
    /// once the others of its key are judged.
    async fn take_answers(&mut self) -> bool {
        let mut answers = std::mem::take(&mut *self.answered.lock().unwrap());
        if self.kind != Kind::Memory {
            // On Redis an admission comes back after the handler, so after a refusal checked
            // later: the admissions go first (a refusal never admits anything after it, but
            // a block, which would have refused them).
            answers.sort_by_key(|(_, res)| {
                matches!(
                    res.status(),
                    StatusCode::TOO_MANY_REQUESTS | StatusCode::FORBIDDEN
                )
            });
        }
        let any = !answers.is_empty();
        let keys: Vec<&'static str> = answers
            .iter()
            .filter_map(|(id, _)| match self.direct {
                Some((direct, r)) if direct == *id => Some(r.key),
                _ => self.waiters.get(id).map(|w| w.r.key),
            })
            .collect();
        for (i, (id, res)) in answers.into_iter().enumerate() {
            self.batch = keys.get(i + 1..).unwrap_or_default().to_vec();
            match self.direct {
                Some((direct, r)) if direct == id => {
                    self.direct = None;
                    self.judge(r, res, None).await;
                }
                _ => self.judge_waiter(id, res).await,
            }
            self.sent_at = None;
        }
        self.batch.clear();
        for (key, replica) in std::mem::take(&mut self.after_batch) {
            let entry = self.model.keys.entry(key).or_default();
            entry.held = entry.held.saturating_sub(1);
            self.released(key, replica).await;
        }
        any
    }

    /// A waiter's answer: out of its line, then judged where it stood.
    async fn judge_waiter(&mut self, id: u64, res: Response) {
        let Some(w) = self.waiters.remove(&id) else {
            return self.fail(format!("answer #{id}: no such request"));
        };
        let at = (w.r.replica, w.r.key);
        let mut place = None;
        if let Some(line) = self.lines.get_mut(&at) {
            place = line.iter().position(|x| *x == id);
            if let Some(p) = place {
                line.remove(p);
            }
            if line.is_empty() {
                self.lines.remove(&at);
            }
        }
        let elapsed = w.joined.elapsed();
        self.sent_at = Some(w.joined);
        let queued = res
            .extensions()
            .get::<Decision>()
            .and_then(Decision::queued);
        if self.kind != Kind::Memory && queued.is_none() && !w.through_restart {
            // On Redis the harness does not see a request take its place: its first check
            // came after the operation that followed it, and answered it at once.
            if self.verbose {
                println!("    #{id} {:?} was answered at once", w.r);
            }
            return self.judge(w.r, res, None).await;
        }
        if self.verbose {
            println!(
                "    #{id} {:?} answered after {elapsed:?}, place {place:?}",
                w.r
            );
        }
        let from = Waited {
            generation: w.generation,
            elapsed,
            front: place == Some(0),
            last: elapsed >= self.wait(),
            through_restart: w.through_restart,
        };
        self.judge(w.r, res, Some(from)).await;
    }

    /// What every waiter's answer says: how long it waited (in memory exactly), and that it
    /// was answered from the front of its line, or when its wait was up.
    pub(crate) fn expect_waited(&mut self, r: Req, w: Waited, decision: Option<&Decision>) {
        let queued = decision.and_then(Decision::queued);
        let right = match queued {
            Some(q) if self.kind == Kind::Memory => q == w.elapsed.max(Duration::from_micros(1)),
            Some(q) => q <= w.elapsed,
            None => false,
        };
        if !right {
            self.fail(format!(
                "{r:?}: waited {:?} in its line, the decision says {queued:?}",
                w.elapsed
            ));
        }
        if !w.front && !w.last {
            self.fail(format!(
                "{r:?}: answered from behind the front of its line after {:?}",
                w.elapsed
            ));
        }
    }

    /// A queued shape's answer: a waiter admitted says `queued`; a request refused for its
    /// full key alone was a waiter whose wait was up (in memory: exactly then), or found its
    /// line full; either refusal says the limit's `Retry-After` (1 s) and its RateLimit
    /// fields.
    pub(crate) fn expect_queue_answer(
        &mut self,
        r: Req,
        from: Option<Waited>,
        (res, decision): (&Response, Option<&Decision>),
        (admitted, full): (bool, bool),
    ) {
        let slots = decision.and_then(|d| d.get("slots"));
        if admitted {
            if from.is_some() {
                self.tally.queued += 1;
                if slots.map(|l| l.label()) != Some("queued") {
                    self.fail(format!(
                        "{r:?}: admitted after a wait, the slots say {slots:?}"
                    ));
                }
            }
            return;
        }
        if !full || !self.shape.exact() {
            return;
        }
        let in_flight = refused_for(decision, "slots", DenyReason::InFlight);
        let fields = res.status() == StatusCode::TOO_MANY_REQUESTS
            && res.headers().get(RETRY_AFTER).and_then(|v| v.to_str().ok()) == Some("1")
            && res.headers().contains_key("ratelimit")
            && in_flight;
        if !fields {
            // On a cluster, a check that runs while another request of its key holds rate
            // units that a refund is about to give back (taken on the rate limit's node, its
            // slots refused on another) sees them used, and may be refused by the rate limit:
            // counted, when a waiter of its key was in a line then (every check of a waiter
            // takes its units and gives them back while the slots are full), or such a
            // refusal of its key was answered after it was sent.
            let raced = self.kind == Kind::Cluster
                && refused_for(decision, "rate", DenyReason::OverLimit)
                && (self.waiters.values().any(|w| w.r.key == r.key)
                    || self
                        .sent_at
                        .is_some_and(|sent| self.refunded.get(r.key).is_some_and(|&t| t >= sent)));
            if raced {
                self.tally.refund_raced += 1;
                return;
            }
            self.fail(format!(
                "{r:?}: refused for a full key with {:?} ({slots:?})",
                res.headers()
            ));
        }
        match from {
            Some(w) => {
                self.tally.timed_out += 1;
                let wait = self.wait();
                let on_time = if self.kind == Kind::Memory {
                    w.elapsed >= wait && w.elapsed <= wait + Duration::from_millis(1)
                } else {
                    w.elapsed >= wait
                };
                if !on_time {
                    self.fail(format!(
                        "{r:?}: refused for its full key after {:?} in line, its wait is {wait:?}",
                        w.elapsed
                    ));
                }
            }
            None => {
                self.tally.line_full += 1;
                let max = self.shape.queue.map_or(0, |q| q.1) as usize;
                let in_line = self.lines.get(&(r.replica, r.key)).map_or(0, VecDeque::len);
                if in_line < max {
                    self.fail(format!(
                        "{r:?}: refused for its full key with {in_line} of {max} in its line"
                    ));
                }
            }
        }
    }

    /// Whether something must happen without another operation: a key with a free slot and
    /// a waiter, a first waiter whose check the model refuses, a wait that is up.
    fn due(&self) -> Option<String> {
        let wait = self.wait();
        for (&(replica, key), line) in &self.lines {
            for id in line {
                if self.waiters[id].joined.elapsed() >= wait {
                    return Some(format!("#{id} of {key} on {replica}: its wait is up"));
                }
            }
            let Some(front) = line.front() else {
                continue;
            };
            if self.slot_free(key) {
                return Some(format!("{key}: a free slot, #{front} waits on {replica}"));
            }
            let w = &self.waiters[front];
            if self.shape.exact() && self.judged(key) && !self.rate_admits(w.r, w.generation) {
                return Some(format!(
                    "{key}: #{front} on {replica} is refused at its turn"
                ));
            }
        }
        None
    }

    /// Lets time pass until nothing is due; in memory, the first waiter of a line whose slot
    /// was given back on its replica must have been checked at once.
    pub(crate) async fn settle_waiters(&mut self) {
        if self.shape.queue.is_none() {
            return;
        }
        let mut idle = 0;
        loop {
            let woken: Vec<(u64, usize, &'static str)> = std::mem::take(&mut self.woken)
                .into_iter()
                .filter_map(|(replica, key)| {
                    let front = self.lines.get(&(replica, key))?.front()?;
                    Some((*front, replica, key))
                })
                .collect();
            self.let_tasks_run().await;
            let answered: Vec<u64> = self.answered.lock().unwrap().iter().map(|a| a.0).collect();
            if self.kind == Kind::Memory && self.shape.exact() {
                for (id, replica, key) in woken {
                    if !answered.contains(&id) {
                        self.fail(format!(
                            "a slot of {key} given back on replica {replica}: its first \
                             waiter #{id} was not checked at once"
                        ));
                    }
                }
            }
            if self.take_answers().await {
                idle = 0;
                continue;
            }
            let Some(due) = self.due() else {
                break;
            };
            idle += 1;
            if idle > STUCK {
                self.fail(format!("nothing answered in {STUCK} ms: {due}"));
                break;
            }
            self.tick().await;
        }
        for doubled in self.flight.doubled() {
            self.fail(doubled);
        }
    }

    /// `by` of Tokio's time passes (in memory a millisecond at a time).
    pub(crate) async fn pass(&mut self, by: u64) {
        self.tally.passes += 1;
        if self.kind == Kind::Memory {
            for _ in 0..by / 1_000 {
                tokio::time::advance(Duration::from_millis(1)).await;
                self.settle_waiters().await;
            }
        } else {
            tokio::time::sleep(Duration::from_micros(by)).await;
        }
    }

    /// Ends every held response and lets every waiter be answered.
    pub(crate) async fn drain_queue(&mut self) {
        for _ in 0..1_000 {
            self.settle_waiters().await;
            if !self.held.is_empty() {
                self.finish().await;
            } else if !self.waiters.is_empty() {
                let wait = self.wait().as_micros() as u64;
                self.pass(wait + 2_000).await;
            } else {
                return;
            }
        }
        self.fail(format!("{} waiters left at the end", self.waiters.len()));
    }
}
