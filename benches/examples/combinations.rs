//! Features combined, on the real layer and backends, against a model of what they promise.
//!
//! ```text
//! cargo run --release -p tollgate-bench --example combinations -- --seeds N [--first S] [--ops K]
//!     [--backends memory,redis,cluster]
//! ```
//!
//! Each seed draws a layer (a GCRA or fixed-window limit with or without a `pro` plan, metered
//! with a refund on `500` or a charge by the handler or not at all, a concurrency limit
//! stacked on it or not (with an adaptive limit beside it: for half of them, but not with a
//! queue on Redis, one of 1 or 2 permits per replica that sheds, else one that never does),
//! queued or not, an allowlisted key or not, a static denylist or not, a quota lease or
//! not, a penalty box on the rate limit or not (with a lease: refused at build; without one,
//! sometimes dropped by every other reload and brought back by the next), in memory a
//! delay on a GCRA limit without a lease or not) and runs it on 2 to 4
//! replicas: `RateLimitLayer`s of their own over one in-memory backend (each through a
//! `Leased` of its own when the limit is leased, as a Redis backend leases), one real
//! `redis-server` (each replica its own `RedisBackend`), or one real 3-master Redis Cluster,
//! which this program starts on loopback ports. Then it sends a seeded sequence of
//! operations, one at a time, through the replicas' axum routers: requests (a key, a plan, a
//! cost, the handler's answer or charge, a response held open or read to its end), the end of
//! a held response, resets, denies and undenies by hand (`RateLimitLayer::deny`), reloads
//! that change the default quota and the denylist, steps of the clock
//! (memory), and restarts of Redis without persistence (standalone). Time does not pass for
//! the model on Redis: quotas are per day, so the real seconds a sequence takes refill nothing.
//!
//! The model is the algorithms of `tollgate_engine::algorithm` applied to the promises of the
//! docs: stacked limits all-or-nothing, a key's usage carried across plans and reloads,
//! settles under the quota of their check, allowlisted requests never counted, bypassed ones
//! never counted, slots given back once. What it checks, per operation and at the end:
//!
//! - every request is admitted or refused exactly as the model says (with a lease: never more
//!   units admitted than the quota; fewer is the documented under-admission); a delayed
//!   limit's admission says it waited exactly the model's `algorithm::gcra_wait`;
//! - after a settle, the key's remaining units are the model's (the settle is sent without
//!   waiting: up to 200 looks, 5 ms apart on Redis; in memory the clock stands meanwhile);
//! - a key denied by hand is refused with 403 and a `Retry-After` to the deny's end (with a
//!   lease, a slice may admit it until the slice runs out, and a waiter's refusal by its
//!   rate limit may come from its check before the deny), a
//!   blocked one with 429 and one to the block's end (the refusal that starts a block says its
//!   whole length, exactly), consuming nothing; a statically denylisted one with 403 and no
//!   `Retry-After`, at every limit; the refusal that makes a penalty's count starts a block,
//!   no other does; a block stands to its end after a reload dropped the penalty, and no
//!   refusal counts toward one meanwhile; a peek of a blocked or denied key says nothing is
//!   left;
//! - a request sent while its replica's open responses and waiters hold every permit of a
//!   small adaptive limit is shed (503, `Retry-After: 1`, every limit not asked), and no
//!   other is; a shed request counts nowhere (no unit, no slot, no refusal toward a penalty:
//!   the model does not count it, and the later answers and peeks agree). Such seeds draw no
//!   restart, whose own requests must not be shed;
//! - an allowlisted request is marked so and counts nowhere; a request answered while Redis
//!   is down is `Bypassed` and counts nowhere;
//! - a leased GCRA limit that settles, and a leased limit with a penalty, are refused when
//!   the layer is built;
//! - once every response has ended, no slot is held, and every key's remaining units are the
//!   model's;
//! - with a queue on the concurrency limit (`queue_up_to`; a queue on the rate limit must be
//!   refused at build, `QueueUnsupported`): the requests go out on tasks of their own, and
//!   the model keeps each replica's line per key. A request waits exactly when its line has
//!   room and either others wait in it or only the full slots refuse it; a waiter is
//!   answered from the front of its line (or when its wait is up), checked again whole
//!   under the limits it came under, and says how long it waited (`queued()`, exactly in
//!   memory); one refused for its full key alone was a waiter whose wait was up (in memory
//!   exactly then) or found its line full, with `Retry-After: 1` and the RateLimit fields;
//!   the handler counts the requests that hold a slot, and a key never has more than its
//!   slots. In memory Tokio's clock is paused and moves a millisecond at a time
//!   (`Op::Pass`, and after each operation until nothing is due): a slot given back on a
//!   replica must wake its first waiter at once. On Redis the same runs in real time, and a
//!   waiter that another replica's poll serves may be any replica's first; one whose wait ran
//!   out may have been checked a last time while a response the harness had not read yet
//!   held its slot, and its units before their settle.
//!
//! Beside the model, the invariants of `combinations/invariants.rs` judge every sequence
//! from outside, with no code of the layer nor of `tollgate_engine::algorithm`: what reached
//! the handler, when, against the quotas as the docs define them; sanctions; identities in
//! Redis; and, once quiet, what the handler saw against `peek`. Deny durations include ten
//! years, 99 (under `MAX_DENY`) and a thousand (past it: refused, nothing denied). Some seeds also draw a timed sequence (`combinations/timed.rs`) on
//! per-second quotas that those invariants alone judge. Each violation is printed on a line
//! of its own with its seed and backend; an invariant's line names it (`invariant NAME:`).
//!
//! Deterministic for a seed but for Redis' timing. The last line is
//! `combinations: K sequences, V violations`; the status is 1 when V > 0.

#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::header::RETRY_AFTER;
use axum::http::{HeaderName, Request, StatusCode};
use axum::response::Response;
use axum::routing::get;
use axum::Router;
use tollgate::cost::{Metered, Settle};
use tollgate::key::{KeyExtractor, Tenant};
use tollgate::{
    Adaptive, AdminError, Allowlist, Decision, DenyReason, Denylist, Limit, Limits, Outcome,
    Penalty, Plan, Quota, RateLimitLayer, SkipReason,
};
use tollgate_engine::algorithm::{self, WindowState};
use tollgate_engine::leased::Leased;
use tollgate_engine::{
    Algorithm, Backend, Check, ConfigError, FakeClock, KeyState, Lease, MemoryBackend, Micros,
    Status, MAX_DENY,
};
use tollgate_redis::RedisBackend;
use tollgate_testsupport::{RedisCluster, RedisServer};
use tower::ServiceExt;

#[path = "combinations/flight.rs"]
mod flight;
#[path = "combinations/invariants.rs"]
mod invariants;
#[path = "combinations/queue.rs"]
mod queue;
#[path = "combinations/timed.rs"]
mod timed;

use bytes::Bytes;
use flight::{Guarded, InFlight};
use invariants::{Frame, Sent, Spec, Trace};
use queue::{Waited, Waiter};
use std::collections::VecDeque;
use std::sync::Mutex;

/// Identities no hash nor encoding spells by chance: the scan of Redis looks for them.
const KEYS: [&str; 3] = ["tenant-zero", "tenant-one", "tenant-two"];
const VIP: &str = "tenant-vip";
/// A key on the static denylist of every generation.
const BAD: &str = "tenant-bad";
const DAY: Micros = 86_400_000_000;
/// A queue's waits (µs of Tokio's clock), and the time that passes in one step (µs; on
/// Redis the shorter three only, as they pass in real time).
const QUEUE_WAITS: [Micros; 3] = [40_000, 150_000, 600_000];
const PASSES: [Micros; 4] = [5_000, 60_000, 200_000, 700_000];

fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        splitmix(&mut self.0) % n
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
    fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len() as u64) as usize]
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Memory,
    Redis,
    Cluster,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Settles {
    None,
    RefundOn500,
    ChargedByHandler,
}

/// The layer a seed draws.
#[derive(Clone, Debug)]
struct Shape {
    algorithm: Algorithm,
    /// The default quota of each reload generation (per day).
    defaults: [u32; 2],
    /// The `pro` plan's quota, if the limit has plans.
    pro: Option<u32>,
    settles: Settles,
    /// A concurrency limit on the same key, and its slots.
    slots: Option<u32>,
    allowlist: bool,
    lease: Option<u32>,
    /// A GCRA limit's delay (`Limit::delay_up_to`), in microseconds: in memory only (on Redis
    /// a wait of hours would run in real time), and not with a lease (whose bound counts
    /// admissions within the burst).
    delay: Option<Micros>,
    /// A penalty box on the rate limit: refusals, window, first block and longest block
    /// (µs). Refused when the layer is built if the limit is leased.
    penalty: Option<[Micros; 4]>,
    /// Odd reload generations drop the penalty and even ones bring it back: a block that
    /// started stands to its end, and refusals count toward a block only under the penalty.
    penalty_in_even_only: bool,
    /// A static denylist: `bad` (and the allowlisted key, which the allowlist still admits),
    /// and `k2` in odd reload generations (a reload replaces the list).
    denylist: bool,
    /// A queue on the concurrency limit (`Limit::queue_up_to`): its wait (µs of Tokio's
    /// clock) and the most waiters per key and replica. Never with a delay: a waiter
    /// admitted ahead of its time would wait hours of Tokio's clock while the sequence goes
    /// on.
    queue: Option<(Micros, u32)>,
    /// A queue on the rate limit too, which `Limit::queue_up_to` refuses
    /// (`ConfigError::QueueUnsupported`).
    queue_on_rate: bool,
    /// The rate limit's enforced share of each reload generation (`Limit::enforce_percent`,
    /// 100: not set): a key outside it is under a shadow limit.
    enforce: [u32; 2],
    /// An adaptive limit small enough to shed (its floor, start and ceiling: it never
    /// moves), drawn by `draw_shedding`; `None`: one too large to shed.
    adaptive: Option<u32>,
}

