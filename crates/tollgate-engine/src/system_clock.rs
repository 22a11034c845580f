//! The real clock: the system time, counted between readings of the monotonic clock, which
//! never goes back on a thread and follows the system time when that is stepped.

use std::cell::Cell;
use std::sync::atomic::{fence, AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

#[cfg(test)]
use crate::clock::FakeClock;
use crate::clock::{micros, Clock, Micros};
use crate::tsc::{self, kernel_nanos, Anchor};

/// The real clock: the system time, counted between readings on the monotonic clock.
///
/// It never goes backwards on a thread, it follows the system time when that is stepped (NTP
/// setting the clock after boot, a virtual machine resumed), and it reads the time-stamp
/// counter rather than calling into the kernel.
///
/// # How it follows the system time
///
/// `now` is counted on a monotonic clock from the system time, and about once a second the
/// first reading of that second also reads the system time and compares:
///
/// - **The system time is ahead** (it was stepped forward, or the monotonic clock did not count
///   a suspension of the machine, which a resumed virtual machine's clock makes up with a
///   step): `now` jumps forward to it at once. A window that the step crosses is over: the next
///   check counts in the window of the new time, and GCRA refills as if the step's length had
///   passed. That is what happened for the rest of the world (the other replicas, Redis' `TIME`,
///   the calendar), and slewing instead would hand out the same refill, only later, while the
///   UTC windows stayed misaligned.
/// - **The system time is behind** (stepped back): `now` never goes back. It runs at half speed
///   until it meets the system time again, which takes twice the step's length; then it runs at
///   full speed. A window that the step crosses keeps its count and does not start again; it
///   lasts longer (up to twice as long) in real time, and refills meanwhile come at half the
///   quota's rate: the clock errs toward limiting, by at most the step's length of quota in
///   all, and never freezes.
///
/// Small differences between the two clocks are handled the same way, a microsecond at a time.
///
/// # Cost
///
/// The monotonic part is read from the CPU's time-stamp counter where it is invariant (through
/// `quanta`, which falls back to the kernel's monotonic clock elsewhere). The counter's rate is
/// only estimated, so each thread re-reads the kernel's monotonic clock every millisecond and
/// counts from there; an error in the rate then stays far below a microsecond instead of
/// growing with uptime. Comparing with the system time costs one more `clock_gettime` once a
/// second in the whole process. Readings on one thread never decrease; two threads agree to a
/// fraction of a microsecond (a check reads `now` before it takes its shard's lock, so checks
/// never relied on a closer agreement). Every `SystemClock` of a process reads the same time.
/// What reading the counter saves: see `docs/benchmarks.md`, section "Hand-written parts of the
/// core, and what each saves", "The clock".
#[derive(Debug, Clone, Copy)]
pub struct SystemClock {
    /// Test sources in place of the machine's clocks.
    #[cfg(test)]
    sources: Option<&'static TestSources>,
}

impl SystemClock {
    /// The system clock (the first one of the process reads the system time).
    pub fn new() -> Self {
        // Calibrates the counter now, once per process, rather than in the first request.
        let _ = tsc::counter();
        TRACKER.start(|| monotonic_nanos() / 1_000, wall_micros);
        Self {
            #[cfg(test)]
            sources: None,
        }
    }

    /// A clock that reads `monotonic` (microseconds from any origin) and `wall` (the system
    /// time, microseconds since the Unix epoch) instead of the machine's clocks.
    #[cfg(test)]
    pub(crate) fn with_sources(monotonic: FakeClock, wall: FakeClock) -> Self {
        let sources: &'static TestSources = Box::leak(Box::new(TestSources {
            tracker: Tracker::new(),
            monotonic,
            wall,
        }));
        sources
            .tracker
            .start(|| sources.monotonic.now(), || sources.wall.now());
        Self {
            sources: Some(sources),
        }
    }
}

impl Default for SystemClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for SystemClock {
    #[inline]
    fn now(&self) -> Micros {
        #[cfg(test)]
        if let Some(t) = self.sources {
            return t.tracker.now(t.monotonic.now(), || t.wall.now());
        }
        system_now()
    }
}

#[cfg(test)]
#[derive(Debug)]
struct TestSources {
    tracker: Tracker,
    monotonic: FakeClock,
    wall: FakeClock,
}

/// The system time, in microseconds since the Unix epoch (0 before it).
fn wall_micros() -> Micros {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, micros)
}

