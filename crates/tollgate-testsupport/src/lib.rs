//! Test support: real `redis-server` processes and Redis Clusters on loopback, never mocks.
//!
//! [`RedisServer::start`] runs one server on a free loopback port in its own temporary
//! directory, with persistence off; [`RedisCluster::start`] runs several and joins them into a
//! cluster with `redis-cli --cluster create`. Both are killed and their directories removed on
//! drop. Every start picks its own ports and directory, so tests may run in parallel threads.
//!
//! A server can be stopped and started again on the same port ([`RedisServer::stop`],
//! [`RedisServer::start_again`]) to simulate an outage, or paused with `SIGSTOP`
//! ([`RedisServer::pause`]) to simulate a server that accepts connections and never answers.
//!
//! The helpers panic with a clear message when something is wrong with the machine (no
//! `redis-server` on `PATH`, a server that never answers): they are for tests only.
//!
//! [`Sentinel`] runs a master, a replica and three `redis-server --sentinel` processes that
//! watch them, to test failover.
//!
//! [`RedisServer::start_tls`], [`RedisCluster::start_tls`] and [`Sentinel::start_tls`] run the
//! same over TLS only (`--port 0 --tls-port <port>`), with certificates that [`TestCerts`]
//! makes at run time: a CA, and a certificate for `127.0.0.1` that the servers present.
//!
//! [`vectors`] reads the shared vector file `tests/vectors.txt` that every backend must agree
//! with.
//!
//! # Examples
//!
//! ```no_run
//! use tollgate_testsupport::RedisServer;
//!
//! let server = RedisServer::start();
//! let mut con = server.client();
//! let pong: String = redis::cmd("PING").query(&mut con).unwrap();
//! assert_eq!(pong, "PONG");
//! assert!(server.command_stats().contains_key("ping"));
//! ```

use std::collections::HashMap;
use std::time::Duration;

pub use redis;

mod cluster;
pub mod leases;
mod process;
mod sentinel;
mod server;
mod tls;
pub mod vectors;

pub use cluster::RedisCluster;
pub use sentinel::{Sentinel, SENTINEL_MASTER};
pub use server::RedisServer;
pub use tls::TestCerts;

/// Calls per command, keyed by lowercase command name, from the text of `INFO commandstats`:
/// lines such as `cmdstat_evalsha:calls=3,usec=...`.
pub fn parse_command_stats(info: &str) -> HashMap<String, u64> {
    info.lines()
        .filter_map(|line| {
            let (name, fields) = line.trim().strip_prefix("cmdstat_")?.split_once(':')?;
            let calls = fields
                .split(',')
                .find_map(|f| f.strip_prefix("calls="))?
                .parse()
                .ok()?;
            Some((name.to_ascii_lowercase(), calls))
        })
        .collect()
}

/// What the server says of itself in `INFO <section>`: the value of `field`, or `None`
/// when the server cannot be reached or has no such field.
pub fn server_info(server: &RedisServer, section: &str, field: &str) -> Option<String> {
    let mut con = server.connect(Duration::from_secs(1)).ok()?;
    let info: String = redis::cmd("INFO").arg(section).query(&mut con).ok()?;
    info.lines().find_map(|l| {
        l.trim()
            .strip_prefix(field)
            .and_then(|r| r.strip_prefix(':'))
            .map(str::to_owned)
    })
}

/// Waits until `count()` is `want`, for at most 5 s (500 looks 10 ms apart), and returns the last
/// count: for state that the code under test changes in the background (a release sent from a
/// spawned task). A test asserts the returned figure, so a regression fails instead of hanging.
pub async fn until(want: u64, mut count: impl FnMut() -> u64) -> u64 {
    let mut seen = count();
    for _ in 0..500 {
        if seen == want {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        seen = count();
    }
    seen
}

#[cfg(test)]
mod tests {
    use std::thread;
    use std::time::Instant;

    use super::*;
    use crate::cluster::slot_ranges;
    use crate::process::pings;

    #[test]
    fn parses_command_stats() {
        let info = "# Commandstats\r\ncmdstat_evalsha:calls=3,usec=10,usec_per_call=3.3\r\n\
                    cmdstat_ping:calls=1,usec=0\r\n";
        let stats = parse_command_stats(info);
        assert_eq!(stats["evalsha"], 3);
        assert_eq!(stats["ping"], 1);
    }

    #[test]
    fn parses_slot_ranges() {
        let nodes = "a 127.0.0.1:7000@17000 myself,master - 0 0 1 connected 0-5460\n\
                     b 127.0.0.1:7001@17001 master - 0 0 2 connected 5461-10922 12000\n\
                     c 127.0.0.1:7002@17002 slave b 0 0 2 connected\n";
        assert_eq!(
            slot_ranges(nodes),
            vec![(0, 5460, 7000), (5461, 10922, 7001), (12000, 12000, 7001)]
        );
    }

    #[test]
    fn a_server_starts_stops_and_starts_again() {
        let mut server = RedisServer::start();
        let port = server.port();
        let _: () = redis::cmd("SET")
            .arg("k")
            .arg("v")
            .query(&mut server.client())
            .unwrap();
        assert_eq!(server.dbsize(), 1);
        assert!(server.calls("set") >= 1);
        server.stop();
        assert!(!pings(port, Duration::from_millis(200)));
        server.start_again();
        assert_eq!(server.port(), port);
        assert_eq!(server.dbsize(), 0);
        server.pause();
        assert!(!pings(port, Duration::from_millis(200)));
        server.resume();
        assert!(pings(port, Duration::from_secs(5)));
    }

    #[test]
    fn parallel_servers_get_their_own_ports() {
        let servers: Vec<RedisServer> = thread::scope(|s| {
            let handles: Vec<_> = (0..4).map(|_| s.spawn(RedisServer::start)).collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let mut ports: Vec<u16> = servers.iter().map(RedisServer::port).collect();
        ports.sort_unstable();
        ports.dedup();
        assert_eq!(ports.len(), 4);
    }

    #[test]
    fn a_cluster_forms_and_spreads_keys() {
        let cluster = RedisCluster::start(3);
        assert_eq!(cluster.urls().len(), 3);
        let owners: std::collections::HashSet<usize> = (0..30)
            .map(|i| cluster.node_of_key(&format!("key-{i}")))
            .collect();
        assert_eq!(owners.len(), 3);
        // The owner really holds the key.
        let key = "{spread}:x";
        let owner = &cluster.nodes()[cluster.node_of_key(key)];
        let _: () = redis::cmd("SET")
            .arg(key)
            .arg(1)
            .query(&mut owner.client())
            .unwrap();
        assert_eq!(cluster.dbsize(), 1);
    }

    #[test]
    fn sentinels_promote_the_replica_when_the_master_dies() {
        let mut setup = Sentinel::start();
        assert_eq!(setup.master_port(), setup.master().port());
        let replica = setup.replica().port();
        setup.master_mut().stop();
        let started = Instant::now();
        while setup.master_port() != replica {
            assert!(started.elapsed() < Duration::from_secs(60), "no failover");
            thread::sleep(Duration::from_millis(50));
        }
        assert_eq!(
            server_info(setup.replica(), "replication", "role").as_deref(),
            Some("master")
        );
    }
}