impl Shape {
    fn draw(rng: &mut Rng) -> Self {
        let algorithm = rng.pick(&[Algorithm::Gcra, Algorithm::FixedWindow]);
        // A queue needs full keys whose other limits still admit: larger quotas.
        let queued = rng.chance(25);
        let low = if queued { 9 } else { 3 } + rng.below(4) as u32;
        let defaults = [low, low + 1 + rng.below(3) as u32];
        // Quotas far apart: a usage carried between them does not convert to whole units.
        let pro = rng
            .chance(50)
            .then(|| defaults[1] + 2 + rng.below(30) as u32);
        let mut settles = rng.pick(&[
            Settles::None,
            Settles::RefundOn500,
            Settles::ChargedByHandler,
        ]);
        let slots = (queued || rng.chance(40)).then(|| 1 + rng.below(2) as u32);
        let allowlist = rng.chance(30);
        let lease = rng.chance(25).then(|| 2 + rng.below(3) as u32);
        // A charge may put a key in debt after other replicas took slices: the lease bound
        // counts admissions net of refunds only.
        if lease.is_some() && algorithm == Algorithm::FixedWindow {
            settles = rng.pick(&[Settles::None, Settles::RefundOn500]);
        }
        let interval = DAY / u64::from(defaults[0]);
        let mut delay = (algorithm == Algorithm::Gcra && lease.is_none() && rng.chance(40))
            .then(|| rng.pick(&[interval / 2, interval, 2 * interval + 1, DAY]));
        // Whole seconds (the quotas are per day of 3 to 6): a block's Retry-After is exact. A
        // leased limit draws one rarely, to see it refused.
        let penalty = rng.chance(if lease.is_some() { 10 } else { 45 }).then(|| {
            let block = rng.pick(&[interval / 2, interval, 2 * interval]);
            [
                1 + rng.below(3),
                rng.pick(&[interval / 2, interval, 3 * interval, DAY]),
                block,
                rng.pick(&[block, 2 * block, 3 * block, 4 * block]),
            ]
        });
        let penalty_in_even_only = penalty.is_some() && lease.is_none() && rng.chance(50);
        let denylist = rng.chance(30);
        let queue = queued.then(|| (rng.pick(&QUEUE_WAITS), 1 + rng.below(3) as u32));
        if queue.is_some() {
            delay = None;
        }
        let queue_on_rate = rng.chance(3);
        let mut enforce = || rng.pick(&[100, 100, 0, 30]);
        let enforce = [enforce(), enforce()];
        Self {
            algorithm,
            defaults,
            pro,
            settles,
            slots,
            allowlist,
            lease,
            delay,
            penalty,
            penalty_in_even_only,
            denylist,
            queue,
            queue_on_rate,
            enforce,
            adaptive: None,
        }
    }

    /// Draws, for some shapes with a concurrency limit, an adaptive limit of 1 or 2 permits
    /// per replica, so that a request sent while its replica's responses hold them is shed.
    /// From a generator of its own, so that the rest of a seed's draw stays as it was. Not
    /// with a queue on Redis: there a waiter takes its permit when its task runs, which the
    /// harness does not see.
    fn draw_shedding(&mut self, rng: &mut Rng, kind: Kind) {
        let queued_in_real_time = self.queue.is_some() && kind != Kind::Memory;
        if self.slots.is_some() && !queued_in_real_time && rng.chance(50) {
            self.adaptive = Some(rng.pick(&[1, 2]));
        }
    }

    /// Whether the rate limit of reload generation `generation` enforces `key`: its share
    /// (`tollgate::engine::rollout_share`, a public hash) below the enforced percent.
    fn enforces(&self, key: &str, generation: usize) -> bool {
        let p = self.enforce[generation % 2];
        p == 100 || u32::from(tollgate::engine::rollout_share(key.as_bytes())) < p
    }

    /// The rate limit's penalty in reload generation `generation`.
    fn penalty_at(&self, generation: usize) -> Option<[Micros; 4]> {
        self.penalty
            .filter(|_| !self.penalty_in_even_only || generation.is_multiple_of(2))
    }

    fn quota(n: u32) -> Quota {
        Quota::per_day(n).unwrap()
    }

    /// The rate limit of reload generation `generation`.
    fn rate(&self, generation: usize) -> Result<Limit, ConfigError> {
        let quota = Self::quota(self.defaults[generation % 2]);
        let mut limit = match self.algorithm {
            Algorithm::Gcra => Limit::gcra("rate", quota)?,
            _ => Limit::fixed_window("rate", quota)?,
        };
        if let Some(pro) = self.pro {
            limit = limit.plan("pro", Self::quota(pro))?;
        }
        if let Some(max_slice) = self.lease {
            limit = limit.with_lease(Lease::new(max_slice)?)?;
        }
        if let Some(delay) = self.delay {
            limit = limit.delay_up_to(Duration::from_micros(delay))?;
        }
        if let Some([after, within, block, max]) = self.penalty_at(generation) {
            limit = limit.penalty(
                Penalty::after(after as u32)
                    .within(Duration::from_micros(within))
                    .block_for(Duration::from_micros(block))
                    .escalating_up_to(Duration::from_micros(max)),
            )?;
        }
        if self.queue_on_rate {
            limit = limit.queue_up_to(Duration::from_secs(1), 1)?;
        }
        let p = self.enforce[generation % 2];
        if p < 100 {
            limit = limit.enforce_percent(p)?;
        }
        Ok(limit)
    }

    fn limits(&self, generation: usize) -> Result<Limits, ConfigError> {
        let rate = self.rate(generation)?;
        let mut limits = Limits::new();
        match self.settles {
            Settles::None => limits = limits.limit(rate, Tenant::header("x-key")),
            Settles::RefundOn500 => limits.push_metered(
                rate,
                Box::new(Tenant::header("x-key")),
                Metered::new()
                    .header(HeaderName::from_static("x-cost"))
                    .count_if(|r| r.status() != StatusCode::INTERNAL_SERVER_ERROR),
            ),
            Settles::ChargedByHandler => limits.push_metered(
                rate,
                Box::new(Tenant::header("x-key")),
                Metered::new()
                    .header(HeaderName::from_static("x-cost"))
                    .charged_by_handler(),
            ),
        }
        if let Some(slots) = self.slots {
            let mut limit = Limit::concurrency("slots", slots)?;
            if let Some((wait, max_waiting)) = self.queue {
                limit = limit.queue_up_to(Duration::from_micros(wait), max_waiting)?;
            }
            limits = limits.limit(limit, Tenant::header("x-key"));
        }
        if self.allowlist {
            limits = limits.with_allowlist(Allowlist::new().keys(Tenant::header("x-key"), [VIP])?);
        }
        if self.denylist {
            let denied = KEYS
                .iter()
                .chain([&VIP, &BAD])
                .copied()
                .filter(|k| self.denylisted(k, generation));
            limits = limits.with_denylist(Denylist::new().keys(Tenant::header("x-key"), denied)?);
        }
        Ok(limits)
    }

    /// Whether `key` is on the static denylist of reload generation `generation`.
    fn denylisted(&self, key: &str, generation: usize) -> bool {
        self.denylist
            && (key == BAD
                || (key == VIP && self.allowlist)
                || (key == KEYS[2] && generation % 2 == 1))
    }

    fn metered(&self) -> bool {
        self.settles != Settles::None
    }

    /// Whether the model predicts every answer: a lease admits fewer, by design.
    fn exact(&self) -> bool {
        self.lease.is_none()
    }
}

/// What the model holds for one key.
#[derive(Clone, Copy, Default, Debug)]
struct KeyModel {
    /// GCRA: the TAT and the interval it is counted in.
    tat: Option<(Micros, Micros)>,
    /// GCRA: when the key's run began (`GcraState::since`).
    since: Micros,
    window: Option<WindowState>,
    /// Slots held by responses still open.
    held: u32,
    /// Units admitted, net of refunds (for the lease bound): in the current window (fixed
    /// window), or as the level of a bucket of the largest quota that drains as the clock
    /// steps (GCRA), in units of its emission interval.
    admitted: u64,
    /// GCRA: the part of an emission interval the bucket has drained beyond `admitted`.
    drained: Micros,
    /// The rate limit's penalty box and run-time deny of the key.
    sanction: Sanction,
}

/// A key's sanctions as the docs promise them (`Penalty`, `deny`): refusals counted in a
/// window that opens at the first of them, the block they start, how many blocks escalate
/// the next one and until when, and a deny's end.
#[derive(Clone, Copy, Default, Debug)]
struct Sanction {
    refusals: u64,
    window_end: Micros,
    blocked_until: Micros,
    strikes: u32,
    strikes_until: Micros,
    denied_until: Micros,
}

/// What stands against a key's every request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Standing {
    /// Denied by hand for this long yet: 403.
    Denied(Micros),
    /// Blocked by the penalty box for this long yet: 429.
    Blocked(Micros),
}

impl Standing {
    fn left(self) -> Micros {
        match self {
            Self::Denied(left) | Self::Blocked(left) => left,
        }
    }
}

impl Sanction {
    /// A deny comes before a block.
    fn standing(&self, now: Micros) -> Option<Standing> {
        if self.denied_until > now {
            Some(Standing::Denied(self.denied_until - now))
        } else if self.blocked_until > now {
            Some(Standing::Blocked(self.blocked_until - now))
        } else {
            None
        }
    }

    /// One refusal of the limit's own algorithm under `[after, within, block, max]`; the
    /// block's length when it is the one that starts a block.
    fn refused(&mut self, [after, within, block, max]: [Micros; 4], now: Micros) -> Option<Micros> {
        if self.window_end <= now {
            (self.refusals, self.window_end) = (0, now + within);
        }
        self.refusals += 1;
        if self.refusals < after {
            return None;
        }
        // A block that starts while the last one is remembered doubles it, up to the longest.
        let strikes = if self.strikes_until > now {
            self.strikes + 1
        } else {
            0
        };
        let length = block.saturating_mul(1 << strikes.min(20)).min(max);
        self.blocked_until = now + length;
        self.strikes = strikes;
        self.strikes_until = self.blocked_until + max;
        (self.refusals, self.window_end) = (0, 0);
        Some(length)
    }

    /// A reset: the block, the refusals and the strikes go; a deny stays.
    fn lift(&mut self) {
        *self = Self {
            denied_until: self.denied_until,
            ..Self::default()
        };
    }
}

struct Model {
    keys: HashMap<&'static str, KeyModel>,
    now: Micros,
}

impl Model {
    fn carried(tat: Option<(Micros, Micros)>, quota: &Quota, now: Micros) -> Option<Micros> {
        tat.map(|(t, from)| algorithm::gcra_carry(t, now, from, quota.emission_interval()))
    }

    /// The verdict of `cost` units of `key` under `quota` (GCRA: with `delay`), what admitting
    /// it writes, and how long it waits (GCRA with a delay, µs).
    fn check(
        &self,
        algorithm: Algorithm,
        key: &str,
        (quota, delay): (&Quota, Micros),
        cost: u32,
    ) -> (Status, KeyModel, Micros) {
        let mut state = self.keys.get(key).copied().unwrap_or_default();
        match algorithm {
            Algorithm::Gcra => {
                let tat = Self::carried(state.tat, quota, self.now);
                let (v, next) = algorithm::gcra_delayed(quota, tat, self.now, cost, delay);
                if let Some(t) = next {
                    if tat.is_none_or(|t| t <= self.now) {
                        state.since = self.now;
                    }
                    state.tat = Some((t, quota.emission_interval()));
                }
                (v.status, state, algorithm::gcra_wait(quota, &v))
            }
            _ => {
                let (v, next) = algorithm::fixed_window(quota, state.window, self.now, cost);
                if let Some(w) = next {
                    state.window = Some(w);
                }
                (v.status, state, 0)
            }
        }
    }

