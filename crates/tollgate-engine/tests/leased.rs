//! Quota leases over the in-memory backend: several replicas (each a `Leased`) share one
//! `MemoryBackend`, which counts every slice before any of its units is admitted.

#![allow(clippy::unwrap_used)]

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use tollgate_engine::{
    Admin, Backend, BackendErrorKind, Check, FakeClock, Lease, Lifecycle, Limit, Micros, Quota,
    Settlement, Status, Verdicts,
};
use tollgate_testsupport::leases::{self, splitmix, Memory, Replica};

/// The start of a UTC day: windows of a minute or an hour start here.
const T0: Micros = 1_728_000_000_000_000;
const S: Micros = 1_000_000;

struct World {
    clock: FakeClock,
    memory: Memory,
}

impl World {
    fn new() -> Self {
        let clock = FakeClock::new(T0);
        let memory = leases::memory(&clock);
        Self { clock, memory }
    }

    fn replica(&self) -> Replica {
        leases::replica(&self.memory, &self.clock)
    }

    fn at(&self, now: Micros) {
        self.clock.set(now);
    }

    /// A check of `limit` (without its lease) in the shared backend directly: what another
    /// replica without a slice finds.
    fn direct(&self, limit: &Limit, key: &[u8]) -> Verdicts {
        self.memory.check_now(&[Check::new(limit, key)]).unwrap()
    }

    /// Admissions of `n` direct checks.
    fn direct_admitted(&self, limit: &Limit, key: &[u8], n: usize) -> usize {
        (0..n)
            .filter(|_| self.direct(limit, key)[0].is_allowed())
            .count()
    }

    /// What the shared backend has left for `key`, read without consuming.
    fn remaining(&self, limit: &Limit, key: &[u8]) -> u64 {
        self.memory.peek_now(&Check::new(limit, key)).remaining
    }
}

/// Slices of at most 4 units, half of what remains, living `life`.
fn lease(life: Duration) -> Lease {
    Lease::new(4)
        .unwrap()
        .with_divisor(2)
        .unwrap()
        .with_lifetime(life)
        .unwrap()
}

fn leased(limit: &Limit, life: Duration) -> Limit {
    limit.clone().with_lease(lease(life)).unwrap()
}

fn gcra_per_hour(name: &str, n: u32) -> Limit {
    Limit::gcra(name, Quota::per_hour(n).unwrap()).unwrap()
}

fn check(r: &Replica, limits: &[&Limit], key: &[u8]) -> Verdicts {
    let checks: Vec<Check<'_>> = limits.iter().map(|l| Check::new(l, key)).collect();
    r.check_now(&checks).unwrap()
}

fn admitted(r: &Replica, limit: &Limit, key: &[u8], n: usize) -> usize {
    (0..n)
        .filter(|_| check(r, &[limit], key)[0].is_allowed())
        .count()
}

fn poll<F: Future + Unpin>(f: &mut F) -> Poll<F::Output> {
    Pin::new(f).poll(&mut Context::from_waker(Waker::noop()))
}

#[test]
fn a_slice_is_counted_first_and_then_admits_without_a_call() {
    let w = World::new();
    let plain = gcra_per_hour("hot", 10);
    let limit = leased(&plain, Duration::from_secs(60));
    let r = w.replica();
    // 4 units taken (10 / 2, at most 4): one admitted, 3 held, already counted.
    let v = check(&r, &[&limit], b"k");
    assert!(v[0].is_allowed() && !v.from_lease(0));
    assert_eq!(
        v[0].remaining, 9,
        "the slice's units count as the replica's"
    );
    assert_eq!(r.leased_units(), 3);
    assert_eq!(r.inner().calls(), 1);
    assert_eq!(
        w.direct(&plain, b"k")[0].remaining,
        5,
        "the backend counts the whole slice"
    );
    for left in [2, 1, 0] {
        let v = check(&r, &[&limit], b"k");
        assert!(v[0].is_allowed() && v.from_lease(0));
        assert_eq!(r.leased_units(), left);
    }
    assert_eq!(r.inner().calls(), 1);
    // 5 left: a slice of 3 (2 held), 2 single checks near the limit, then 5 refusals.
    assert_eq!(admitted(&r, &limit, b"k", 10), 5);
    assert_eq!(r.leased_units(), 0);
    assert_eq!(r.inner().calls(), 1 + 1 + 2 + 5);
}

