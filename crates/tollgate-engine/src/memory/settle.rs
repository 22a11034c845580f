//! Settling checks admitted earlier: a refund or a further charge of each, in the window or
//! under the quota of its check.

use std::collections::hash_map::Entry;
use std::collections::VecDeque;

use crate::algorithm;
use crate::check::{Check, Settlement};
use crate::clock::Clock;
use crate::counting::Algorithm;
use crate::memory::inner::{Inner, Sweeps};
use crate::memory::shard::{store, Log, Record};

impl<C: Clock> Inner<C> {
    /// Settles checks admitted earlier, at once (see [`Settlement`] for what each algorithm
    /// does). A settle that would add a key while every place is taken changes nothing.
    pub(super) fn settle(&self, settlements: &[Settlement<'_>]) {
        let now = self.clock.now();
        let mask = self.shards.len() - 1;
        let mut sweeps = Sweeps::new(self.key_cap.shard_cap);
        for s in settlements {
            if s.actual == s.reserved {
                continue;
            }
            // The check's own fingerprint (a fixed window's mixes in its period).
            let fp = self.fingerprint(&Check::new(s.limit, s.key).with_quota(s.quota));
            let mut guard = self.lock(fp.shard(mask), now, &mut sweeps);
            let shard = &mut *guard;
            let room = shard.len() < self.key_cap.shard_cap;
            // The quota the check was made under (its plan's), never the limit's default.
            let quota = &s.quota;
            match s.limit.algorithm() {
                // A slot is one request: nothing to settle.
                Algorithm::Concurrency => {}
                Algorithm::Gcra => {
                    let stored = shard.gcra.get_mut(&fp).map(Record::get);
                    // A refund applies only within its check's run and when it frees the last
                    // reservation or nobody waits (algorithm::gcra_refund); the TAT is carried
                    // first if another quota wrote it.
                    let receipt = (s.receipt.at, s.receipt.tat());
                    let (reserved, actual) = (s.reserved, s.actual);
                    match algorithm::gcra_settled(quota, stored, now, receipt, reserved, actual) {
                        Some(t) if t.tat <= now && shard.gcra.remove(&fp).is_some() => {
                            self.key_cap.free(1);
                        }
                        Some(t) if t.tat <= now => {}
                        Some(t) if stored.is_some() || (room && self.key_cap.reserve()) => {
                            store(&mut shard.gcra, fp, t);
                        }
                        _ => {}
                    }
                }
                Algorithm::FixedWindow => {
                    if s.receipt.window_end() <= now {
                        continue;
                    }
                    let state = shard.windows.get(&fp).copied();
                    let most = s.reserved.saturating_add(quota.limit().saturating_mul(2));
                    let actual = s.actual.min(most);
                    if let Some(next) = algorithm::fixed_window_settle(
                        state,
                        s.receipt.window_end(),
                        s.reserved,
                        actual,
                    ) {
                        if state.is_some() || (room && self.key_cap.reserve()) {
                            store(&mut shard.windows, fp, next);
                        }
                    }
                }
                Algorithm::SlidingLog => {
                    let period = quota.period_micros();
                    if s.actual < s.reserved {
                        let Some(log) = shard.logs.get_mut(&fp) else {
                            continue;
                        };
                        // The check's units are the entries at the time its receipt says they
                        // were recorded at (units recorded in the same microsecond are the same
                        // units). Once they have left the log, it holds none of them: a later
                        // check's are not given back.
                        let entries = log.entries.make_contiguous();
                        let from = entries.partition_point(|&t| t < s.receipt.at);
                        let to = entries.partition_point(|&t| t <= s.receipt.at);
                        let n = (to - from).min((s.reserved - s.actual) as usize);
                        log.entries.drain(from..from + n);
                    } else {
                        let log = match shard.logs.entry(fp) {
                            Entry::Occupied(e) => e.into_mut(),
                            Entry::Vacant(e) => {
                                if !(room && self.key_cap.reserve()) {
                                    continue;
                                }
                                // Kept as a check's entries are (`Shard::commit`).
                                e.insert(Log {
                                    entries: VecDeque::new(),
                                    period: s.limit.log_keep_micros(quota),
                                })
                            }
                        };
                        let alive = log
                            .entries
                            .iter()
                            .filter(|&&t| t.saturating_add(period) > now)
                            .count() as u64;
                        let more =
                            algorithm::sliding_log_charge(quota, alive, s.reserved, s.actual);
                        let _ = log.record(now, more as usize);
                    }
                }
            }
        }
    }
}
