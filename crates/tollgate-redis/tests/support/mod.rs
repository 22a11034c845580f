//! Helpers shared by the Redis backend's integration tests.
#![allow(dead_code, unreachable_pub, clippy::unwrap_used)]

use std::time::Duration;

use tollgate_engine::{Backend, Check, Limit, Quota, Verdicts};
use tollgate_redis::{RedisBackend, RedisBackendBuilder};

/// A deadline generous enough for a loaded CI machine: these tests count, they do not time.
pub const DEADLINE: Duration = Duration::from_secs(5);

pub fn standalone(url: &str) -> RedisBackendBuilder {
    RedisBackend::builder().url(url).deadline(DEADLINE)
}

pub fn cluster(urls: Vec<String>) -> RedisBackendBuilder {
    RedisBackend::builder().cluster(urls).deadline(DEADLINE)
}

pub fn gcra(name: &str, per_minute: u32) -> Limit {
    Limit::gcra(name, Quota::per_minute(per_minute).unwrap()).unwrap()
}

pub fn fixed(name: &str, quota: Quota) -> Limit {
    Limit::fixed_window(name, quota).unwrap()
}

pub fn sliding(name: &str, quota: Quota) -> Limit {
    Limit::sliding_log(name, quota).unwrap()
}

/// Checks `limits` for `key` and says whether the batch was admitted.
pub async fn admitted(backend: &RedisBackend, limits: &[&Limit], key: &[u8]) -> bool {
    let v = check(backend, limits, key).await;
    v.iter().all(|v| v.is_allowed())
}

pub async fn check(backend: &RedisBackend, limits: &[&Limit], key: &[u8]) -> Verdicts {
    let checks: Vec<Check<'_>> = limits.iter().map(|l| Check::new(l, key)).collect();
    backend.check(&checks).await.unwrap()
}

pub async fn check_at(backend: &RedisBackend, limits: &[&Limit], key: &[u8], now: u64) -> Verdicts {
    let checks: Vec<Check<'_>> = limits.iter().map(|l| Check::new(l, key)).collect();
    backend.check_at(&checks, now).await.unwrap()
}

/// Runs `n` checks of `limit` at once, alternating between `backends`; returns how many were
/// admitted.
pub async fn concurrent_admissions(backends: &[RedisBackend], limit: &Limit, n: usize) -> usize {
    let tasks: Vec<_> = (0..n)
        .map(|i| {
            let backend = backends[i % backends.len()].clone();
            let limit = limit.clone();
            tokio::spawn(async move { admitted(&backend, &[&limit], b"shared-key").await })
        })
        .collect();
    let mut count = 0;
    for t in tasks {
        if t.await.unwrap() {
            count += 1;
        }
    }
    count
}

/// A TCP relay to a Redis server that can go silent on the connections it has relayed so far:
/// their bytes are swallowed, with no error and no close, as when a NAT entry is forgotten or
/// a failover moves the address. Connections made afterwards are relayed.
pub struct SilentRelay {
    port: u16,
    accepted: std::sync::Arc<std::sync::atomic::AtomicU64>,
    silenced: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl SilentRelay {
    pub fn start(upstream: u16) -> Self {
        use std::io::{Read, Write};
        use std::net::{TcpListener, TcpStream};
        use std::sync::atomic::{AtomicU64, Ordering};
        use std::sync::Arc;

        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let accepted = Arc::new(AtomicU64::new(0));
        let silenced = Arc::new(AtomicU64::new(0));
        let (count, below) = (Arc::clone(&accepted), Arc::clone(&silenced));
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { return };
                let id = count.fetch_add(1, Ordering::SeqCst);
                let Ok(server) = TcpStream::connect(("127.0.0.1", upstream)) else {
                    continue;
                };
                let directions = [
                    (client.try_clone().unwrap(), server.try_clone().unwrap()),
                    (server, client),
                ];
                for (mut from, mut to) in directions {
                    let below = Arc::clone(&below);
                    std::thread::spawn(move || {
                        let mut buf = [0u8; 16 * 1024];
                        while let Ok(n @ 1..) = from.read(&mut buf) {
                            if id < below.load(Ordering::SeqCst) {
                                continue;
                            }
                            if to.write_all(&buf[..n]).is_err() {
                                return;
                            }
                        }
                    });
                }
            }
        });
        Self {
            port,
            accepted,
            silenced,
        }
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// Connections accepted so far.
    pub fn accepted(&self) -> u64 {
        self.accepted.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Every connection relayed so far goes silent.
    pub fn silence_existing(&self) {
        use std::sync::atomic::Ordering;
        let n = self.accepted.load(Ordering::SeqCst);
        self.silenced.store(n, Ordering::SeqCst);
    }
}