#[test]
fn over_four_replicas_a_leased_limit_of_ten_admits_exactly_ten() {
    let day = Duration::from_secs(86_400);
    for plain in [
        gcra_per_hour("burst", 10),
        Limit::fixed_window("daily", Quota::per_day(10).unwrap()).unwrap(),
    ] {
        let name = plain.name().to_owned();
        let w = World::new();
        let limit = leased(&plain, Duration::from_secs(3_600));
        // 100 requests at once: every answer is asked for before any is polled. Whatever is
        // not admitted is held in slices, nothing more.
        let replicas: Vec<Replica> = (0..4).map(|_| w.replica()).collect();
        let mut futures: Vec<_> = (0..100)
            .map(|i| replicas[i % 4].check(&[Check::new(&limit, b"k")]))
            .collect();
        let admitted_at_once = futures
            .iter_mut()
            .map(|f| matches!(poll(f), Poll::Ready(Ok(v)) if v[0].is_allowed()))
            .filter(|&admitted| admitted)
            .count();
        let held: u64 = replicas.iter().map(Replica::leased_units).sum();
        assert!(admitted_at_once <= 10, "{name}: {admitted_at_once}");
        assert_eq!(admitted_at_once as u64 + held, 10, "{name}: {held} held");
        // Every replica keeps sending: every slice is spent, exactly 10 in all.
        let busy = leased(&plain, day);
        let replicas: Vec<Replica> = (0..4).map(|_| w.replica()).collect();
        let total: usize = (0..100)
            .filter(|i| check(&replicas[i % 4], &[&busy], b"shared")[0].is_allowed())
            .count();
        assert_eq!(total, 10, "{name}");
        let held: u64 = replicas.iter().map(Replica::leased_units).sum();
        assert_eq!(held, 0, "{name}");
    }
}

#[test]
fn over_time_four_replicas_never_admit_more_than_the_quota() {
    // A fixed window of 20 a second, then a GCRA of 20 a second (burst 20), 4 replicas,
    // requests at irregular times for a minute: never more than the limit per window, and
    // never more than the burst and the refill since the start under GCRA.
    let quota = Quota::per_second(20).unwrap();
    let lease = Lease::new(8)
        .unwrap()
        .with_divisor(4)
        .unwrap()
        .with_lifetime(Duration::from_millis(300))
        .unwrap();
    for plain in [
        Limit::fixed_window("fw", quota).unwrap(),
        Limit::gcra("g", quota).unwrap(),
    ] {
        let limit = plain.clone().with_lease(lease).unwrap();
        let w = World::new();
        let replicas: Vec<Replica> = (0..4).map(|_| w.replica()).collect();
        let mut seed = 7_u64;
        let mut now = T0;
        let mut per_window = std::collections::HashMap::<u64, u32>::new();
        let mut total = 0_u64;
        let mut local = 0;
        while now < T0 + 60 * S {
            let r = splitmix(&mut seed);
            now += r % 30_000;
            w.at(now);
            let v = check(&replicas[(r >> 40) as usize % 4], &[&limit], b"k");
            if v[0].is_allowed() {
                total += 1;
                local += usize::from(v.from_lease(0));
                *per_window.entry(now / S).or_default() += 1;
                if plain.algorithm() == tollgate_engine::Algorithm::Gcra {
                    let refilled = (now - T0) / quota.emission_interval();
                    assert!(total <= 20 + refilled, "{total} by +{} µs", now - T0);
                }
            }
        }
        if plain.algorithm() == tollgate_engine::Algorithm::FixedWindow {
            assert!(per_window.values().all(|&n| n <= 20), "{per_window:?}");
        }
        assert!(
            local >= 10 && total > 600,
            "{total} admitted, {local} from slices"
        );
    }
}

#[test]
fn a_replica_shut_down_gives_its_units_back() {
    let w = World::new();
    let plain = gcra_per_hour("gone", 10);
    let limit = leased(&plain, Duration::from_secs(3_600));
    let r = w.replica();
    assert!(check(&r, &[&limit], b"k")[0].is_allowed());
    assert_eq!(r.leased_units(), 3);
    assert!(poll(&mut r.shutdown()).is_ready());
    assert_eq!(r.leased_units(), 0);
    // Another replica finds the 9 units the first did not use.
    assert_eq!(w.direct_admitted(&plain, b"k", 12), 9);
    // After shutdown, the replica takes no slice: each check is the shared backend's.
    let fresh: Vec<u64> = [&b"a"[..], b"b"]
        .iter()
        .map(|key| check(&r, &[&limit], key)[0].remaining)
        .collect();
    assert_eq!(fresh, [9, 9]);
    assert_eq!(r.leased_units(), 0);
}