/// How often the system time is read and compared, in monotonic microseconds.
const COMPARE_EVERY: Micros = 1_000_000;

/// How `now` is counted from a monotonic reading `m`: `m + offset` (wrapping: the offset is
/// the system time minus the monotonic reading at the last comparison), plus half of what is
/// left until `until` while `m` is below it. When the system time was found behind by `d`,
/// `until` is `2d` past that comparison: `now` starts where it was and runs at half speed
/// until it meets the system time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Course {
    offset: Micros,
    until: Micros,
}

impl Course {
    #[inline]
    fn at(self, m: Micros) -> Micros {
        let t = m.wrapping_add(self.offset);
        if m >= self.until {
            t
        } else {
            t.wrapping_add((self.until - m) / 2)
        }
    }

    /// The course after a comparison at monotonic reading `m`, where `now` was `current` and
    /// the system time is `wall`.
    fn toward(wall: Micros, current: Micros, m: Micros) -> Self {
        let behind = current.saturating_sub(wall);
        Self {
            offset: wall.wrapping_sub(m),
            until: m.saturating_add(behind.saturating_mul(2)),
        }
    }
}

/// One of the two copies of the course. `seq` is odd while the copy is written.
#[derive(Debug)]
struct CourseCell {
    seq: AtomicU64,
    offset: AtomicU64,
    until: AtomicU64,
}

impl CourseCell {
    const fn new() -> Self {
        Self {
            seq: AtomicU64::new(0),
            offset: AtomicU64::new(0),
            until: AtomicU64::new(0),
        }
    }
}

/// The course of a clock and when to compare it with the system time next.
///
/// Readers never wait and never write: the course is kept in two copies, and the thread that
/// compares writes the one that is not current, then makes it current (each copy carries a
/// sequence number, so that a reader that was held up while its copy was rewritten, a second
/// later, reads again).
#[derive(Debug)]
#[repr(align(128))]
struct Tracker {
    /// The monotonic reading at which to compare next; 0 before the first comparison.
    next: AtomicU64,
    /// Held by the thread that compares.
    busy: AtomicBool,
    /// How many times the course was set; the current copy is `cells[current % 2]`.
    current: AtomicUsize,
    cells: [CourseCell; 2],
}

static TRACKER: Tracker = Tracker::new();

impl Tracker {
    const fn new() -> Self {
        Self {
            next: AtomicU64::new(0),
            busy: AtomicBool::new(false),
            current: AtomicUsize::new(0),
            cells: [CourseCell::new(), CourseCell::new()],
        }
    }

    /// Makes the first comparison if nobody has: `now` is not meaningful before it.
    fn start(&self, monotonic: impl Fn() -> Micros, wall: impl Fn() -> Micros) {
        while self.next.load(Ordering::Acquire) == 0 {
            if !self.compare(monotonic(), &wall) {
                std::hint::spin_loop();
            }
        }
    }

    /// `now` at monotonic reading `m`; `wall` reads the system time when it is time to compare.
    #[inline]
    fn now(&self, m: Micros, wall: impl FnOnce() -> Micros) -> Micros {
        if m >= self.next.load(Ordering::Relaxed) {
            self.compare(m, wall);
        }
        self.course().at(m)
    }

    /// [`Tracker::now`] with the thread's copy of the course in `thread`, read again only when
    /// the course has changed: two loads of a line that changes once a second.
    #[inline]
    fn now_cached(&self, m: Micros, thread: &mut ThreadClock) -> Micros {
        if m >= self.next.load(Ordering::Relaxed) {
            self.compare(m, wall_micros);
        }
        let version = self.current.load(Ordering::Acquire);
        if version != thread.version {
            // At least as new as `version`: it reads `current` again.
            thread.course = self.course();
            thread.version = version;
        }
        thread.course.at(m)
    }

    #[inline]
    fn course(&self) -> Course {
        loop {
            let cell = &self.cells[self.current.load(Ordering::Acquire) & 1];
            let seq = cell.seq.load(Ordering::Acquire);
            let course = Course {
                offset: cell.offset.load(Ordering::Relaxed),
                until: cell.until.load(Ordering::Relaxed),
            };
            fence(Ordering::Acquire);
            if seq & 1 == 0 && cell.seq.load(Ordering::Relaxed) == seq {
                return course;
            }
            std::hint::spin_loop();
        }
    }

