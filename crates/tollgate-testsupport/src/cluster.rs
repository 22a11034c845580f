//! A Redis Cluster of masters only.

use std::process::{Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use crate::process::CLUSTER_STARTUP;
use crate::server::Tls;
use crate::RedisServer;
use crate::TestCerts;
/// A Redis Cluster of masters only, on loopback; every node is killed on drop.
#[derive(Debug)]
pub struct RedisCluster {
    nodes: Vec<RedisServer>,
}

impl RedisCluster {
    /// Starts `masters` cluster-enabled servers (at least 3), joins them with
    /// `redis-cli --cluster create ... --cluster-replicas 0`, and waits until every node reports
    /// `cluster_state:ok`.
    ///
    /// # Panics
    ///
    /// When fewer than 3 masters are asked for, `redis-server` or `redis-cli` is missing, or the
    /// cluster does not form.
    pub fn start(masters: usize) -> Self {
        Self::start_as(masters, None)
    }

    /// As [`RedisCluster::start`], over TLS only: every node has the server certificate of
    /// `certs`, and talks to the others over TLS too (`--tls-cluster yes`), so that the
    /// cluster announces its nodes' TLS ports. Its [`urls`](Self::urls) are `rediss://`.
    ///
    /// # Panics
    ///
    /// As [`RedisCluster::start`].
    pub fn start_tls(masters: usize, certs: &TestCerts) -> Self {
        Self::start_as(
            masters,
            Some(Tls {
                certs: certs.clone(),
                require_client_cert: false,
            }),
        )
    }

    fn start_as(masters: usize, tls: Option<Tls>) -> Self {
        assert!(masters >= 3, "a Redis Cluster needs at least 3 masters");
        let nodes: Vec<RedisServer> = (0..masters)
            .map(|_| RedisServer::start_with(true, tls.clone()))
            .collect();
        let mut create = Command::new("redis-cli");
        if let Some(tls) = &tls {
            let files = tls
                .certs
                .write_to(&nodes[0].dir)
                .expect("write the TLS files for redis-cli");
            create
                .arg("--tls")
                .arg("--cacert")
                .arg(&files.ca)
                .arg("--cert")
                .arg(&files.client_cert)
                .arg("--key")
                .arg(&files.client_key);
        }
        create.arg("--cluster").arg("create");
        for node in &nodes {
            create.arg(format!("127.0.0.1:{}", node.port));
        }
        let out = create
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|e| {
                panic!("run redis-cli (install Debian's `redis-server` / `redis-tools`): {e}")
            });
        assert!(
            out.status.success(),
            "redis-cli --cluster create failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let cluster = Self { nodes };
        cluster.wait_ok();
        cluster
    }

    fn wait_ok(&self) {
        let started = Instant::now();
        loop {
            let all_ok = self.nodes.iter().all(|node| {
                let info: redis::RedisResult<String> =
                    redis::cmd("CLUSTER").arg("INFO").query(&mut node.client());
                info.is_ok_and(|i| i.contains("cluster_state:ok"))
            });
            // Every node must also see the same slot owners before clients ask it.
            if all_ok && self.slot_maps_agree() {
                return;
            }
            assert!(
                started.elapsed() < CLUSTER_STARTUP,
                "the Redis Cluster did not reach cluster_state:ok"
            );
            thread::sleep(Duration::from_millis(50));
        }
    }

    fn slot_maps_agree(&self) -> bool {
        let views: Vec<Vec<(u16, u16, u16)>> = self
            .nodes
            .iter()
            .map(|n| {
                let mut ranges = slot_ranges(&cluster_nodes(n));
                ranges.sort_unstable();
                ranges
            })
            .collect();
        let covered: u32 = views[0]
            .iter()
            .map(|&(lo, hi, _)| u32::from(hi - lo) + 1)
            .sum();
        covered == 16_384 && views.iter().all(|v| *v == views[0])
    }

    /// The nodes, in the order they were started.
    pub fn nodes(&self) -> &[RedisServer] {
        &self.nodes
    }

    /// The nodes' URLs, to seed a cluster client.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }

    /// The hash slot of `key`, as the cluster computes it (`CLUSTER KEYSLOT`).
    ///
    /// # Panics
    ///
    /// When the cluster cannot be reached.
    pub fn slot_of_key(&self, key: &str) -> u16 {
        redis::cmd("CLUSTER")
            .arg("KEYSLOT")
            .arg(key)
            .query(&mut self.nodes[0].client())
            .expect("CLUSTER KEYSLOT")
    }

    /// The index in [`RedisCluster::nodes`] of the node that serves `key`.
    ///
    /// # Panics
    ///
    /// When the cluster cannot be reached or no node serves the key's slot.
    pub fn node_of_key(&self, key: &str) -> usize {
        let slot = self.slot_of_key(key);
        let owner = slot_ranges(&cluster_nodes(&self.nodes[0]))
            .into_iter()
            .find(|&(lo, hi, _)| (lo..=hi).contains(&slot))
            .map(|(_, _, port)| port)
            .expect("a node serves every slot");
        self.nodes
            .iter()
            .position(|n| n.port == owner)
            .expect("the slot's owner is one of our nodes")
    }

    /// The number of keys over every node.
    pub fn dbsize(&self) -> u64 {
        self.nodes.iter().map(RedisServer::dbsize).sum()
    }
}

pub(crate) fn cluster_nodes(node: &RedisServer) -> String {
    redis::cmd("CLUSTER")
        .arg("NODES")
        .query(&mut node.client())
        .expect("CLUSTER NODES")
}

/// `(first slot, last slot, port of the owner)` from `CLUSTER NODES`.
pub(crate) fn slot_ranges(nodes: &str) -> Vec<(u16, u16, u16)> {
    let mut out = Vec::new();
    for line in nodes.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        if fields.len() < 9 || !fields[2].contains("master") {
            continue;
        }
        // `127.0.0.1:7000@17000` (and a hostname after a comma in some versions).
        let Some(port) = fields[1]
            .split(['@', ','])
            .next()
            .and_then(|a| a.rsplit(':').next())
            .and_then(|p| p.parse().ok())
        else {
            continue;
        };
        for range in &fields[8..] {
            if range.starts_with('[') {
                continue; // a slot being migrated
            }
            let (lo, hi) = range.split_once('-').unwrap_or((range, range));
            if let (Ok(lo), Ok(hi)) = (lo.parse(), hi.parse()) {
                out.push((lo, hi, port));
            }
        }
    }
    out
}