#[test]
fn a_live_replica_gives_an_expired_slice_back() {
    let w = World::new();
    let plain = gcra_per_hour("expiring", 10);
    let limit = leased(&plain, Duration::from_secs(1));
    let r = w.replica();
    assert!(check(&r, &[&limit], b"idle")[0].is_allowed());
    assert_eq!(r.leased_units(), 3);
    // Two seconds later, a check of another key finds the idle key's slice expired.
    w.at(T0 + 2 * S);
    assert!(check(&r, &[&limit], b"busy")[0].is_allowed());
    assert_eq!(r.leased_units(), 3, "only the busy key's slice");
    assert_eq!(w.direct_admitted(&plain, b"idle", 12), 9);
}

#[test]
fn a_dropped_replicas_units_come_back_with_time() {
    let w = World::new();
    let day = Duration::from_secs(86_400);
    // A fixed window: the slice ends with its window, and so do its units.
    let plain = Limit::fixed_window("fw", Quota::per_minute(10).unwrap()).unwrap();
    let dropped = w.replica();
    assert!(check(&dropped, &[&leased(&plain, day)], b"k")[0].is_allowed());
    assert_eq!(dropped.leased_units(), 3);
    drop(dropped);
    w.at(T0 + S);
    assert_eq!(w.direct_admitted(&plain, b"k", 12), 6);
    w.at(T0 + 60 * S);
    assert_eq!(w.direct_admitted(&plain, b"k", 12), 10);
    // GCRA (one unit per 6 s): the slice's 4 units are TAT taken at the take, so they refill
    // like admitted requests; 24 s later the bucket is whole.
    let plain = Limit::gcra("g", Quota::per_minute(10).unwrap()).unwrap();
    let gcra = leased(&plain, day);
    w.at(T0);
    let dropped = w.replica();
    assert!(check(&dropped, &[&gcra], b"k")[0].is_allowed());
    assert_eq!(dropped.leased_units(), 3);
    drop(dropped);
    w.at(T0 + 18 * S);
    assert_eq!(w.direct(&plain, b"k")[0].remaining, 8);
    w.at(T0 + 30 * S);
    assert_eq!(w.direct_admitted(&plain, b"k", 12), 10);
    // Given back at shutdown instead, the 3 units are there at once.
    w.at(T0 + 100 * S);
    let graceful = w.replica();
    assert!(check(&graceful, &[&gcra], b"j")[0].is_allowed());
    assert!(poll(&mut graceful.shutdown()).is_ready());
    assert_eq!(w.direct_admitted(&plain, b"j", 12), 9);
}

#[test]
fn a_gcra_slice_is_not_given_back_once_another_check_moved_the_tat() {
    let w = World::new();
    let plain = gcra_per_hour("moved", 10);
    let limit = leased(&plain, Duration::from_secs(3_600));
    let holder = w.replica();
    assert!(check(&holder, &[&limit], b"k")[0].is_allowed());
    assert_eq!(holder.leased_units(), 3);
    // Nothing moved the TAT: the 3 units go back.
    assert!(poll(&mut holder.shutdown()).is_ready());
    assert_eq!(w.direct(&plain, b"k")[0].remaining, 8);
    // Another take, then another replica's admission moves the TAT on: other replicas'
    // slices could be paced by it, so the units stay counted and refill with the TAT.
    let holder = w.replica();
    assert!(check(&holder, &[&limit], b"k")[0].is_allowed());
    assert_eq!(holder.leased_units(), 3);
    assert_eq!(w.direct(&plain, b"k")[0].remaining, 3);
    assert!(poll(&mut holder.shutdown()).is_ready());
    assert_eq!(w.direct(&plain, b"k")[0].remaining, 2);
}

