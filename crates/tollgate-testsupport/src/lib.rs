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
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, OnceLock};
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

pub use redis;

pub mod lease_model;
mod tls;
pub mod vectors;

pub use tls::TestCerts;

/// How long a server may take to answer its first `PING`.
const STARTUP: Duration = Duration::from_secs(10);
/// How long a cluster may take to agree that it is whole.
const CLUSTER_STARTUP: Duration = Duration::from_secs(30);
/// Ports are chosen below the kernel's ephemeral range (32768 and up on Linux), so that an
/// outgoing connection never holds a port we are about to hand to a server; a cluster node also
/// needs `port + 10_000` for its bus, which stays below 32768 too.
const PORT_LOW: u32 = 12_000;
const PORT_SPAN: u32 = 10_000;
const CLUSTER_BUS_OFFSET: u16 = 10_000;

static NEXT: AtomicU32 = AtomicU32::new(0);
/// Ports handed out in this process: a port that was free when checked stays free only until
/// its server binds it, so a thread must never pick one another thread is about to use. Base
/// ports (12000..22000) and bus ports (22000..32000) cannot overlap.
static TAKEN: Mutex<Vec<u16>> = Mutex::new(Vec::new());

fn redis_server_binary() -> &'static str {
    static CHECKED: OnceLock<()> = OnceLock::new();
    CHECKED.get_or_init(|| {
        let found = Command::new("redis-server")
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        assert!(
            found,
            "redis-server is not on PATH: tollgate's Redis tests start real servers. \
             Install Debian's `redis-server` package (`apt-get install redis-server`; CI installs it)."
        );
    });
    "redis-server"
}

/// A number that differs between processes and between calls, to spread port and directory
/// choices of tests running at the same time.
fn unique() -> u32 {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    std::process::id()
        .wrapping_mul(7_919)
        .wrapping_add(nanos / 1_000)
        .wrapping_add(n.wrapping_mul(104_729))
}

fn port_is_free(port: u16) -> bool {
    TcpListener::bind(SocketAddr::from((Ipv4Addr::LOCALHOST, port))).is_ok()
}

/// A loopback port that is free now (and `port + 10_000` too when `with_bus`).
fn free_port(with_bus: bool) -> u16 {
    let mut taken = TAKEN.lock().unwrap_or_else(|e| e.into_inner());
    for _ in 0..1_000 {
        let port = (PORT_LOW + unique() % PORT_SPAN) as u16;
        if !taken.contains(&port)
            && port_is_free(port)
            && (!with_bus || port_is_free(port + CLUSTER_BUS_OFFSET))
        {
            taken.push(port);
            return port;
        }
    }
    panic!("no free loopback port found for redis-server");
}

fn temp_dir(label: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "tollgate-{label}-{}-{}",
        std::process::id(),
        unique()
    ));
    std::fs::create_dir_all(&dir).expect("create a temporary directory for redis-server");
    dir
}

/// Sends `PING` over a raw socket and waits for `+PONG`.
fn pings(port: u16, timeout: Duration) -> bool {
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let Ok(mut stream) = TcpStream::connect_timeout(&addr, timeout) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(timeout));
    let _ = stream.set_write_timeout(Some(timeout));
    if stream.write_all(b"PING\r\n").is_err() {
        return false;
    }
    let mut buf = [0u8; 7];
    stream.read_exact(&mut buf).is_ok() && &buf == b"+PONG\r\n"
}

fn signal(pid: u32, sig: &str) {
    let ok = Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "kill -{sig} {pid} failed");
}

/// One `redis-server` on a loopback port, killed (and its directory removed) on drop.
#[derive(Debug)]
pub struct RedisServer {
    child: Option<Child>,
    port: u16,
    dir: PathBuf,
    cluster: bool,
    paused: bool,
    role: Role,
    tls: Option<Tls>,
}

/// How a TLS server is set up.
#[derive(Debug, Clone)]
struct Tls {
    certs: TestCerts,
    /// `--tls-auth-clients yes`: a client must present a certificate the CA signed.
    require_client_cert: bool,
}

/// What a [`RedisServer`] process is: a server, a replica of the server on a port, or a
/// sentinel started from a copy of a config file.
#[derive(Debug, Clone)]
enum Role {
    Plain,
    Replica(u16),
    Sentinel(PathBuf),
}

impl RedisServer {
    /// Starts a standalone server on a free loopback port and waits until it answers `PING`.
    ///
    /// # Panics
    ///
    /// When `redis-server` is not installed, or no server could be started.
    pub fn start() -> Self {
        Self::start_with(false, None)
    }

    /// Starts a replica of `master` on a free loopback port and waits until it answers
    /// `PING` (not until it is in sync).
    ///
    /// # Panics
    ///
    /// As [`RedisServer::start`].
    pub fn start_replica_of(master: &RedisServer) -> Self {
        Self::start_as(false, Role::Replica(master.port()), master.tls.clone())
    }