    /// Compares with the system time and sets the course, unless another thread is doing it;
    /// `false` then.
    #[cold]
    #[inline(never)]
    fn compare(&self, m: Micros, wall: impl FnOnce() -> Micros) -> bool {
        if self
            .busy
            .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            return false;
        }
        let next = self.next.load(Ordering::Relaxed);
        if m >= next {
            let course = if next == 0 {
                Course::toward(wall(), 0, m)
            } else {
                Course::toward(wall(), self.course().at(m), m)
            };
            let version = self.current.load(Ordering::Relaxed).wrapping_add(1);
            let cell = &self.cells[version & 1];
            let seq = cell.seq.load(Ordering::Relaxed);
            cell.seq.store(seq.wrapping_add(1), Ordering::Relaxed);
            fence(Ordering::Release);
            cell.offset.store(course.offset, Ordering::Relaxed);
            cell.until.store(course.until, Ordering::Relaxed);
            cell.seq.store(seq.wrapping_add(2), Ordering::Release);
            self.current.store(version, Ordering::Release);
            self.next
                .store(m.saturating_add(COMPARE_EVERY).max(1), Ordering::Release);
        }
        self.busy.store(false, Ordering::Release);
        true
    }
}

/// What a thread keeps between its readings: its counter's anchor, its latest `now`, and its
/// copy of [`TRACKER`]'s course with the version it was read at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ThreadClock {
    anchor: Anchor,
    now: Micros,
    course: Course,
    version: usize,
}

impl ThreadClock {
    const UNSET: Self = Self {
        anchor: Anchor::UNSET,
        now: 0,
        course: Course {
            offset: 0,
            until: 0,
        },
        version: usize::MAX,
    };
}

thread_local! {
    static THREAD_CLOCK: Cell<ThreadClock> = const { Cell::new(ThreadClock::UNSET) };
}

/// The process's `now`: [`TRACKER`]'s course at the thread's monotonic reading, never below the
/// thread's latest `now` (a thread that read the course just before another thread changed it
/// may be a fraction of a microsecond ahead of the new one).
#[inline]
fn system_now() -> Micros {
    THREAD_CLOCK
        .try_with(|cell| {
            let mut thread = cell.get();
            let m = thread.anchor.monotonic_nanos() / 1_000;
            let now = TRACKER.now_cached(m, &mut thread).max(thread.now);
            thread.now = now;
            cell.set(thread);
            now
        })
        .unwrap_or_else(|_| TRACKER.now(kernel_nanos() / 1_000, wall_micros))
}