#[test]
fn stacked_limits_stay_all_or_nothing_with_a_slice() {
    let w = World::new();
    let plain = gcra_per_hour("hot", 10);
    let hot = leased(&plain, Duration::from_secs(3_600));
    let strict = Limit::fixed_window("strict", Quota::per_hour(2).unwrap()).unwrap();
    let r = w.replica();
    let first = check(&r, &[&hot, &strict], b"k");
    assert!(first.iter().all(|v| v.is_allowed()));
    assert_eq!(r.leased_units(), 3);
    let second = check(&r, &[&hot, &strict], b"k");
    assert!(second.iter().all(|v| v.is_allowed()));
    assert!(second.from_lease(0) && !second.from_lease(1));
    assert_eq!(r.leased_units(), 2);
    // The slice would admit, the other limit refuses: the unit goes back into the slice.
    let third = check(&r, &[&hot, &strict], b"k");
    assert!(third[0].is_allowed());
    assert!(matches!(third[1].status, Status::Denied { .. }));
    assert_eq!(r.leased_units(), 2);
    // The backend counted the slice's 4 units and nothing for the refused request.
    assert_eq!(w.direct(&plain, b"k")[0].remaining, 5);
}

#[test]
fn an_answer_dropped_before_it_is_polled_puts_its_units_back() {
    let w = World::new();
    let hot = leased(&gcra_per_hour("hot", 10), Duration::from_secs(3_600));
    let other = Limit::fixed_window("other", Quota::per_hour(5).unwrap()).unwrap();
    let r = w.replica();
    assert!(check(&r, &[&hot], b"k")[0].is_allowed());
    assert_eq!(r.leased_units(), 3);
    // The slice's unit is taken at once; the other limit waits for the future.
    let pending = r.check(&[Check::new(&hot, b"k"), Check::new(&other, b"k")]);
    assert_eq!(r.leased_units(), 2);
    drop(pending);
    assert_eq!(r.leased_units(), 3);
    // A take dropped before it is sent ends: the next check takes again.
    let cold = leased(&gcra_per_hour("cold", 10), Duration::from_secs(3_600));
    drop(r.check(&[Check::new(&cold, b"k")]));
    assert_eq!(r.inner().calls(), 1);
    let v = check(&r, &[&cold], b"k");
    assert!(v[0].is_allowed() && !v.from_lease(0));
    assert_eq!(r.leased_units(), 6);
}

#[test]
fn a_slice_in_hand_is_used_while_the_backend_is_down_then_the_failure_is_reported() {
    let w = World::new();
    let limit = leased(&gcra_per_hour("down", 10), Duration::from_secs(3_600));
    let r = w.replica();
    assert!(check(&r, &[&limit], b"k")[0].is_allowed());
    r.inner().set_down(true);
    for _ in 0..3 {
        assert!(check(&r, &[&limit], b"k").from_lease(0));
    }
    let err = r.check_now(&[Check::new(&limit, b"k")]).unwrap_err();
    assert_eq!(err.kind(), BackendErrorKind::Unavailable);
    // A failed take ends: once the backend is back, the key takes a slice again.
    r.inner().set_down(false);
    let v = check(&r, &[&limit], b"k");
    assert!(v[0].is_allowed() && !v.from_lease(0));
    assert_eq!(r.leased_units(), 2);
}

#[test]
fn a_refusal_is_only_the_requests_own() {
    let w = World::new();
    let plain = Limit::fixed_window("daily", Quota::per_day(20).unwrap()).unwrap();
    let limit = plain
        .clone()
        .with_lease(Lease::new(8).unwrap().with_divisor(1).unwrap())
        .unwrap();
    let (a, b) = (w.replica(), w.replica());
    assert!(check(&a, &[&limit], b"k")[0].is_allowed());
    assert_eq!(a.leased_units(), 7);
    assert_eq!(w.direct_admitted(&plain, b"k", 7), 7);
    // 5 remain; b asks for 8 (it saw nothing yet), is refused, and asks for 5.
    let v = check(&b, &[&limit], b"k");
    assert!(v[0].is_allowed() && !v.from_lease(0));
    assert_eq!(b.inner().calls(), 2);
    assert_eq!(b.leased_units(), 4);
    assert_eq!(w.remaining(&plain, b"k"), 0);
    // Near the limit a refused slice is asked once more at the request's own cost.
    let c = w.replica();
    let plain_gcra = gcra_per_hour("g", 10);
    let gcra = plain_gcra
        .clone()
        .with_lease(Lease::new(8).unwrap().with_divisor(1).unwrap());
    let gcra = gcra.unwrap();
    assert_eq!(w.direct_admitted(&plain_gcra, b"k", 9), 9);
    let v = check(&c, &[&gcra], b"k");
    assert!(v[0].is_allowed() && !v.from_lease(0));
    assert_eq!(c.inner().calls(), 2);
    assert_eq!(c.leased_units(), 0);
    // Nothing left: refused with the wait of the request's own unit (one emission
    // interval), not the slice's.
    let v = check(&c, &[&gcra], b"k");
    assert_eq!(
        v[0].status,
        Status::Denied {
            retry_after: Quota::per_hour(10).unwrap().emission_interval()
        }
    );
}