    /// Starts a standalone server that speaks only TLS (`--port 0 --tls-port <port>`), with
    /// the server certificate of `certs` (for `127.0.0.1`), and clients' certificates not
    /// asked for (`--tls-auth-clients no`). Its [`url`](Self::url) is `rediss://`.
    ///
    /// # Panics
    ///
    /// As [`RedisServer::start`].
    pub fn start_tls(certs: &TestCerts) -> Self {
        Self::start_as(
            false,
            Role::Plain,
            Some(Tls {
                certs: certs.clone(),
                require_client_cert: false,
            }),
        )
    }

    /// As [`RedisServer::start_tls`], but every client must present a certificate that the
    /// CA of `certs` signed (`--tls-auth-clients yes`).
    ///
    /// # Panics
    ///
    /// As [`RedisServer::start`].
    pub fn start_tls_requiring_client_cert(certs: &TestCerts) -> Self {
        Self::start_as(
            false,
            Role::Plain,
            Some(Tls {
                certs: certs.clone(),
                require_client_cert: true,
            }),
        )
    }

    fn start_with(cluster: bool, tls: Option<Tls>) -> Self {
        Self::start_as(cluster, Role::Plain, tls)
    }

    fn start_as(cluster: bool, role: Role, tls: Option<Tls>) -> Self {
        redis_server_binary();
        let mut last = String::new();
        // Another process may take the port between our check and the server's bind: retry.
        for _ in 0..5 {
            let port = free_port(cluster);
            let mut server = Self {
                child: None,
                port,
                dir: temp_dir(if cluster { "cluster-node" } else { "redis" }),
                cluster,
                paused: false,
                role: role.clone(),
                tls: tls.clone(),
            };
            match server.spawn() {
                Ok(()) => return server,
                Err(e) => last = e,
            }
        }
        panic!("could not start redis-server: {last}");
    }