    /// Settles a check made at this instant, which left `mark` (GCRA: its TAT; a fixed
    /// window: `window_end`).
    fn settle(&mut self, algorithm: Algorithm, key: &str, quota: &Quota, s: (u32, u32, Micros)) {
        let (reserved, actual, mark) = s;
        let now = self.now;
        let state = self.keys.entry(key_static(key)).or_default();
        let window_end = mark;
        match algorithm {
            Algorithm::Gcra => {
                let stored = state
                    .tat
                    .map(|(tat, interval)| algorithm::GcraState::new(tat, interval, state.since));
                if let Some(next) =
                    algorithm::gcra_settled(quota, stored, now, (now, mark), reserved, actual)
                {
                    state.tat = (next.tat > now).then_some((next.tat, next.interval));
                    state.since = next.since;
                }
            }
            _ => {
                if window_end <= now {
                    return;
                }
                let most = reserved.saturating_add(quota.limit().saturating_mul(2));
                if let Some(w) = algorithm::fixed_window_settle(
                    state.window,
                    window_end,
                    reserved,
                    actual.min(most),
                ) {
                    state.window = Some(w);
                }
            }
        }
    }

    /// What `peek` of `key` under `quota` says: the remaining units and the whole seconds
    /// until the quota is whole.
    /// A key that a block or a deny refuses has nothing left until it ends.
    fn state(&self, limit: &Limit, key: &str, quota: &Quota) -> (u64, u64) {
        if let Some(standing) = self.standing(key) {
            return (0, standing.left() / 1_000_000);
        }
        let s = self.key_state(limit, key, quota);
        (s.remaining, s.reset.as_secs())
    }

    /// The block or deny that refuses `key` now, if any.
    fn standing(&self, key: &str) -> Option<Standing> {
        self.keys.get(key)?.sanction.standing(self.now)
    }

    /// A fixed window's count in the window that holds now.
    fn window_count(&self, key: &str, quota: &Quota) -> u64 {
        let end = algorithm::window_end(quota, self.now);
        self.keys
            .get(key)
            .and_then(|k| k.window)
            .filter(|w| w.window_end == end)
            .map_or(0, |w| w.count)
    }

    fn key_state(&self, limit: &Limit, key: &str, quota: &Quota) -> KeyState {
        let state = self.keys.get(key).copied().unwrap_or_default();
        // A key that holds nothing now is fresh: its whole quota, nothing to wait for.
        let empty = match limit.algorithm() {
            Algorithm::Gcra => {
                Self::carried(state.tat, quota, self.now).is_none_or(|t| t <= self.now)
            }
            _ => self.window_count(key, quota) == 0,
        };
        if empty {
            return KeyState::fresh(quota);
        }
        let verdict = match limit.algorithm() {
            Algorithm::Gcra => {
                let tat = Self::carried(state.tat, quota, self.now);
                algorithm::gcra(quota, tat, self.now, 1).0
            }
            _ => algorithm::fixed_window(quota, state.window, self.now, 1).0,
        };
        let check = Check::new(limit, key.as_bytes()).with_quota(*quota);
        KeyState::from_probe(&check, verdict)
    }
}

fn key_static(key: &str) -> &'static str {
    KEYS.iter()
        .chain([&VIP, &BAD])
        .find(|k| **k == key)
        .copied()
        .unwrap_or(VIP)
}

/// The adaptive limit of a layer with a concurrency limit that does not shed: never reached
/// by a sequence.
const ADAPTIVE_LIMIT: u32 = 10_000;

/// One replica: its layer (for resets, peeks and reloads) and its router.
struct Replica<B> {
    layer: RateLimitLayer<B>,
    app: Router,
}

fn replica<B: Backend>(
    shape: &Shape,
    backend: B,
    (flight, trace): (&Arc<InFlight>, &Arc<Trace>),
) -> Result<Replica<B>, ConfigError> {
    let mut layer = RateLimitLayer::builder().limits(shape.limits(0)?);
    if shape.slots.is_some() {
        // Every request takes and gives back a permit (refused ones at once, held ones with
        // their body), which `quiesce` counts. A limit pinned (floor = start = ceiling), with
        // no reserve, has exactly that many permits for requests of every class: a small one
        // sheds exactly when the replica's open responses and waiters hold them all.
        let all = shape.adaptive.unwrap_or(ADAPTIVE_LIMIT);
        let adaptive = Adaptive::gradient()
            .name("adaptive")
            .min(all)
            .initial(all)
            .max(all)
            .critical_reserve_percent(0);
        layer = layer.adaptive(adaptive, tollgate::key::Global);
    }
    let layer = layer.backend(backend).build()?;
    let flight = Arc::clone(flight);
    let trace = Arc::clone(trace);
    let app = Router::new()
        .route(
            "/",
            get(move |req: Request<Body>| handler(req, Arc::clone(&flight), Arc::clone(&trace))),
        )
        .layer(layer.clone());
    Ok(Replica { layer, app })
}

/// Answers `x-status`; charges `x-charge` through the `Settle` handle when there is one;
/// counts a request that holds a slot in `flight` until its body is dropped.
async fn handler(req: Request<Body>, flight: Arc<InFlight>, trace: Arc<Trace>) -> Response {
    let header = |name: &str| {
        req.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u32>().ok())
    };
    if let (Some(settle), Some(charge)) = (req.extensions().get::<Settle>(), header("x-charge")) {
        settle.charge(charge);
    }
    let status = header("x-status")
        .and_then(|s| StatusCode::from_u16(s as u16).ok())
        .unwrap_or(StatusCode::OK);
    let key = req
        .headers()
        .get("x-key")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    let decision = req.extensions().get::<Decision>();
    let guard = flight.enter(key, decision);
    let exit = trace.enter(key, req.extensions().get::<Sent>(), decision);
    let body = Guarded {
        data: Some(Bytes::from_static(b"ok")),
        guard,
        exit,
    };
    let mut response = Response::new(Body::new(body));
    *response.status_mut() = status;
    response
}

#[derive(Debug, Clone, Copy)]
struct Req {
    replica: usize,
    key: &'static str,
    pro: bool,
    cost: u32,
    fail: bool,
    charge: u32,
    hold: bool,
}

#[derive(Debug, Clone, Copy)]
enum Op {
    Request(Req),
    /// Ends the oldest held response.
    Finish,
    Reset {
        replica: usize,
        key: &'static str,
    },
    /// A deny of the key by hand (`RateLimitLayer::deny`) for so long (µs).
    Deny {
        replica: usize,
        key: &'static str,
        micros: Micros,
    },
    /// Its lift (`RateLimitLayer::undeny`).
    Undeny {
        replica: usize,
        key: &'static str,
    },
    Reload,
    Step(Micros),
    Restart,
    /// Tokio's time passes (µs): queued requests' waits run out.
    Pass(Micros),
}

fn draw_ops(rng: &mut Rng, shape: &Shape, kind: Kind, replicas: usize, n: usize) -> Vec<Op> {
    let mut ops = Vec::with_capacity(n);
    let interval = DAY / u64::from(shape.defaults[0]);
    for _ in 0..n {
        if shape.queue.is_some() && rng.chance(8) {
            let passes = if kind == Kind::Memory { 4 } else { 3 };
            ops.push(Op::Pass(rng.pick(&PASSES[..passes])));
            continue;
        }
        let roll = rng.below(100);
        let op = match roll {
            0..=61 => {
                let key = if shape.allowlist && rng.chance(10) {
                    VIP
                } else if shape.denylist && rng.chance(8) {
                    BAD
                } else {
                    rng.pick(&KEYS[..])
                };
                let cost = if shape.metered() {
                    1 + rng.below(4) as u32
                } else {
                    1
                };
                Op::Request(Req {
                    replica: rng.below(replicas as u64) as usize,
                    key,
                    pro: shape.pro.is_some() && rng.chance(40),
                    cost,
                    fail: rng.chance(25),
                    charge: rng.below(u64::from(cost) + 7) as u32,
                    hold: shape.slots.is_some()
                        && rng.chance(if shape.queue.is_some() { 65 } else { 40 }),
                })
            }
            62..=75 => Op::Finish,
            76..=80 if shape.exact() => Op::Reset {
                replica: rng.below(replicas as u64) as usize,
                key: rng.pick(&KEYS[..]),
            },
            81..=85 => {
                let replica = rng.below(replicas as u64) as usize;
                let key = if shape.allowlist && rng.chance(15) {
                    VIP
                } else {
                    rng.pick(&KEYS[..])
                };
                if rng.chance(60) {
                    let micros = if rng.chance(10) {
                        // Ten years; 99, at `MAX_DENY` (100 years) less a year; and a
                        // thousand, past it (and past 2^53 µs): refused, nothing denied.
                        rng.pick(&[10 * 365 * DAY, 99 * 365 * DAY, 1_000 * 365 * DAY])
                    } else {
                        rng.pick(&[interval / 2, interval, 3 * interval, DAY])
                    };
                    Op::Deny {
                        replica,
                        key,
                        micros,
                    }
                } else {
                    Op::Undeny { replica, key }
                }
            }
            86..=90 if shape.exact() => Op::Reload,
            91..=96 if kind == Kind::Memory => {
                Op::Step(rng.pick(&[interval / 2, interval, 3 * interval, DAY]))
            }
            97..=99 if kind == Kind::Redis && shape.exact() => Op::Restart,
            _ => Op::Finish,
        };
        ops.push(op);
    }
    ops
}

/// What the sequences did, to show what they covered.
#[derive(Default, Debug, Clone, Copy)]
struct Tally {
    admitted: u64,
    /// Shed by the adaptive limit (nothing consumed).
    shed: u64,
    /// On a cluster, waiters refused by the rate limit while a refund of their key's units
    /// was on its way (see `expect_queue_answer`).
    refund_raced: u64,
    /// Admitted by a delayed limit ahead of their time (they waited).
    delayed: u64,
    refused: u64,
    /// Refused by the penalty box: the refusal that started a block, and those during one.
    blocks: u64,
    blocked: u64,
    /// Refused by a deny by hand, and by the static denylist.
    denied: u64,
    denylisted: u64,
    denies: u64,
    undenies: u64,
    /// Denies past `MAX_DENY`, refused as they must be.
    too_long: u64,
    /// Answers of keys outside the rate limit's enforced share.
    shadowed: u64,
    allowlisted: u64,
    bypassed: u64,
    settled: u64,
    released: u64,
    resets: u64,
    reloads: u64,
    restarts: u64,
    steps: u64,
    refused_at_build: u64,
    /// Queues: requests that waited in a line; admitted after it; refused when their wait
    /// was up; refused at once as their line was full; steps of Tokio's time.
    waiting: u64,
    queued: u64,
    timed_out: u64,
    line_full: u64,
    passes: u64,
    /// Timed sequences run after their seed's, and the milliseconds they took.
    timed: u64,
    timed_ms: u64,
    /// Milliseconds the invariants took after the sequences (peeks, scans of Redis).
    judged_ms: u64,
}

