//! One `redis-server` process.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use crate::parse_command_stats;
use crate::process::{free_port, pings, redis_server_binary, signal, temp_dir, STARTUP};
use crate::tls::TestCerts;
/// One `redis-server` on a loopback port, killed (and its directory removed) on drop.
#[derive(Debug)]
pub struct RedisServer {
    child: Option<Child>,
    pub(crate) port: u16,
    pub(crate) dir: PathBuf,
    cluster: bool,
    paused: bool,
    role: Role,
    tls: Option<Tls>,
}

/// How a TLS server is set up.
#[derive(Debug, Clone)]
pub(crate) struct Tls {
    pub(crate) certs: TestCerts,
    /// `--tls-auth-clients yes`: a client must present a certificate the CA signed.
    pub(crate) require_client_cert: bool,
}

/// What a [`RedisServer`] process is: a server, a replica of the server on a port, or a
/// sentinel started from a copy of a config file.
#[derive(Debug, Clone)]
pub(crate) enum Role {
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

    pub(crate) fn start_with(cluster: bool, tls: Option<Tls>) -> Self {
        Self::start_as(cluster, Role::Plain, tls)
    }

    pub(crate) fn start_as(cluster: bool, role: Role, tls: Option<Tls>) -> Self {
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
    pub(crate) fn connect(&self, timeout: Duration) -> redis::RedisResult<redis::Connection> {
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