    fn spawn(&mut self) -> Result<(), String> {
        let mut cmd = Command::new(redis_server_binary());
        if let Role::Sentinel(template) = &self.role {
            // Sentinel rewrites its config file: each start gets a fresh copy in its directory.
            let conf = self.dir.join("sentinel.conf");
            std::fs::copy(template, &conf).map_err(|e| format!("copy sentinel.conf: {e}"))?;
            cmd.arg(&conf).arg("--sentinel");
        } else {
            cmd.args(["--save", ""]).args(["--appendonly", "no"]);
        }
        match &self.tls {
            None => {
                cmd.arg("--port").arg(self.port.to_string());
            }
            Some(tls) => {
                let files = tls
                    .certs
                    .write_to(&self.dir)
                    .map_err(|e| format!("write the TLS files: {e}"))?;
                cmd.args(["--port", "0"])
                    .arg("--tls-port")
                    .arg(self.port.to_string())
                    .arg("--tls-cert-file")
                    .arg(&files.server_cert)
                    .arg("--tls-key-file")
                    .arg(&files.server_key)
                    .arg("--tls-ca-cert-file")
                    .arg(&files.ca)
                    .args([
                        "--tls-auth-clients",
                        if tls.require_client_cert { "yes" } else { "no" },
                    ])
                    // Replicas and sentinels reach their masters over TLS, cluster nodes each
                    // other: there is no plain port.
                    .args(["--tls-replication", "yes"]);
                if self.cluster {
                    cmd.args(["--tls-cluster", "yes"]);
                }
            }
        }
        cmd.args(["--bind", "127.0.0.1"])
            .args(["--protected-mode", "no"])
            .args(["--daemonize", "no"])
            .arg("--dir")
            .arg(&self.dir)
            .arg("--logfile")
            .arg(self.dir.join("redis.log"));
        if self.cluster {
            cmd.args(["--cluster-enabled", "yes"])
                .args(["--cluster-config-file", "nodes.conf"])
                .args(["--cluster-node-timeout", "5000"]);
        }
        if let Role::Replica(master) = self.role {
            cmd.args(["--replicaof", "127.0.0.1"])
                .arg(master.to_string());
        }
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("spawn redis-server: {e}"))?;
        let started = Instant::now();
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                let log = std::fs::read_to_string(self.dir.join("redis.log")).unwrap_or_default();
                return Err(format!(
                    "redis-server on port {} exited with {status}: {}",
                    self.port,
                    log.lines().rev().take(3).collect::<Vec<_>>().join(" | ")
                ));
            }
            if self.answers(Duration::from_millis(500)) {
                self.child = Some(child);
                return Ok(());
            }
            if started.elapsed() > STARTUP {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!(
                    "redis-server on port {} did not answer PING",
                    self.port
                ));
            }
            thread::sleep(Duration::from_millis(10));
        }
    }

    /// The server's URL, `redis://127.0.0.1:<port>/` (`rediss://` for a TLS server).
    pub fn url(&self) -> String {
        let scheme = if self.tls.is_some() {
            "rediss"
        } else {
            "redis"
        };
        format!("{scheme}://127.0.0.1:{}/", self.port)
    }

    /// The certificates of a TLS server.
    pub fn certs(&self) -> Option<&TestCerts> {
        self.tls.as_ref().map(|t| &t.certs)
    }

    /// Whether the server answers `PING` within `timeout`.
    fn answers(&self, timeout: Duration) -> bool {
        match &self.tls {
            None => pings(self.port, timeout),
            Some(_) => self.connect(timeout).is_ok_and(|mut con| {
                redis::cmd("PING")
                    .query::<String>(&mut con)
                    .is_ok_and(|p| p == "PONG")
            }),
        }
    }

    /// A connection, with the CA and the client certificate of a TLS server.
    fn connect(&self, timeout: Duration) -> redis::RedisResult<redis::Connection> {
        let client = match &self.tls {
            None => redis::Client::open(self.url())?,
            Some(tls) => tls.certs.client(&self.url())?,
        };
        let con = client.get_connection_with_timeout(timeout)?;
        con.set_read_timeout(Some(timeout.max(Duration::from_secs(5))))?;
        Ok(con)
    }

    /// The server's port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The server's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The server's process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Kills the server (`SIGKILL`), as an outage would. The port and directory are kept for
    /// [`RedisServer::start_again`].
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        self.paused = false;
    }

    /// Starts the server again on the same port, after [`RedisServer::stop`], and waits until it
    /// answers. Its data is gone (persistence is off).
    ///
    /// # Panics
    ///
    /// When the server cannot be started on its port again.
    pub fn start_again(&mut self) {
        self.stop();
        let deadline = Instant::now() + STARTUP;
        loop {
            match self.spawn() {
                Ok(()) => return,
                Err(e) if Instant::now() > deadline => panic!("restart redis-server: {e}"),
                Err(_) => thread::sleep(Duration::from_millis(50)),
            }
        }
    }

    /// Freezes the server (`SIGSTOP`): it keeps its connections and never answers.
    ///
    /// # Panics
    ///
    /// When the server is not running or the signal cannot be sent.
    pub fn pause(&mut self) {
        let pid = self.pid().expect("pause a server that is not running");
        signal(pid, "STOP");
        self.paused = true;
    }

    /// Lets a paused server run again (`SIGCONT`).
    ///
    /// # Panics
    ///
    /// When the server is not running or the signal cannot be sent.
    pub fn resume(&mut self) {
        let pid = self.pid().expect("resume a server that is not running");
        signal(pid, "CONT");
        self.paused = false;
    }

    /// A plain (synchronous) connection to the server.
    ///
    /// # Panics
    ///
    /// When the server cannot be reached.
    pub fn client(&self) -> redis::Connection {
        self.connect(Duration::from_secs(5))
            .unwrap_or_else(|e| panic!("connect to {}: {e}", self.url()))
    }

    /// Calls per command from `INFO commandstats`, keyed by lowercase command name
    /// (`evalsha`, `get`, ...). Commands run inside scripts are counted too.
    ///
    /// # Panics
    ///
    /// When the server cannot be reached.
    pub fn command_stats(&self) -> HashMap<String, u64> {
        let info: String = redis::cmd("INFO")
            .arg("commandstats")
            .query(&mut self.client())
            .expect("INFO commandstats");
        parse_command_stats(&info)
    }

    /// Calls of one command (lowercase, such as `evalsha`) since start or the last
    /// [`RedisServer::reset_stats`].
    pub fn calls(&self, command: &str) -> u64 {
        self.command_stats().get(command).copied().unwrap_or(0)
    }

    /// Zeroes the server's statistics (`CONFIG RESETSTAT`).
    ///
    /// # Panics
    ///
    /// When the server cannot be reached.
    pub fn reset_stats(&self) {
        let _: () = redis::cmd("CONFIG")
            .arg("RESETSTAT")
            .query(&mut self.client())
            .expect("CONFIG RESETSTAT");
    }

    /// How many keys the server holds (`DBSIZE`).
    ///
    /// # Panics
    ///
    /// When the server cannot be reached.
    pub fn dbsize(&self) -> u64 {
        redis::cmd("DBSIZE")
            .query(&mut self.client())
            .expect("DBSIZE")
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

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

fn cluster_nodes(node: &RedisServer) -> String {
    redis::cmd("CLUSTER")
        .arg("NODES")
        .query(&mut node.client())
        .expect("CLUSTER NODES")
}

/// `(first slot, last slot, port of the owner)` from `CLUSTER NODES`.
fn slot_ranges(nodes: &str) -> Vec<(u16, u16, u16)> {
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
    use super::*;

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