#[test]
fn a_reload_under_another_quota_gives_the_old_slice_back() {
    let w = World::new();
    let life = Duration::from_secs(3_600);
    let ten = leased(
        &Limit::fixed_window("daily", Quota::per_day(10).unwrap()).unwrap(),
        life,
    );
    let twenty = leased(
        &Limit::fixed_window("daily", Quota::per_day(20).unwrap()).unwrap(),
        life,
    );
    let r = w.replica();
    assert!(check(&r, &[&ten], b"k")[0].is_allowed());
    assert_eq!(r.leased_units(), 3);
    // Reloaded: the 3 units go back under the quota they were taken under, and the new
    // quota takes its own slice from what remains (1 used of 20: 4 taken).
    let v = check(&r, &[&twenty], b"k");
    assert!(v[0].is_allowed() && !v.from_lease(0));
    assert_eq!(r.leased_units(), 3);
    assert_eq!(w.remaining(&twenty, b"k"), 15);
    // A take still out when the limit is reloaded is not the new entry's: it goes back at
    // once, under its own quota.
    let out = r.check(&[Check::new(&ten, b"j")]);
    let v = check(&r, &[&twenty], b"j");
    assert!(v[0].is_allowed() && !v.from_lease(0));
    assert_eq!(w.remaining(&twenty, b"j"), 16);
    let mut out = out;
    let Poll::Ready(Ok(v)) = poll(&mut out) else {
        panic!("the memory backend answers at once");
    };
    assert!(v[0].is_allowed() && !v.from_lease(0));
    assert_eq!(r.leased_units(), 6, "the two new slices only");
    assert_eq!(w.remaining(&twenty, b"j"), 15);
}

#[test]
fn a_leased_fixed_window_settles_in_its_window() {
    let w = World::new();
    let plain = Limit::fixed_window("metered", Quota::per_day(10).unwrap()).unwrap();
    let limit = leased(&plain, Duration::from_secs(3_600));
    let r = w.replica();
    check(&r, &[&limit], b"k");
    let c = Check::new(&limit, b"k");
    let v = r.check_now(&[c]).unwrap();
    assert!(v.from_lease(0));
    assert_eq!(w.remaining(&plain, b"k"), 6);
    // The request cost nothing after all: refunded in the window its slice was counted in.
    r.settle(&[Settlement::of(&c, v.receipt(0), 0)]);
    assert_eq!(w.remaining(&plain, b"k"), 7);
    assert_eq!(r.leased_units(), 2);
}

#[test]
fn a_reset_drops_this_replicas_slice_of_the_key() {
    let w = World::new();
    let limit = leased(
        &Limit::fixed_window("daily", Quota::per_day(10).unwrap()).unwrap(),
        Duration::from_secs(60),
    );
    let r = w.replica();
    assert!(check(&r, &[&limit], b"k")[0].is_allowed());
    assert_eq!(r.leased_units(), 3);
    let mut reset = r.reset(&Check::new(&limit, b"k"));
    assert!(matches!(poll(&mut reset), Poll::Ready(Ok(()))));
    assert_eq!(r.leased_units(), 0);
    assert_eq!(admitted(&r, &limit, b"k", 20), 10);
}

#[test]
fn past_ten_thousand_keys_new_keys_are_checked_without_a_lease() {
    let w = World::new();
    let limit = leased(&gcra_per_hour("many", 10), Duration::from_secs(3_600));
    let r = w.replica();
    for i in 0..10_000_u32 {
        assert!(check(&r, &[&limit], &i.to_be_bytes())[0].is_allowed());
    }
    assert_eq!(r.leased_units(), 30_000);
    let v = check(&r, &[&limit], b"one more");
    assert!(v[0].is_allowed() && !v.from_lease(0));
    assert_eq!(v[0].remaining, 9);
    assert_eq!(r.leased_units(), 30_000);
}