/// [`kernel_nanos`], extrapolated with the time-stamp counter on this thread.
#[inline]
fn monotonic_nanos() -> u64 {
    THREAD_CLOCK
        .try_with(|cell| {
            let mut thread = cell.get();
            let nanos = thread.anchor.monotonic_nanos();
            cell.set(thread);
            nanos
        })
        .unwrap_or_else(|_| kernel_nanos())
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn system_clock_never_decreases_on_a_thread() {
        let clock = SystemClock::new();
        let mut last = clock.now();
        for _ in 0..100_000 {
            let now = clock.now();
            assert!(now >= last, "{now} < {last}");
            last = now;
        }
    }

    const T0: Micros = 1_700_000_000_000_000;
    const S: Micros = 1_000_000;

    /// A system clock on fake sources: the monotonic one starts at 5 s, the system time at T0.
    fn stepped(wall_at: Micros) -> (SystemClock, FakeClock, FakeClock) {
        let monotonic = FakeClock::new(5 * S);
        let wall = FakeClock::new(wall_at);
        let clock = SystemClock::with_sources(monotonic.clone(), wall.clone());
        (clock, monotonic, wall)
    }

    /// Time passes for both clocks.
    fn pass(monotonic: &FakeClock, wall: &FakeClock, micros: Micros) {
        monotonic.advance(Duration::from_micros(micros));
        wall.advance(Duration::from_micros(micros));
    }

    #[test]
    fn a_forward_step_is_followed_at_the_next_comparison() {
        let (clock, monotonic, wall) = stepped(T0);
        assert_eq!(clock.now(), T0);
        pass(&monotonic, &wall, 400_000);
        assert_eq!(clock.now(), T0 + 400_000);
        wall.advance(Duration::from_secs(60));
        // Compared once a second: not yet.
        pass(&monotonic, &wall, 599_999);
        assert_eq!(clock.now(), T0 + 999_999);
        pass(&monotonic, &wall, 1);
        assert_eq!(clock.now(), T0 + 61 * S);
        pass(&monotonic, &wall, 2 * S);
        assert_eq!(clock.now(), T0 + 63 * S);
        assert_eq!(clock.now(), wall.now());
    }

    #[test]
    fn a_backward_step_slows_the_clock_to_half_speed_until_it_has_caught_up() {
        let (clock, monotonic, wall) = stepped(T0);
        assert_eq!(clock.now(), T0);
        wall.set(T0 - 10 * S);
        pass(&monotonic, &wall, S);
        // Compared: 10 s ahead of the system time, so it goes on from where it was.
        assert_eq!(clock.now(), T0 + S);
        pass(&monotonic, &wall, 1);
        assert_eq!(clock.now(), T0 + S);
        pass(&monotonic, &wall, 1);
        assert_eq!(clock.now(), T0 + S + 1);
        pass(&monotonic, &wall, 999_998);
        assert_eq!(clock.now(), T0 + S + 500_000);
        // Read every millisecond, compared every second: never back, never stopped.
        let mut last = clock.now();
        for _ in 0..18_000 {
            pass(&monotonic, &wall, 1_000);
            let now = clock.now();
            assert!(now > last, "{now} <= {last}");
            last = now;
        }
        assert_eq!(last, T0 + 10 * S + 500_000);
        assert_eq!(wall.now(), T0 + 10 * S);
        // 20 s after the step it meets the system time, and runs at full speed from there.
        pass(&monotonic, &wall, S);
        assert_eq!(clock.now(), T0 + 11 * S);
        assert_eq!(clock.now(), wall.now());
        pass(&monotonic, &wall, S);
        assert_eq!(clock.now(), T0 + 12 * S);
        pass(&monotonic, &wall, 3 * S + 7);
        assert_eq!(clock.now(), T0 + 15 * S + 7);
        assert_eq!(clock.now(), wall.now());
    }

    /// 10:30 UTC on the 19,700th day of the epoch.
    const HALF_PAST_TEN: Micros = (19_700 * 86_400 + 10 * 3_600 + 30 * 60) * S;

    fn hourly(clock: SystemClock) -> impl Fn() -> crate::Verdict {
        let backend = crate::MemoryBackend::builder().clock(clock).build();
        let limit =
            crate::Limit::fixed_window("hourly", crate::Quota::per_hour(2).unwrap()).unwrap();
        move || {
            backend
                .check_now(&[crate::Check::new(&limit, b"k")])
                .unwrap()[0]
        }
    }

    #[test]
    fn a_utc_hour_window_follows_a_forward_step() {
        let (clock, monotonic, wall) = stepped(HALF_PAST_TEN);
        let check = hourly(clock);
        assert!(check().is_allowed());
        assert!(check().is_allowed());
        let denied = crate::Status::Denied {
            retry_after: 1_800 * S,
        };
        assert_eq!(check().status, denied);
        // The system time moves to 11:30: the 10:00 window is over for this clock too.
        wall.advance(Duration::from_secs(3_600));
        pass(&monotonic, &wall, S);
        let v = check();
        assert_eq!(
            (v.status, v.remaining, v.reset),
            (crate::Status::Allowed, 1, 1_799 * S)
        );
    }

    #[test]
    fn a_backward_step_neither_reopens_nor_restarts_the_window() {
        let (clock, monotonic, wall) = stepped(HALF_PAST_TEN);
        let check = hourly(clock);
        assert!(check().is_allowed());
        assert!(check().is_allowed());
        // The system time goes back to 9:30: the 10:00 window keeps its count, and its end
        // comes at half speed.
        wall.advance(Duration::from_secs(1));
        wall.set(wall.now() - 3_600 * S);
        monotonic.advance(Duration::from_secs(1));
        let retry = |v: crate::Verdict| match v.status {
            crate::Status::Denied { retry_after } => retry_after,
            other => panic!("{other:?}"),
        };
        assert_eq!(retry(check()), 1_799 * S);
        pass(&monotonic, &wall, 2 * S);
        assert_eq!(retry(check()), 1_798 * S);
        // The 1,797 s left take twice that in real time.
        pass(&monotonic, &wall, 3_594 * S);
        assert_eq!(retry(check()), S);
        pass(&monotonic, &wall, 2 * S);
        let v = check();
        assert_eq!((v.status, v.remaining), (crate::Status::Allowed, 1));
    }
}
