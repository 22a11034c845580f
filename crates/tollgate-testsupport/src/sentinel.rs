//! A master, a replica and three sentinels, for failover tests.

use std::path::PathBuf;
use std::thread;
use std::time::{Duration, Instant};

use crate::process::temp_dir;
use crate::server::{Role, Tls};
use crate::RedisServer;
use crate::{server_info, TestCerts};
/// The master name that [`Sentinel`] monitors.
pub const SENTINEL_MASTER: &str = "tollgate-master";

/// How long sentinels may take to see the replica and each other.
const SENTINEL_STARTUP: Duration = Duration::from_secs(30);

/// A master, one replica and three sentinels (quorum 2) on loopback; every process is killed
/// on drop.
///
/// The sentinels declare the master down after 1 s without an answer
/// ([`Sentinel::DOWN_AFTER`]) and promote the replica.
#[derive(Debug)]
pub struct Sentinel {
    master: RedisServer,
    replica: RedisServer,
    sentinels: Vec<RedisServer>,
    dir: PathBuf,
}

impl Sentinel {
    /// How long the sentinels wait without an answer before they call the master down.
    pub const DOWN_AFTER: Duration = Duration::from_millis(1_000);

    /// Starts the master, its replica and three sentinels that monitor
    /// [`SENTINEL_MASTER`], and waits until the replica is in sync and every sentinel knows
    /// the replica and the two other sentinels.
    ///
    /// # Panics
    ///
    /// When `redis-server` is missing or the setup does not come together in 30 s.
    pub fn start() -> Self {
        Self::start_as(None)
    }

    /// As [`Sentinel::start`], over TLS only: the master, the replica and the sentinels have
    /// the server certificate of `certs`, and the replica and the sentinels reach the master
    /// over TLS (`--tls-replication yes`). Its [`sentinel_urls`](Self::sentinel_urls) are
    /// `rediss://`.
    ///
    /// # Panics
    ///
    /// As [`Sentinel::start`].
    pub fn start_tls(certs: &TestCerts) -> Self {
        Self::start_as(Some(Tls {
            certs: certs.clone(),
            require_client_cert: false,
        }))
    }

    fn start_as(tls: Option<Tls>) -> Self {
        let master = RedisServer::start_with(false, tls.clone());
        let replica = RedisServer::start_replica_of(&master);
        let dir = temp_dir("sentinel");
        let template = dir.join("sentinel.conf");
        let conf = format!(
            "sentinel monitor {SENTINEL_MASTER} 127.0.0.1 {port} 2\n\
             sentinel down-after-milliseconds {SENTINEL_MASTER} {down}\n\
             sentinel failover-timeout {SENTINEL_MASTER} 10000\n\
             sentinel parallel-syncs {SENTINEL_MASTER} 1\n",
            port = master.port(),
            down = Self::DOWN_AFTER.as_millis(),
        );
        std::fs::write(&template, conf).expect("write sentinel.conf");
        let sentinels = (0..3)
            .map(|_| RedisServer::start_as(false, Role::Sentinel(template.clone()), tls.clone()))
            .collect();
        let setup = Self {
            master,
            replica,
            sentinels,
            dir,
        };
        setup.wait_ready();
        setup
    }

    fn wait_ready(&self) {
        let started = Instant::now();
        loop {
            let synced = server_info(&self.replica, "replication", "master_link_status")
                .is_some_and(|s| s == "up");
            let known = self.sentinels.iter().all(|s| {
                let mut con = s.client();
                let replicas: redis::RedisResult<Vec<redis::Value>> = redis::cmd("SENTINEL")
                    .arg("REPLICAS")
                    .arg(SENTINEL_MASTER)
                    .query(&mut con);
                let peers: redis::RedisResult<Vec<redis::Value>> = redis::cmd("SENTINEL")
                    .arg("SENTINELS")
                    .arg(SENTINEL_MASTER)
                    .query(&mut con);
                replicas.is_ok_and(|r| r.len() == 1) && peers.is_ok_and(|p| p.len() == 2)
            });
            if synced && known {
                return;
            }
            assert!(
                started.elapsed() < SENTINEL_STARTUP,
                "the sentinels did not discover the replica and each other"
            );
            thread::sleep(Duration::from_millis(50));
        }
    }

    /// The sentinels' URLs, `redis://127.0.0.1:<port>/`.
    pub fn sentinel_urls(&self) -> Vec<String> {
        self.sentinels.iter().map(RedisServer::url).collect()
    }

    /// The server that was master at start.
    pub fn master(&self) -> &RedisServer {
        &self.master
    }

    /// The server that was master at start, to stop or pause it.
    pub fn master_mut(&mut self) -> &mut RedisServer {
        &mut self.master
    }

    /// The server that was a replica at start.
    pub fn replica(&self) -> &RedisServer {
        &self.replica
    }

    /// The port of the master as the first sentinel that answers sees it.
    ///
    /// # Panics
    ///
    /// When no sentinel answers.
    pub fn master_port(&self) -> u16 {
        for s in &self.sentinels {
            let Ok(mut con) = s.connect(Duration::from_secs(1)) else {
                continue;
            };
            let addr: redis::RedisResult<(String, String)> = redis::cmd("SENTINEL")
                .arg("GET-MASTER-ADDR-BY-NAME")
                .arg(SENTINEL_MASTER)
                .query(&mut con);
            if let Some(port) = addr.ok().and_then(|(_, p)| p.parse().ok()) {
                return port;
            }
        }
        panic!("no sentinel answered GET-MASTER-ADDR-BY-NAME");
    }
}

impl Drop for Sentinel {
    fn drop(&mut self) {
        // Sentinels first, so that none reconfigures a server that is going away.
        self.sentinels.clear();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