#[test]
fn plans_and_shadow_checks_are_not_leased() {
    let w = World::new();
    let limit = leased(&gcra_per_hour("plans", 10), Duration::from_secs(3_600));
    let r = w.replica();
    let plan = Check::new(&limit, b"k").with_quota(Quota::per_hour(100).unwrap());
    assert_eq!(r.check_now(&[plan]).unwrap()[0].remaining, 99);
    let mut shadow = Check::new(&limit, b"s");
    shadow.enforce = false;
    assert_eq!(r.check_now(&[shadow]).unwrap()[0].remaining, 9);
    assert_eq!(r.leased_units(), 0);
}

#[test]
fn a_take_answered_after_shutdown_gives_its_slice_back_at_once() {
    let w = World::new();
    let plain = gcra_per_hour("closing", 10);
    let limit = leased(&plain, Duration::from_secs(3_600));
    let r = w.replica();
    let mut out = r.check(&[Check::new(&limit, b"k")]);
    assert!(poll(&mut r.shutdown()).is_ready());
    let Poll::Ready(Ok(v)) = poll(&mut out) else {
        panic!("the memory backend answers at once");
    };
    assert!(v[0].is_allowed() && !v.from_lease(0));
    assert_eq!(r.leased_units(), 0);
    // The request's unit stays counted, the slice's 3 are back.
    assert_eq!(w.remaining(&plain, b"k"), 9);
}

#[test]
fn the_memory_backend_applies_a_guarded_gcra_refund_only_at_its_tat() {
    let w = World::new();
    let limit = gcra_per_hour("guarded", 10);
    let c = Check::new(&limit, b"k").with_cost(4);
    let v = w.memory.check_now(&[c]).unwrap();
    let tat = v.receipt(0).at + v[0].reset;
    // A receipt with a TAT and no time: guarded by the TAT alone, as a lease's give-back.
    let guarded = |tat| Settlement::of(&c, tollgate_engine::Receipt::guarded(tat), 1);
    // Another TAT than the key's: nothing changes.
    w.memory.settle_now(&[guarded(tat + 1)]);
    assert_eq!(w.remaining(&limit, b"k"), 6);
    // The key's own TAT: 3 of the 4 units come back.
    w.memory.settle_now(&[guarded(tat)]);
    assert_eq!(w.remaining(&limit, b"k"), 9);
    // The TAT moved with that refund: the same guard no longer holds.
    w.memory.settle_now(&[guarded(tat)]);
    assert_eq!(w.remaining(&limit, b"k"), 9);
}

/// One sequential trace (three replicas, irregular times across expiries, window turns and
/// refills, one replica shut down half-way): no admission beyond the quota, every unit a
/// slice took either admitted from it, still held or unused, and every call counted.
#[test]
fn a_trace_never_admits_beyond_the_quota() {
    for (i, (plain, limit)) in leases::trace_limits().into_iter().enumerate() {
        let w = World::new();
        let replicas: Vec<Replica> = (0..3).map(|_| w.replica()).collect();
        // The quota itself, run on the admission times: what must admit each of them.
        let judge = leases::memory(&w.clock);
        let mut seed = 0x5eed_u64 + i as u64;
        let mut now = T0;
        let (mut admitted, mut local, mut over) = (0, 0, 0);
        for n in 0..400 {
            let r = splitmix(&mut seed);
            now += r % 120_000;
            w.at(now);
            let who = (r >> 32) as usize % 3;
            if n == 200 {
                assert!(poll(&mut replicas[2].shutdown()).is_ready());
                assert_eq!(replicas[2].leased_units(), 0);
            }
            let v = check(&replicas[who], &[&limit], b"key");
            if v[0].is_allowed() {
                admitted += 1;
                local += u64::from(v.from_lease(0));
                over += usize::from(
                    !judge.check_now(&[Check::new(&plain, b"key")]).unwrap()[0].is_allowed(),
                );
            }
        }
        assert_eq!(over, 0, "{}: admitted beyond the quota", limit.name());
        let sliced: u64 = replicas.iter().map(|r| r.inner().sliced()).sum();
        let held: u64 = replicas.iter().map(Replica::leased_units).sum();
        assert!(
            local + held <= sliced,
            "{}: {local} admitted from slices and {held} held, of {sliced} taken",
            limit.name()
        );
        // The trace is worth something: slices were used, and the limit was reached.
        assert!(
            local >= 10 && admitted < 400,
            "{admitted} admitted, {local} from slices"
        );
    }
}
