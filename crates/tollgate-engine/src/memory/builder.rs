//! Building a memory backend: its cap on keys, its shards and its sweep interval.

use crate::reports::Board;
use std::sync::atomic::{AtomicU64, AtomicUsize};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use crate::clock::{micros, Clock};
use crate::memory::inner::{Inner, KeyCap, Sweeping};
use crate::memory::MemoryBackend;
use crate::sip::Sip13;
use crate::system_clock::SystemClock;

const DEFAULT_MAX_KEYS: usize = 1 << 20;
const DEFAULT_SWEEP: Duration = Duration::from_secs(1);

/// The most keys a full backend holds per shard, on average: the shard count is raised to
/// `max_keys / SHARD_KEYS` when that is more. It bounds the entries one sweep visits and one
/// table growth moves, and so the worst time of a check.
const SHARD_KEYS: usize = 4_096;

const MAX_SHARDS: usize = 1 << 16;

impl MemoryBackend<SystemClock> {
    /// A backend with the defaults: about 1M keys, the system clock.
    pub fn new() -> Self {
        Self::builder().build()
    }

    /// Configures a backend.
    pub fn builder() -> MemoryBackendBuilder<SystemClock> {
        MemoryBackendBuilder {
            clock: SystemClock::new(),
            max_keys: DEFAULT_MAX_KEYS,
            shards: None,
            sweep_interval: DEFAULT_SWEEP,
        }
    }
}

impl Default for MemoryBackend<SystemClock> {
    fn default() -> Self {
        Self::new()
    }
}

/// Configures a [`MemoryBackend`].
#[derive(Debug)]
pub struct MemoryBackendBuilder<C> {
    clock: C,
    max_keys: usize,
    shards: Option<usize>,
    sweep_interval: Duration,
}

impl<C: Clock> MemoryBackendBuilder<C> {
    /// The most keys tracked at once, over all limits (default 1,048,576). Past it, new keys
    /// are refused until expired ones are reclaimed.
    pub fn max_keys(mut self, max_keys: usize) -> Self {
        self.max_keys = max_keys;
        self
    }

    /// How many shards, at least (rounded up to a power of two; default eight per core, at
    /// least 16). A backend whose cap would put more than 4,096 keys in a shard gets more
    /// shards, so that a sweep or a table's growth never holds up a check for long.
    pub fn shards(mut self, shards: usize) -> Self {
        self.shards = Some(shards);
        self
    }

    /// How often each shard drops its expired state (default one second). Also the
    /// `Retry-After` given to a key refused at capacity.
    pub fn sweep_interval(mut self, every: Duration) -> Self {
        self.sweep_interval = every;
        self
    }

    /// Reads time from `clock` instead of the system clock.
    pub fn clock<C2: Clock>(self, clock: C2) -> MemoryBackendBuilder<C2> {
        MemoryBackendBuilder {
            clock,
            max_keys: self.max_keys,
            shards: self.shards,
            sweep_interval: self.sweep_interval,
        }
    }

    /// Builds the backend.
    pub fn build(self) -> MemoryBackend<C> {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let shards = self
            .shards
            .unwrap_or((cores * 8).max(16))
            .max(self.max_keys.div_ceil(SHARD_KEYS))
            .clamp(1, MAX_SHARDS)
            .next_power_of_two();
        // Twice a full shard's mean: with random fingerprints, no shard reaches it before the
        // cap does.
        let shard_cap = self.max_keys.div_ceil(shards).max(SHARD_KEYS) * 2;
        MemoryBackend {
            inner: Arc::new(Inner {
                shards: (0..shards).map(|_| RwLock::default()).collect(),
                clock: self.clock,
                reports: Board::default(),
                key_cap: KeyCap {
                    max_keys: self.max_keys,
                    shard_cap,
                    tracked: AtomicUsize::new(0),
                },
                sweeping: Sweeping {
                    interval: micros(self.sweep_interval).max(1),
                    cursor: AtomicUsize::new(0),
                    next_round: AtomicU64::new(0),
                    most_swept: AtomicUsize::new(0),
                },
                seed: Sip13::random(),
            }),
        }
    }
}