impl Tally {
    fn add(&mut self, o: &Tally) {
        self.admitted += o.admitted;
        self.shed += o.shed;
        self.refund_raced += o.refund_raced;
        self.delayed += o.delayed;
        self.refused += o.refused;
        self.blocks += o.blocks;
        self.blocked += o.blocked;
        self.denied += o.denied;
        self.denylisted += o.denylisted;
        self.denies += o.denies;
        self.undenies += o.undenies;
        self.too_long += o.too_long;
        self.shadowed += o.shadowed;
        self.allowlisted += o.allowlisted;
        self.bypassed += o.bypassed;
        self.settled += o.settled;
        self.released += o.released;
        self.resets += o.resets;
        self.reloads += o.reloads;
        self.restarts += o.restarts;
        self.steps += o.steps;
        self.refused_at_build += o.refused_at_build;
        self.waiting += o.waiting;
        self.queued += o.queued;
        self.timed_out += o.timed_out;
        self.line_full += o.line_full;
        self.passes += o.passes;
        self.timed += o.timed;
        self.timed_ms += o.timed_ms;
        self.judged_ms += o.judged_ms;
    }
}

/// Where a sequence runs.
struct Servers {
    redis: Option<RedisServer>,
    cluster: Option<RedisCluster>,
}

struct Run<'a, B> {
    shape: Shape,
    kind: Kind,
    replicas: Vec<Replica<B>>,
    model: Model,
    generation: usize,
    /// Open responses: their key, the slot limit's model was charged, and the restart epoch.
    held: Vec<(Response, &'static str, bool, u32, usize)>,
    /// The replica and key of the next operation, when it is a request.
    next_request: Option<(usize, &'static str)>,
    /// A release the harness has not waited for, left to the next request to find done.
    unsettled: Option<&'static str>,
    epoch: u32,
    clock: Option<FakeClock>,
    servers: &'a mut Servers,
    violations: Vec<String>,
    /// Per replica: Redis was restarted, and this replica has not had an answer since (its
    /// connection may still be the dead one: one failure, failing open, is expected).
    recovering: Vec<bool>,
    verbose: bool,
    tally: Tally,
    /// Reads a fixed window's count of a key from Redis (the window that holds the given
    /// time); `None` in memory, whose settles apply at once.
    raw_count: Option<RawCount>,
    /// The handler's count of the requests that hold a slot.
    flight: Arc<InFlight>,
    /// Queued shapes: the requests sent on tasks of their own that wait, by number.
    waiters: HashMap<u64, Waiter>,
    /// The model's lines: per replica and key, its waiters, oldest first.
    lines: HashMap<(usize, &'static str), VecDeque<u64>>,
    /// The answers of the requests sent on tasks of their own, as they came.
    answered: Arc<Mutex<Vec<(u64, Response)>>>,
    /// Requests sent on tasks of their own so far (their numbers).
    sent: u64,
    /// The request sent last, until it is answered or known to wait.
    direct: Option<(u64, Req)>,
    /// Replicas and keys where a slot was given back since the last look.
    woken: Vec<(usize, &'static str)>,
    /// The keys of the answers of a batch not judged yet, and the slots given back by those
    /// judged, which the model gives back after the batch.
    batch: Vec<&'static str>,
    after_batch: Vec<(&'static str, usize)>,
    /// In memory, keys (and plans) whose settle is looked at once the waiters are settled.
    after_settle: Vec<(&'static str, bool)>,
    /// What the handlers saw, for the invariants judged from outside.
    trace: Arc<Trace>,
    /// The limiter's time when the last request was sent.
    last_sent: Micros,
    /// Keys once outside the rate limit's enforced share, which the model no longer judges.
    unjudged: std::collections::HashSet<&'static str>,
    /// On a cluster, when a request of each key was last answered refused by its slots after
    /// its rate limit admitted it on another node: until the refund of those units landed
    /// (before that answer), a check of the key running meanwhile saw them held.
    refunded: HashMap<&'static str, tokio::time::Instant>,
    /// When the request being judged was sent, for a request sent on a task of its own.
    sent_at: Option<tokio::time::Instant>,
    /// The model sheds the request sent last (until it is judged).
    expect_shed: bool,
}

/// Whether `decision` says the limit named `limit` refused the request for `why`.
fn refused_for(decision: Option<&Decision>, limit: &str, why: DenyReason) -> bool {
    decision
        .and_then(|d| d.get(limit))
        .is_some_and(|l| matches!(l.outcome(), Outcome::Denied { reason, .. } if *reason == why))
}

/// Reads the count of `key`'s fixed window that holds `now`, under `quota`, from Redis.
type RawCount = Box<dyn Fn(&str, &Quota, Micros) -> Option<u64>>;

impl<B: Backend> Run<'_, B> {
    /// Whether the model judges `key`'s requests: never outside the rate limit's enforced
    /// share, nor once it has been outside it (its state there is a shadow limit's).
    fn judged(&self, key: &str) -> bool {
        !self.unjudged.contains(key) && self.shape.enforces(key, self.generation)
    }

    fn fail(&mut self, what: String) {
        self.violations.push(what);
    }

    fn rate_limit(&self) -> Limit {
        self.shape.rate(self.generation).unwrap()
    }

    fn quota_of(&self, pro: bool) -> Quota {
        self.quota_at(pro, self.generation)
    }

    /// The quota of a request of plan `pro` under reload generation `generation`.
    fn quota_at(&self, pro: bool, generation: usize) -> Quota {
        match (pro, self.shape.pro) {
            (true, Some(n)) => Shape::quota(n),
            _ => Shape::quota(self.shape.defaults[generation % 2]),
        }
    }

    /// Moves Tokio's clock past the deny cache's TTL and the breaker's wait, without sleeping.
    async fn let_caches_expire(&self) {
        if self.kind == Kind::Memory {
            return;
        }
        if self.waiters.is_empty() {
            tokio::time::pause();
            tokio::time::advance(Duration::from_millis(1_100)).await;
            tokio::time::resume();
            return;
        }
        // Waiters' checks may be in flight: a jump past a connection's timeout would fail
        // them. Tokio's clock moves 10 ms at a time, with real time in between to answer them.
        for _ in 0..110 {
            tokio::time::pause();
            tokio::time::advance(Duration::from_millis(10)).await;
            tokio::time::resume();
            tokio::time::sleep(Duration::from_micros(200)).await;
        }
    }

    /// What the invariants know of `r` as it is sent: the quota it is counted under, drawn
    /// from the shape's numbers.
    fn sent_of(&self, r: Req) -> Sent {
        let mut sent = self.trace.sent();
        let n = match (r.pro, self.shape.pro) {
            (true, Some(n)) => n,
            _ => self.shape.defaults[self.generation % 2],
        };
        // `Quota::per_day(n)`: n per day, a burst of n.
        let spec = match self.shape.algorithm {
            Algorithm::Gcra => Spec::gcra(n, n, DAY),
            _ => Spec::window(n, DAY),
        };
        let cost = if self.shape.metered() { r.cost } else { 1 };
        sent.rates = vec![("rate", spec, cost)];
        sent.slots = self.shape.slots;
        match self.shape.settles {
            Settles::RefundOn500 if r.fail => sent.refund = cost,
            Settles::ChargedByHandler if r.charge < cost => sent.refund = cost - r.charge,
            Settles::ChargedByHandler => sent.extra = r.charge - cost,
            _ => {}
        }
        sent.denylisted = self.shape.denylisted(r.key, self.generation);
        sent
    }

    /// The request `r` makes, with what the invariants know of it.
    fn request_of(&mut self, r: Req) -> Request<Body> {
        let sent = self.sent_of(r);
        self.last_sent = sent.at;
        let mut req = Self::bare_request_of(r);
        req.extensions_mut().insert(sent);
        req
    }

    /// The request `r` makes.
    fn bare_request_of(r: Req) -> Request<Body> {
        let mut req = Request::get("/")
            .header("x-key", r.key)
            .header("x-cost", r.cost.to_string())
            .header("x-charge", r.charge.to_string())
            .header("x-status", if r.fail { "500" } else { "200" })
            .body(Body::empty())
            .unwrap();
        if r.pro {
            req.extensions_mut().insert(Plan::new("pro"));
        }
        req
    }

    /// The adaptive permits `replica` holds: one per open response and per waiter (a
    /// waiter holds its permit while it waits).
    fn permits_held(&self, replica: usize) -> usize {
        let open = self.held.iter().filter(|h| h.4 == replica).count();
        let waiting = self.waiters.values().filter(|w| w.r.replica == replica);
        open + waiting.count()
    }

    /// Whether the adaptive limit sheds `r` sent now: its replica holds every permit.
    pub(crate) fn sheds(&self, r: Req) -> bool {
        self.shape
            .adaptive
            .is_some_and(|all| self.permits_held(r.replica) >= all as usize)
    }

    async fn request(&mut self, r: Req) {
        if self.shape.queue.is_some() {
            return self.send_queued(r).await;
        }
        self.expect_shed = self.sheds(r);
        // A delayed request waits in the layer for its time (hours of a per-day quota): Tokio's
        // clock runs it at once while the backend's `FakeClock` stands still.
        let delays = self.shape.delay.is_some();
        if delays {
            tokio::time::pause();
        }
        let req = self.request_of(r);
        let res = self.replicas[r.replica]
            .app
            .clone()
            .oneshot(req)
            .await
            .unwrap();
        if delays {
            tokio::time::resume();
        }
        self.judge(r, res, None).await;
    }

    /// Checks the answer `res` to `r` against the model, and counts it there; `from`: `r`
    /// waited in a queued limit's line.
    async fn judge(&mut self, r: Req, res: Response, from: Option<Waited>) {
        // A waiter is checked again under the limits it came under.
        let generation = from.map_or(self.generation, |w| w.generation);
        let decision = res.extensions().get::<Decision>().cloned();
        let status = res.status();
        let admitted = status != StatusCode::TOO_MANY_REQUESTS && status != StatusCode::FORBIDDEN;
        let cost = if self.shape.metered() { r.cost } else { 1 };

        // The adaptive limit is asked first, before the lists and the backend. A waiter took
        // its permit when it was sent.
        let expect_shed = from.is_none() && std::mem::take(&mut self.expect_shed);
        let shed = decision.as_ref().is_some_and(Decision::is_shed);
        if shed != expect_shed {
            self.fail(format!(
                "{r:?}: answered {status}, shed: {shed}; the model says {} ({} permits of \
                 replica {} held, of {:?})",
                if expect_shed { "shed" } else { "not shed" },
                self.permits_held(r.replica),
                r.replica,
                self.shape.adaptive,
            ));
        }
        if shed {
            // Nothing consumed: no unit, no slot, no refusal toward a penalty.
            if self.verbose {
                println!("    {r:?} -> {status} shed");
            }
            self.tally.shed += 1;
            self.expect_shed_answer(r, &res, decision.as_ref());
            return self.end(res, r, false).await;
        }

        if r.key == VIP && self.shape.allowlist {
            self.tally.allowlisted += 1;
            if !decision.as_ref().is_some_and(Decision::is_allowlisted) || !admitted {
                self.fail(format!("{r:?}: allowlisted request answered {status}"));
            }
            return self.end(res, r, false).await;
        }
        if self.shape.denylisted(r.key, generation) {
            // Refused before the backend: every limit says so, and a static deny has no end.
            self.tally.denylisted += 1;
            let every = decision.as_ref().is_some_and(|d| {
                d.limits().len() == 1 + usize::from(self.shape.slots.is_some())
                    && d.limits()
                        .iter()
                        .all(|l| matches!(l.outcome(), Outcome::Denylisted { retry_after: None }))
            });
            if status != StatusCode::FORBIDDEN || !every || res.headers().contains_key(RETRY_AFTER)
            {
                self.fail(format!(
                    "{r:?}: statically denylisted, answered {status} with {decision:?} and \
                     Retry-After {:?}",
                    res.headers().get(RETRY_AFTER)
                ));
            }
            return self.end(res, r, false).await;
        }
        let bypassed = decision.as_ref().is_some_and(|d| {
            d.limits()
                .iter()
                .any(|l| matches!(l.outcome(), Outcome::Bypassed { .. }))
        });
        let labels = decision.as_ref().map_or(String::new(), |d| {
            d.limits()
                .iter()
                .map(|l| format!("{}={}", l.name(), l.label()))
                .collect::<Vec<_>>()
                .join(",")
        });
        if self.verbose {
            println!(
                "    {r:?} -> {status} {labels}{}",
                if bypassed { " bypassed" } else { "" }
            );
        }
        if bypassed {
            self.tally.bypassed += 1;
            if !self.recovering[r.replica] && !from.is_some_and(|w| w.through_restart) {
                self.fail(format!("{r:?}: bypassed while the backend was up"));
            }
            self.recovering[r.replica] = false;
            return self.end(res, r, false).await;
        }
        self.recovering[r.replica] = false;
        if !self.shape.enforces(r.key, generation) {
            // Outside the enforced share: the rate limit is a shadow one for this key. Never
            // refused by it (judged here from the decision and the public share alone); the
            // model no longer follows the key (its state there is a shadow limit's).
            self.unjudged.insert(r.key);
            // A deny by hand still refuses it (`LimitDecision::refuses`); nothing else of the
            // rate limit does, and its refusals say they are a shadow's.
            let rate = decision.as_ref().and_then(|d| d.get("rate"));
            let wrong = rate.is_some_and(|l| {
                let denied = matches!(l.outcome(), Outcome::Denied { .. });
                (denied && !l.is_shadow())
                    || (l.refuses() && !matches!(l.outcome(), Outcome::Denylisted { .. }))
            });
            let others_refuse = decision
                .as_ref()
                .is_some_and(|d| d.limits().iter().any(|l| l.name() != "rate" && l.refuses()));
            if wrong || (status == StatusCode::TOO_MANY_REQUESTS && !others_refuse) {
                self.fail(format!(
                    "invariant rollout: {r:?} of a key outside the enforced share answered \
                     {status} ({labels})"
                ));
            }
            self.tally.shadowed += 1;
            if admitted {
                self.tally.admitted += 1;
            } else {
                self.tally.refused += 1;
            }
            let counts_slot = admitted && self.shape.slots.is_some();
            if counts_slot {
                self.model.keys.entry(r.key).or_default().held += 1;
            }
            return self.end(res, r, counts_slot).await;
        }
        if self.unjudged.contains(r.key) {
            // Outside the share in an earlier generation: the model's state of it is lost.
            if admitted {
                self.tally.admitted += 1;
            } else {
                self.tally.refused += 1;
                if self.shape.penalty_at(generation).is_some() {
                    // The refusal may have started a block, which the model cannot tell now:
                    // an empty block marks the key sanctioned, so its level is not judged.
                    self.trace.blocked(r.key, self.last_sent, 0);
                }
            }
            let counts_slot = admitted && self.shape.slots.is_some();
            if counts_slot {
                self.model.keys.entry(r.key).or_default().held += 1;
            }
            return self.end(res, r, counts_slot).await;
        }
        if let Some(w) = from {
            self.expect_waited(r, w, decision.as_ref());
        } else if let Some(queued) = decision.as_ref().and_then(Decision::queued) {
            self.fail(format!(
                "{r:?}: answered at once, says it waited {queued:?}"
            ));
        }

        // The rate limit's outcome, and the refusal's Retry-After in whole seconds.
        let rate = decision
            .as_ref()
            .and_then(|d| d.limits().iter().find(|l| l.name() == "rate"))
            .map(|l| *l.outcome());
        let retry_after = res
            .headers()
            .get(RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        let blocked = matches!(
            rate,
            Some(Outcome::Denied {
                reason: DenyReason::Blocked,
                ..
            })
        );
        // A block's refusal, answered at once, says how long it stands at least.
        if let (Some(seconds), true, None, None) = (retry_after, blocked, from, self.shape.queue) {
            self.trace.blocked(r.key, self.last_sent, seconds);
        }
        if let Some(standing) = self.model.standing(r.key) {
            // A deny (403), else a block (429), refuses it whatever it costs, consuming nothing.
            let answered = match standing {
                Standing::Denied(_) => {
                    status == StatusCode::FORBIDDEN
                        && matches!(
                            rate,
                            Some(Outcome::Denylisted {
                                retry_after: Some(_)
                            })
                        )
                }
                Standing::Blocked(_) => status == StatusCode::TOO_MANY_REQUESTS && blocked,
            };
            if answered {
                match standing {
                    Standing::Denied(_) => self.tally.denied += 1,
                    Standing::Blocked(_) => self.tally.blocked += 1,
                }
                let exact = self.kind == Kind::Memory;
                self.expect_retry_after(r, retry_after, standing.left(), exact);
                return self.end(res, r, false).await;
            }
            // With a lease the harness does not wait for a waiter's turn (`due` cannot tell a
            // refusal there), so a waiter's refusal by its own rate limit may come from a
            // check made before the deny, and be judged after it.
            let refused_before = !self.shape.exact()
                && from.is_some()
                && refused_for(decision.as_ref(), "rate", DenyReason::OverLimit);
            if refused_before {
                self.tally.refused += 1;
                return self.end(res, r, false).await;
            }
            // A lease's slice on another replica may admit a denied key until it runs out.
            if self.shape.exact() || !admitted {
                self.fail(format!(
                    "{r:?}: answered {status} ({labels}, {rate:?}), the model says {standing:?}"
                ));
                return self.end(res, r, false).await;
            }
        } else if status == StatusCode::FORBIDDEN || (blocked && self.shape.penalty.is_none()) {
            self.fail(format!(
                "{r:?}: answered {status} ({labels}, {rate:?}), with no deny nor penalty"
            ));
            return self.end(res, r, false).await;
        }

        let limit = self.shape.rate(generation).unwrap();
        let quota = self.quota_at(r.pro, generation);
        let delay = self.shape.delay.unwrap_or(0);
        let (mut rate_status, next, wait) =
            self.model
                .check(limit.algorithm(), r.key, (&quota, delay), cost);
        let held = self.model.keys.get(r.key).map_or(0, |k| k.held);
        let mut slots_ok = self.shape.slots.is_none_or(|c| held < c);
        if let Some((rate_refused, slots_refused)) =
            self.ran_out_racing(from, decision.as_ref(), admitted)
        {
            // Its last check came at its deadline, which the model cannot place: responses
            // of its key whose answers the harness judged first may still have held their
            // slots then (their bodies not read yet), and their units before their settles.
            // Its refusal stands as it was made.
            if rate_refused && rate_status == Status::Allowed {
                rate_status = Status::Denied { retry_after: 0 };
            }
            slots_ok &= !slots_refused;
        }
        let rate_ok = rate_status == Status::Allowed;
        let expected = rate_ok && slots_ok;
        // A refusal of the rate limit's own algorithm counts toward its penalty (a refusal
        // for the slots alone does not), and may start a block.
        let block = match (self.shape.penalty_at(generation), rate_status) {
            (Some(penalty), Status::Denied { .. }) if !expected => {
                let now = self.model.now;
                let entry = self.model.keys.entry(r.key).or_default();
                entry.sanction.refused(penalty, now)
            }
            _ => None,
        };
        if self.shape.exact() {
            if admitted != expected || blocked != block.is_some() {
                self.fail(format!(
                    "{r:?}: answered {status} ({labels}, {rate:?}), the model says {}",
                    match (expected, block) {
                        (true, _) => "admitted".to_owned(),
                        (false, None) => "refused".to_owned(),
                        (false, Some(b)) => format!("blocked for {b} µs"),
                    }
                ));
                return self.end(res, r, false).await;
            }
        } else if admitted && !slots_ok {
            self.fail(format!("{r:?}: admitted with every slot held"));
        }
        if let Some(block) = block {
            // The refusal that starts a block says the block's whole length, on every backend.
            self.tally.blocks += 1;
            self.expect_retry_after(r, retry_after, block, true);
            // The invariants learn of the block from this refusal too (its reason is the
            // limit's own, not `Blocked`).
            if let (Some(seconds), None, None) = (retry_after, from, self.shape.queue) {
                self.trace.blocked(r.key, self.last_sent, seconds);
            }
        }
        if self.kind == Kind::Cluster
            && !admitted
            && decision
                .as_ref()
                .and_then(|d| d.get("rate"))
                .is_some_and(|l| l.label() == "allowed")
        {
            self.refunded.insert(r.key, tokio::time::Instant::now());
        }
        if self.shape.queue.is_some() {
            let full = rate_ok && !slots_ok && self.model.standing(r.key).is_none();
            self.expect_queue_answer(r, from, (&res, decision.as_ref()), (admitted, full));
        }
        if !admitted {
            self.tally.refused += 1;
            return self.end(res, r, false).await;
        }
        self.tally.admitted += 1;
        // A delayed admission waited exactly as far beyond the burst as its reservation lies.
        let waited = decision.as_ref().and_then(Decision::delayed);
        if waited != (wait > 0).then(|| Duration::from_micros(wait)) {
            self.fail(format!(
                "{r:?}: waited {waited:?} ({labels}), the model says {wait} µs"
            ));
        }
        if wait > 0 {
            self.tally.delayed += 1;
        }
        // Admitted: the model counts it.
        let mark = match limit.algorithm() {
            Algorithm::Gcra => next.tat.map_or(0, |(t, _)| t),
            _ => algorithm::window_end(&quota, self.model.now),
        };
        let entry = self.model.keys.entry(r.key).or_default();
        entry.tat = next.tat;
        entry.since = next.since;
        entry.window = next.window;
        entry.admitted += u64::from(cost);
        let counts_slot = self.shape.slots.is_some();
        if counts_slot {
            entry.held += 1;
        }
        if !self.shape.exact() {
            // A lease never admits more than the largest quota a request was checked under:
            // per window, or beyond its bucket (GCRA).
            let most = u64::from(self.most().burst());
            let admitted = self.model.keys[r.key].admitted;
            if admitted > most {
                self.fail(format!("{r:?}: {admitted} units admitted, over {most}"));
            }
        }
        let actual = match self.shape.settles {
            Settles::None => cost,
            Settles::RefundOn500 if r.fail => 0,
            Settles::RefundOn500 => cost,
            Settles::ChargedByHandler => r.charge,
        };
        if actual != cost {
            self.tally.settled += 1;
            self.model
                .settle(limit.algorithm(), r.key, &quota, (cost, actual, mark));
            let entry = self.model.keys.entry(r.key).or_default();
            entry.admitted = (entry.admitted + u64::from(actual)).saturating_sub(u64::from(cost));
            self.end(res, r, counts_slot).await;
            // With waiters of the key, on Redis one may take the slot this response gave
            // back, and units with it, while the harness looks: the end of the sequence
            // compares. In memory the settle may decide a waiter's turn (and a refusal there
            // may start a block): looked at once the model has judged what is due.
            if !self.has_waiters(r.key) {
                self.expect_remaining(r.key, r.pro, "after a settle").await;
            } else if self.kind == Kind::Memory {
                self.after_settle.push((r.key, r.pro));
            }
            if actual < cost {
                self.let_caches_expire().await;
            }
            return;
        }
        self.end(res, r, counts_slot).await;
    }

    /// A shed request's answer: `503` with the adaptive limit's `Retry-After` (1 s), and
    /// every limit says it was not asked.
    fn expect_shed_answer(&mut self, r: Req, res: &Response, decision: Option<&Decision>) {
        let retry_after = res.headers().get(RETRY_AFTER).and_then(|v| v.to_str().ok());
        let unasked = decision.is_some_and(|d| {
            d.limits().len() == 1 + usize::from(self.shape.slots.is_some())
                && d.limits().iter().all(|l| {
                    matches!(
                        l.outcome(),
                        Outcome::Skipped {
                            reason: SkipReason::NotChecked
                        }
                    )
                })
        });
        if res.status() != StatusCode::SERVICE_UNAVAILABLE || retry_after != Some("1") || !unasked {
            self.fail(format!(
                "{r:?}: shed, answered {} with Retry-After {retry_after:?} and {decision:?}",
                res.status()
            ));
        }
    }

    /// A refusal by a block or a deny says when it ends: `left` in whole seconds, rounded up;
    /// not `exact`, up to a minute sooner (the server's clock runs while the model's stands).
    fn expect_retry_after(&mut self, r: Req, got: Option<u64>, left: Micros, exact: bool) {
        let want = left.div_ceil(1_000_000);
        let right = match got {
            Some(got) if exact => got == want,
            Some(got) => got <= want && got + 60 >= want,
            None => false,
        };
        if !right {
            self.fail(format!(
                "{r:?}: Retry-After {got:?}, the model says {want} s{}",
                if exact { "" } else { " or a little less" }
            ));
        }
    }

    /// On Redis, for a refused waiter whose wait ran out: whether its rate limit refused it
    /// for its own algorithm, and whether its slots did. In real time its last check may
    /// come while other responses of its key, whose answers the harness judges first, still
    /// hold their slots and their units. In memory the harness reads every response before
    /// time moves, and the model is exact.
    fn ran_out_racing(
        &self,
        from: Option<Waited>,
        decision: Option<&Decision>,
        admitted: bool,
    ) -> Option<(bool, bool)> {
        if admitted || self.kind == Kind::Memory || !from.is_some_and(|w| w.last) {
            return None;
        }
        let (rate, slots) = (
            refused_for(decision, "rate", DenyReason::OverLimit),
            refused_for(decision, "slots", DenyReason::InFlight),
        );
        (rate || slots).then_some((rate, slots))
    }

    /// Reads `res` to its end, or keeps it open.
    async fn end(&mut self, res: Response, r: Req, counts_slot: bool) {
        if r.hold && counts_slot {
            self.held
                .push((res, r.key, counts_slot, self.epoch, r.replica));
        } else {
            let _ = axum::body::to_bytes(res.into_body(), usize::MAX).await;
            if counts_slot && self.batch.contains(&r.key) {
                // Others of the key answered with this one were checked while it held its slot.
                self.woken.push((r.replica, r.key));
                self.after_batch.push((r.key, r.replica));
            } else if counts_slot {
                let entry = self.model.keys.entry(r.key).or_default();
                entry.held = entry.held.saturating_sub(1);
                self.released(r.key, r.replica).await;
            }
        }
    }

    async fn finish(&mut self) {
        if self.held.is_empty() {
            return;
        }
        let (res, key, counts_slot, epoch, replica) = self.held.remove(0);
        if self.verbose {
            println!(
                "    ends {key} of replica {replica} (epoch {epoch}, now {})",
                self.epoch
            );
        }
        let _ = axum::body::to_bytes(res.into_body(), usize::MAX).await;
        if counts_slot && epoch == self.epoch {
            let entry = self.model.keys.entry(key).or_default();
            entry.held = entry.held.saturating_sub(1);
        }
        self.released(key, replica).await;
    }

    /// A response of `replica` for `key` ended. Its release is sent without waiting: when the
    /// next operation is the same replica's check of the same key, that check must find it
    /// done by itself (it waits for the replica's releases in flight); otherwise the harness
    /// waits until Redis has it, as another replica's check cannot know of it.
    async fn released(&mut self, key: &'static str, replica: usize) {
        if self.shape.queue.is_some() {
            // The first waiter of the key on this replica checks again at once; a waiter may
            // take the slot before a peek would see it free.
            self.woken.push((replica, key));
            if self.has_waiters(key) {
                return;
            }
        }
        if self.next_request == Some((replica, key)) {
            // Waited for once that request is answered (a refusal from the deny cache does not
            // reach Redis, so it cannot have waited for the release itself).
            self.unsettled = Some(key);
        } else {
            self.expect_slots(key, "after a response ended").await;
        }
    }

    /// Between two looks at what a release or a settle sent without waiting has done: on
    /// Redis 5 ms; in memory the tasks run, and Tokio's clock stands, as it moves only by the
    /// harness (time passing here would let a waiter's wait run out, or its poll come, unseen
    /// by the model).
    async fn before_next_look(&self) {
        if self.kind == Kind::Memory {
            self.let_tasks_run().await;
        } else {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Polls `peek` of the slots until it says the model's free slots of `key`.
    async fn expect_slots(&mut self, key: &'static str, when: &str) {
        let Some(slots) = self.shape.slots else {
            return;
        };
        self.tally.released += 1;
        let held = self.model.keys.get(key).map_or(0, |k| k.held);
        let want = u64::from(slots.saturating_sub(held));
        let mut seen = None;
        for _ in 0..200 {
            seen = self.replicas[0]
                .layer
                .peek("slots", key)
                .await
                .ok()
                .map(|s| s.remaining);
            if seen == Some(want) {
                return;
            }
            self.before_next_look().await;
        }
        self.fail(format!(
            "{when}: {key} has {seen:?} slots free, the model says {want}"
        ));
    }

    /// Every replica's adaptive limit has every permit back: none is held once every
    /// response has ended, whatever refused, queued or dropped the requests.
    async fn expect_permits_back(&mut self) {
        for r in 0..self.replicas.len() {
            let Some(adaptive) = self.replicas[r].layer.adaptive() else {
                return;
            };
            let mut seen = adaptive.in_flight();
            for _ in 0..200 {
                if seen == 0 {
                    break;
                }
                self.before_next_look().await;
                seen = adaptive.in_flight();
            }
            if seen != 0 {
                self.fail(format!(
                    "at the end: replica {r} holds {seen} adaptive permits"
                ));
            }
        }
    }

    /// Polls the first replica's `peek` until it says the model's remaining units of `key`.
    async fn expect_remaining(&mut self, key: &'static str, pro: bool, when: &str) {
        if !self.shape.exact() {
            return;
        }
        if self.unjudged.contains(key) {
            return;
        }
        let limit = self.rate_limit();
        let quota = self.quota_of(pro);
        let (want, want_reset) = self.model.state(&limit, key, &quota);
        // What `peek` cannot show: a fixed window's count past its limit (a debt), read from
        // Redis. A GCRA debt shows in the reset.
        let want_count = match limit.algorithm() {
            Algorithm::FixedWindow => Some(self.model.window_count(key, &quota)),
            _ => None,
        };
        let plan = (pro && self.shape.pro.is_some()).then_some("pro");
        let mut seen = None;
        for _ in 0..200 {
            let state = self.replicas[0]
                .layer
                .peek_plan("rate", plan, key)
                .await
                .ok();
            let count = match (&self.raw_count, want_count) {
                (Some(read), Some(_)) => read(key, &quota, self.model.now),
                _ => want_count,
            };
            seen = state.map(|s| (s.remaining, s.reset.as_secs(), count));
            // The server's clock runs while the model's stands still: the reset may be a few
            // seconds shorter; a settle moves it by at least an interval (28.8 min here).
            // A fixed window's reset is its window's end whatever it holds: its debt shows
            // in the count instead.
            let gcra = limit.algorithm() == Algorithm::Gcra;
            let close = seen.is_some_and(|(remaining, reset, count)| {
                remaining == want
                    && (!gcra || (reset + 5 >= want_reset && reset <= want_reset))
                    && count == want_count
            });
            if close {
                return;
            }
            self.before_next_look().await;
        }
        self.fail(format!(
            "{when}: {key} (plan {plan:?}) has (remaining, reset s, window count) {seen:?}, \
             the model says {:?}",
            (want, want_reset, want_count)
        ));
    }

    async fn reset(&mut self, replica: usize, key: &'static str) {
        let layer = &self.replicas[replica].layer;
        let mut done = layer.reset("rate", key).await;
        // The first call after a restart may meet the dead connection; the next makes a new
        // one. And a paused tokio clock moves on by itself whenever the runtime only waits
        // (for a socket too): a timer around a call to Redis may fire before Redis had a
        // chance to answer, which a loaded machine makes likely. A reset is idempotent, so
        // it is made again, twice at most; a real failure fails every time.
        for _ in 0..2 {
            if done.is_ok() {
                break;
            }
            self.recovering[replica] = false;
            done = layer.reset("rate", key).await;
        }
        if self.verbose {
            println!("    reset {key} on {replica}: {done:?}");
        }
        if let Err(e) = done {
            return self.fail(format!("reset of {key}: {e}"));
        }
        self.tally.resets += 1;
        self.trace.reset(key);
        let entry = self.model.keys.entry(key).or_default();
        entry.tat = None;
        entry.window = None;
        entry.admitted = 0;
        entry.drained = 0;
        entry.sanction.lift();
        self.let_caches_expire().await;
    }

    /// Denies `key` under the rate limit for `micros`, or (`None`) lifts its deny, on
    /// `replica`. Other replicas' deny caches may answer as before for up to their TTL.
    async fn deny(&mut self, replica: usize, key: &'static str, micros: Option<Micros>) {
        let layer = &self.replicas[replica].layer;
        if let Some(m) = micros.filter(|&m| Duration::from_micros(m) > MAX_DENY) {
            // Past `MAX_DENY`: refused whole, never shortened, and nothing denied (the model
            // and the trace stay as they were).
            match layer.deny("rate", key, Duration::from_micros(m)).await {
                Err(AdminError::DenyTooLong(d)) if d == Duration::from_micros(m) => {
                    self.tally.too_long += 1;
                }
                other => self.fail(format!(
                    "deny of {key} for {m} µs, past MAX_DENY: {other:?}, not DenyTooLong"
                )),
            }
            return;
        }
        let call = || async {
            match micros {
                Some(m) => layer.deny("rate", key, Duration::from_micros(m)).await,
                None => layer.undeny("rate", key).await,
            }
        };
        let asked = self.trace.now();
        let mut done = call().await;
        // Made again on an error, twice at most, as a reset is (see `reset`): a deny and an
        // undeny are idempotent.
        for _ in 0..2 {
            if done.is_ok() {
                break;
            }
            self.recovering[replica] = false;
            done = call().await;
        }
        if self.verbose {
            println!("    deny {key} on {replica} for {micros:?} µs: {done:?}");
        }
        if let Err(e) = done {
            return self.fail(format!("deny of {key} for {micros:?} µs: {e}"));
        }
        match micros {
            Some(m) => {
                self.tally.denies += 1;
                self.trace.deny(key, asked, m);
            }
            None => {
                self.tally.undenies += 1;
                self.trace.undeny(key, asked);
            }
        }
        let now = self.model.now;
        let entry = self.model.keys.entry(key).or_default();
        entry.sanction.denied_until = micros.map_or(0, |m| now + m);
        self.let_caches_expire().await;
    }

    async fn reload(&mut self) {
        self.generation += 1;
        self.tally.reloads += 1;
        self.trace.reload();
        for (i, r) in self.replicas.iter().enumerate() {
            if let Err(e) = r
                .layer
                .reloader()
                .reload(self.shape.limits(self.generation).unwrap())
            {
                self.violations.push(format!("reload of replica {i}: {e}"));
            }
        }
        self.let_caches_expire().await;
    }

    async fn restart(&mut self) {
        let Some(server) = self.servers.redis.as_mut() else {
            return;
        };
        server.stop();
        self.flight.forget();
        self.trace.restart();
        for w in self.waiters.values_mut() {
            w.through_restart = true;
        }
        self.tally.restarts += 1;
        self.recovering.iter_mut().for_each(|r| *r = true);
        // One request while Redis is down (of a key no cached denial holds): it fails open,
        // uncounted.
        let key = "while-down";
        let req = Request::get("/")
            .header("x-key", key)
            .header("x-cost", "1")
            .header("x-charge", "1")
            .body(Body::empty())
            .unwrap();
        let res = self.replicas[0].app.clone().oneshot(req).await.unwrap();
        let bypassed = res.extensions().get::<Decision>().is_some_and(|d| {
            d.limits()
                .iter()
                .all(|l| matches!(l.outcome(), Outcome::Bypassed { .. }))
        });
        if res.status() != StatusCode::OK || !bypassed {
            self.fail(format!(
                "with Redis down: answered {}, bypassed: {bypassed}",
                res.status()
            ));
        }
        let _ = axum::body::to_bytes(res.into_body(), usize::MAX).await;
        if let Some(server) = self.servers.redis.as_mut() {
            server.start_again();
        }
        // Without persistence, Redis forgets everything: counts and slots.
        for state in self.model.keys.values_mut() {
            *state = KeyModel::default();
        }
        self.epoch += 1;
        self.let_caches_expire().await;
        // Each replica's first calls after the restart may meet its dead connections (the
        // checks' own, and the shared one), fail open once, and connect again: a key outside
        // the model's takes those.
        for i in 0..self.replicas.len() {
            let mut answered = false;
            for _ in 0..3 {
                let req = Request::get("/")
                    .header("x-key", "warm-up")
                    .header("x-cost", "1")
                    .header("x-charge", "1")
                    .body(Body::empty())
                    .unwrap();
                let res = self.replicas[i].app.clone().oneshot(req).await.unwrap();
                let bypassed = res.extensions().get::<Decision>().is_some_and(|d| {
                    d.limits()
                        .iter()
                        .any(|l| matches!(l.outcome(), Outcome::Bypassed { .. }))
                });
                let _ = axum::body::to_bytes(res.into_body(), usize::MAX).await;
                let peeked = self.replicas[i].layer.peek("rate", "warm-up").await.is_ok();
                if !bypassed && peeked {
                    answered = true;
                    break;
                }
                self.let_caches_expire().await;
            }
            if !answered {
                self.fail(format!("replica {i} did not reconnect after the restart"));
            }
            self.recovering[i] = false;
        }
    }

    async fn step(&mut self, by: Micros) {
        // What was sent without waiting (a settle, a release) lands before the clock moves.
        self.let_tasks_run().await;
        if let Some(clock) = &self.clock {
            self.tally.steps += 1;
            clock.advance(Duration::from_micros(by));
            let (then, now) = (self.model.now, self.model.now + by);
            self.model.now = now;
            // The lease bound's new start: a window turned, or the bucket drained.
            let most = self.most();
            let turned =
                algorithm::window_index(&most, then) != algorithm::window_index(&most, now);
            let interval = most.emission_interval();
            for k in self.model.keys.values_mut() {
                match self.shape.algorithm {
                    Algorithm::FixedWindow if turned => k.admitted = 0,
                    Algorithm::FixedWindow => {}
                    _ => {
                        let drained = k.drained + by;
                        let units = drained / interval;
                        k.drained = drained % interval;
                        if units >= k.admitted {
                            (k.admitted, k.drained) = (0, 0);
                        } else {
                            k.admitted -= units;
                        }
                    }
                }
            }
        }
    }

    /// The largest quota a request is checked under (a lease shape has no reloads).
    fn most(&self) -> Quota {
        Shape::quota(self.shape.pro.unwrap_or(0).max(self.shape.defaults[0]))
    }

    /// Every response ended: no slot is held, and every key has what the model says.
    async fn quiesce(&mut self) {
        if self.shape.queue.is_some() {
            self.drain_queue().await;
        }
        while !self.held.is_empty() {
            self.finish().await;
        }
        for key in KEYS {
            self.expect_slots(key, "at the end").await;
        }
        self.expect_permits_back().await;
        for key in KEYS {
            self.expect_remaining(key, false, "at the end").await;
            if self.shape.pro.is_some() {
                self.expect_remaining(key, true, "at the end").await;
            }
        }
        if self.shape.allowlist {
            let quota = self.quota_of(false);
            let mut full = KeyState::fresh(&quota).remaining;
            let vip = self.replicas[0].layer.peek("rate", VIP).await.ok();
            let mut gcra_full = u64::from(quota.burst());
            if self.model.standing(VIP).is_some() {
                // Denied by hand: its requests are still admitted, its peek says nothing left.
                (full, gcra_full) = (0, 0);
            }
            if vip.map(|s| s.remaining) != Some(full) && vip.map(|s| s.remaining) != Some(gcra_full)
            {
                self.fail(format!("the allowlisted key was counted: {vip:?}"));
            }
        }
    }

    /// Runs `ops`; whether it came to quiescence.
    async fn run(&mut self, ops: &[Op]) -> bool {
        for (i, &op) in ops.iter().enumerate() {
            self.next_request = match ops.get(i + 1) {
                Some(Op::Request(r)) => Some((r.replica, r.key)),
                _ => None,
            };
            if self.verbose && !matches!(op, Op::Request(_)) {
                println!("  {op:?}");
            }
            match op {
                Op::Request(r) => {
                    let unsettled = self.unsettled.take();
                    self.request(r).await;
                    if let Some(key) = unsettled {
                        self.expect_slots(key, "after a response ended").await;
                    }
                }
                Op::Finish => self.finish().await,
                Op::Reset { replica, key } => self.reset(replica, key).await,
                Op::Deny {
                    replica,
                    key,
                    micros,
                } => self.deny(replica, key, Some(micros)).await,
                Op::Undeny { replica, key } => self.deny(replica, key, None).await,
                Op::Reload => self.reload().await,
                Op::Step(by) => self.step(by).await,
                Op::Restart => self.restart().await,
                Op::Pass(by) => self.pass(by).await,
            }
            self.settle_waiters().await;
            for (key, pro) in std::mem::take(&mut self.after_settle) {
                self.expect_remaining(key, pro, "after a settle").await;
            }
            if self.violations.len() > 3 {
                return false;
            }
        }
        self.quiesce().await;
        true
    }
}

/// Where a Redis sequence keeps its keys: the servers' URLs and its prefix.
type Scan = Option<(Vec<String>, String)>;

/// Runs `ops` on `replicas`; returns the violations.
async fn drive<B: Backend>(
    (shape, kind, flight, trace): (Shape, Kind, Arc<InFlight>, Arc<Trace>),
    replicas: Vec<Replica<B>>,
    clock: Option<FakeClock>,
    now: Micros,
    servers: &mut Servers,
    ops: &[Op],
    (verbose, raw_count, scan): (bool, Option<RawCount>, Scan),
) -> (Vec<String>, Tally) {
    let n = replicas.len();
    let mut run = Run {
        shape,
        kind,
        replicas,
        model: Model {
            keys: HashMap::new(),
            now,
        },
        generation: 0,
        held: Vec::new(),
        next_request: None,
        unsettled: None,
        epoch: 0,
        clock,
        servers,
        violations: Vec::new(),
        recovering: vec![false; n],
        verbose,
        tally: Tally::default(),
        raw_count,
        flight,
        waiters: HashMap::new(),
        lines: HashMap::new(),
        answered: Arc::default(),
        sent: 0,
        direct: None,
        woken: Vec::new(),
        batch: Vec::new(),
        after_batch: Vec::new(),
        after_settle: Vec::new(),
        trace,
        last_sent: 0,
        unjudged: std::collections::HashSet::new(),
        refunded: HashMap::new(),
        sent_at: None,
        expect_shed: false,
    };
    // Queues in memory: Tokio's clock moves only when the harness moves it.
    let paused = kind == Kind::Memory && run.shape.queue.is_some();
    if paused {
        tokio::time::pause();
    }
    // The counters start from 0 for this sequence.
    let _ = invariants::decisions("rate");
    let quiet = run.run(ops).await;
    let clean = invariants::quiet_before(quiet);
    if paused {
        tokio::time::resume();
    }
    // The invariants judged from outside, after the model's checks.
    let started = std::time::Instant::now();
    if quiet {
        run.conservation().await;
        // Rule *restart*: a restart sends requests of its own (while Redis is down, and to
        // reconnect) that the invariants do not follow. Rule *leftovers*: after a sequence
        // that stopped early, its waiters may still decide.
        if run.tally.restarts == 0 && clean {
            if let Some(decided) = invariants::decisions("rate") {
                if verbose {
                    println!("  tollgate_decisions_total of rate: {decided:?}");
                }
                let seen = run.trace.metrics("rate", &decided, run.tally.shed);
                run.violations.extend(seen);
            }
        }
    }
    let mut found = run.trace.judge();
    if let Some((urls, prefix)) = scan {
        // Every replica hands its refusals' summaries to Redis, as `tollgate top` reads them.
        for r in &run.replicas {
            let _ = r.layer.top_refused("rate", 10).await;
        }
        let identities = [KEYS[0], KEYS[1], KEYS[2], VIP, BAD, "while-down", "warm-up"];
        found.extend(invariants::raw_in_redis(&urls, &prefix, &identities));
    }
    run.violations.extend(found);
    run.tally.judged_ms += started.elapsed().as_millis() as u64;
    (run.violations, run.tally)
}

/// A Redis backend of the harness: a server's or a cluster's, under `prefix`, with a 2 s
/// deadline.
fn redis_backend(kind: Kind, urls: &[String], prefix: &str) -> RedisBackend {
    let builder = RedisBackend::builder()
        .prefix(prefix)
        .deadline(Duration::from_secs(2));
    match kind {
        Kind::Redis => builder.url(&urls[0]),
        _ => builder.cluster(urls.to_vec()),
    }
    .build()
    .unwrap()
}

/// Builds `shape` on `replicas` replicas, or says why not.
fn build<B: Backend>(
    shape: &Shape,
    replicas: usize,
    backend: impl Fn() -> B,
    record: (&Arc<InFlight>, &Arc<Trace>),
) -> Result<Vec<Replica<B>>, ConfigError> {
    (0..replicas)
        .map(|_| replica(shape, backend(), record))
        .collect()
}

/// What a shape's build must give: refused with `PenaltyUnsupported` exactly for a leased
/// limit with a penalty, else with `QueueUnsupported` exactly for a queue on the rate limit,
/// else with `LeaseWithSettle` exactly for a leased GCRA limit that settles. `Ok(None)`:
/// refused as it must be.
fn built<B>(
    shape: &Shape,
    result: Result<Vec<Replica<B>>, ConfigError>,
) -> Result<Option<Vec<Replica<B>>>, String> {
    let boxed = shape.lease.is_some() && shape.penalty.is_some();
    let unqueued = !boxed && shape.queue_on_rate;
    let refused = boxed
        || shape.queue_on_rate
        || shape.lease.is_some()
            && shape.algorithm == Algorithm::Gcra
            && shape.settles != Settles::None;
    match result {
        Err(ConfigError::PenaltyUnsupported(_)) if boxed => Ok(None),
        Err(ConfigError::QueueUnsupported(a)) if unqueued && a == shape.algorithm => Ok(None),
        Err(ConfigError::LeaseWithSettle(name))
            if refused && !boxed && !unqueued && name == "rate" =>
        {
            Ok(None)
        }
        Err(e) => Err(format!("{shape:?}: the layer was not built: {e}")),
        Ok(_) if refused => Err(format!(
            "{shape:?}: a leased limit with a penalty, a queue on a rate limit, or a leased \
             GCRA limit that settles, was built"
        )),
        Ok(replicas) => Ok(Some(replicas)),
    }
}

/// Runs one seed on `kind`; returns its shape and violations.
async fn sequence(
    seed: u64,
    kind: Kind,
    ops: usize,
    servers: &mut Servers,
    verbose: bool,
) -> (Shape, Vec<String>, Tally) {
    let mut rng = Rng(seed);
    let mut shape = Shape::draw(&mut rng);
    if kind != Kind::Memory {
        shape.delay = None;
    }
    shape.draw_shedding(&mut Rng(seed ^ 0x5eed_5bed), kind);
    let replicas = 2 + rng.below(3) as usize;
    let mut ops = draw_ops(&mut rng, &shape, kind, replicas, ops);
    if shape.adaptive.is_some() {
        // A restart sends requests of its own on every replica, which must not be shed.
        for op in &mut ops {
            if matches!(op, Op::Restart) {
                *op = Op::Finish;
            }
        }
    }
    if verbose {
        println!("seed {seed}: {shape:?} on {replicas} replicas");
    }
    let now = tollgate_engine::Clock::now(&tollgate_engine::SystemClock::new());
    let violations = match kind {
        Kind::Memory => {
            let clock = FakeClock::new(now);
            let memory = Arc::new(MemoryBackend::builder().clock(clock.clone()).build());
            let on = (&shape, kind, replicas);
            let time = (Some(clock.clone()), now);
            let setup = (verbose, None, None);
            if shape.lease.is_some() {
                // Each replica leases from the shared backend: the engine's `Leased`, as on Redis.
                let leased = || Leased::new(Arc::clone(&memory), clock.clone());
                build_and_drive(on, leased, time, servers, &ops, setup).await
            } else {
                let shared = || Arc::clone(&memory);
                build_and_drive(on, shared, time, servers, &ops, setup).await
            }
        }
        Kind::Redis | Kind::Cluster => {
            let prefix = format!("comb{seed}");
            let target = match kind {
                Kind::Redis => servers.redis.as_ref().map(|s| vec![s.url()]),
                _ => servers.cluster.as_ref().map(RedisCluster::urls),
            };
            let Some(urls) = target else {
                return (shape, vec!["no server".into()], Tally::default());
            };
            let backend = || redis_backend(kind, &urls, &prefix);
            let setup = (
                verbose,
                raw_count(&shape, backend(), &urls, kind),
                Some((urls.clone(), prefix.clone())),
            );
            let on = (&shape, kind, replicas);
            build_and_drive(on, backend, (None, now), servers, &ops, setup).await
        }
    };
    let (mut found, mut tally) = violations;
    // Some seeds also draw a timed sequence, judged by the invariants alone.
    let started = std::time::Instant::now();
    if let Some((what, seen)) = timed::sequence(seed, kind, servers, verbose).await {
        tally.timed += 1;
        tally.timed_ms += started.elapsed().as_millis() as u64;
        found.extend(seen.into_iter().map(|v| format!("{what}: {v}")));
    }
    (shape, found, tally)
}

/// Builds `shape` on `replicas` replicas of `backend` and drives `ops` through them (or
/// checks that the build was refused as it must be).
async fn build_and_drive<B: Backend>(
    (shape, kind, replicas): (&Shape, Kind, usize),
    backend: impl Fn() -> B,
    (clock, now): (Option<FakeClock>, Micros),
    servers: &mut Servers,
    ops: &[Op],
    setup: (bool, Option<RawCount>, Scan),
) -> (Vec<String>, Tally) {
    let flight = InFlight::new(shape.slots);
    let frame = match &clock {
        Some(clock) => Frame::Memory {
            clock: Arc::new(clock.clone()),
            delays: shape.delay.is_some(),
        },
        None => Frame::Real,
    };
    let trace = Trace::new(frame, shape.lease.map(|most| most * replicas as u32));
    match built(shape, build(shape, replicas, backend, (&flight, &trace))) {
        Ok(Some(r)) => {
            let on = (shape.clone(), kind, flight, trace);
            drive(on, r, clock, now, servers, ops, setup).await
        }
        Ok(None) => (Vec::new(), refused_at_build()),
        Err(e) => (vec![e], Tally::default()),
    }
}

fn refused_at_build() -> Tally {
    Tally {
        refused_at_build: 1,
        ..Tally::default()
    }
}

/// A reader of the "rate" limit's fixed-window counts in Redis, for `shape` if it is a fixed
/// window: `backend` names the keys, a connection of its own (routed by key in a cluster)
/// reads them.
fn raw_count(
    shape: &Shape,
    backend: RedisBackend,
    urls: &[String],
    kind: Kind,
) -> Option<RawCount> {
    if shape.algorithm != Algorithm::FixedWindow {
        return None;
    }
    let limit = shape.rate(0).ok()?;
    // A connection per read: the server may have been restarted since the last.
    let reader = match kind {
        Kind::Cluster => Reader::Cluster(Box::new(
            redis::cluster::ClusterClient::new(urls.to_vec()).ok()?,
        )),
        _ => Reader::One(Box::new(redis::Client::open(urls[0].as_str()).ok()?)),
    };
    Some(Box::new(move |key: &str, quota: &Quota, now: Micros| {
        // The key's bytes as the layer counts them (a tenant, normalised).
        let bytes = Tenant::header("x-key").key_of(&key.into()).ok()?;
        let base = backend.key_for(&limit, bytes.as_bytes());
        let index = algorithm::window_index(quota, now);
        Some(reader.get(&format!("{base}:{index}")).unwrap_or(0))
    }))
}

/// Reads keys of the Redis a sequence runs on.
enum Reader {
    One(Box<redis::Client>),
    Cluster(Box<redis::cluster::ClusterClient>),
}

impl Reader {
    /// The integer at `key` (`None` for none, or when Redis cannot be reached).
    fn get(&self, key: &str) -> Option<u64> {
        fn get(conn: &mut impl redis::ConnectionLike, key: &str) -> Option<u64> {
            redis::cmd("GET").arg(key).query::<Option<u64>>(conn).ok()?
        }
        match self {
            Self::One(client) => get(&mut client.get_connection().ok()?, key),
            Self::Cluster(client) => get(&mut client.get_connection().ok()?, key),
        }
    }
}

struct Args {
    seeds: u64,
    first: u64,
    ops: usize,
    kinds: Vec<Kind>,
    verbose: bool,
}

fn args() -> Result<Args, String> {
    let mut out = Args {
        seeds: 100,
        first: 1,
        ops: 40,
        kinds: vec![Kind::Memory, Kind::Redis, Kind::Cluster],
        verbose: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--seeds" => out.seeds = value()?.parse().map_err(|e| format!("--seeds: {e}"))?,
            "--first" => out.first = value()?.parse().map_err(|e| format!("--first: {e}"))?,
            "--verbose" => out.verbose = true,
            "--ops" => out.ops = value()?.parse().map_err(|e| format!("--ops: {e}"))?,
            "--backends" => {
                out.kinds = value()?
                    .split(',')
                    .map(|k| match k {
                        "memory" => Ok(Kind::Memory),
                        "redis" => Ok(Kind::Redis),
                        "cluster" => Ok(Kind::Cluster),
                        other => Err(format!("unknown backend {other:?}")),
                    })
                    .collect::<Result<_, _>>()?;
            }
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    Ok(out)
}

fn main() -> ExitCode {
    let args = match args() {
        Ok(args) => args,
        Err(e) => {
            eprintln!("combinations: {e}");
            return ExitCode::from(2);
        }
    };
    invariants::record_metrics();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut servers = Servers {
        redis: args.kinds.contains(&Kind::Redis).then(RedisServer::start),
        cluster: args
            .kinds
            .contains(&Kind::Cluster)
            .then(|| RedisCluster::start(3)),
    };
    let (mut sequences, mut violations) = (0u64, 0u64);
    let mut by_kind: HashMap<&'static str, (u64, u64)> = HashMap::new();
    let mut tally = Tally::default();
    for seed in args.first..args.first + args.seeds {
        let kind = args.kinds[(seed % args.kinds.len() as u64) as usize];
        let (shape, found, did) =
            runtime.block_on(sequence(seed, kind, args.ops, &mut servers, args.verbose));
        sequences += 1;
        tally.add(&did);
        let name = match kind {
            Kind::Memory => "memory",
            Kind::Redis => "redis",
            Kind::Cluster => "cluster",
        };
        let row = by_kind.entry(name).or_default();
        row.0 += 1;
        if !found.is_empty() {
            violations += 1;
            row.1 += 1;
            println!("seed {seed} on {name}: {shape:?}");
            for v in &found {
                println!("  seed {seed} on {name}: {v}");
            }
        }
    }
    let mut kinds: Vec<_> = by_kind.into_iter().collect();
    kinds.sort();
    for (name, (n, v)) in kinds {
        println!("{name}: {n} sequences, {v} with violations");
    }
    println!("{tally:?}");
    println!("combinations: {sequences} sequences, {violations} violations");
    if violations > 0 {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
