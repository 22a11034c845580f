//! Connections, made lazily and in the background.
//!
//! Building the backend makes no connection, so an application boots while Redis is down and
//! applies its failure policy. The first call starts a connection attempt in a spawned task
//! (bounded by the connect timeout, not by the caller's deadline: a slow handshake still
//! completes for the next caller) and waits for it within its own deadline. A connection that
//! breaks is dropped, and the next call starts a new attempt; the circuit breaker paces them.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use redis::aio::MultiplexedConnection;
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::sentinel::SentinelClient;
use redis::{AsyncConnectionConfig, ErrorKind, RedisError, RedisResult, ServerErrorKind, Value};
use tokio::sync::Notify;

use crate::scripts::Script;
use crate::transport::direct::Login;

/// Where to connect.
pub(crate) enum Target {
    Single(Box<redis::Client>),
    /// With the nodes' credentials when its seeds are plain TCP (see `nodes`).
    Cluster(Box<ClusterClient>, Option<Login>),
    /// The master the sentinels name, looked up on each connection attempt. The client keeps
    /// its connections to the sentinels, hence the lock (held by one attempt at a time).
    Sentinel(Arc<tokio::sync::Mutex<SentinelClient>>),
}

impl Target {
    fn name(&self) -> &'static str {
        match self {
            Self::Single(_) => "standalone",
            Self::Cluster(..) => "cluster",
            Self::Sentinel(_) => "sentinel",
        }
    }
}

impl std::fmt::Debug for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A live connection; clones share it.
#[derive(Clone)]
pub(crate) enum Conn {
    Single(MultiplexedConnection),
    Cluster(ClusterConnection),
}

impl Conn {
    /// Sends `call`, an `EVALSHA` of the first of `scripts`; if the server does not know it
    /// (it restarted, or was flushed), loads all of `scripts` and sends `call` again.
    pub(crate) async fn invoke(
        &mut self,
        scripts: &[&Script],
        call: &redis::Cmd,
    ) -> RedisResult<Value> {
        match self.query(call).await {
            Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                for script in scripts {
                    self.query(&script.load()).await?;
                }
                self.query(call).await
            }
            other => other,
        }
    }

    /// Sends `cmd`; an error reply is an `Err`.
    pub(crate) async fn query(&mut self, cmd: &redis::Cmd) -> RedisResult<Value> {
        match self {
            Self::Single(c) => cmd.query_async(c).await,
            Self::Cluster(c) => cmd.query_async(c).await,
        }
    }
}

enum State {
    Idle { last_error: Option<RedisError> },
    Connecting(Arc<Notify>),
    Ready { generation: u64, conn: Conn },
}

pub(crate) struct Connector {
    target: Target,
    connect_timeout: Duration,
    state: Mutex<State>,
    generation: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for Connector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = match &*self.lock() {
            State::Idle { .. } => "idle",
            State::Connecting(_) => "connecting",
            State::Ready { .. } => "ready",
        };
        f.debug_struct("Connector")
            .field("target", &self.target.name())
            .field("state", &state)
            .finish()
    }
}

impl Connector {
    pub(crate) fn new(target: Target, connect_timeout: Duration) -> Self {
        Self {
            target,
            connect_timeout,
            state: Mutex::new(State::Idle { last_error: None }),
            generation: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// Whether the target is a Redis Cluster.
    pub(crate) fn is_cluster(&self) -> bool {
        matches!(self.target, Target::Cluster(..))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A connection and its generation, connecting first if there is none.
    ///
    /// The caller bounds the wait with its deadline; the attempt itself goes on without it.
    pub(crate) async fn get(self: &Arc<Self>) -> RedisResult<(u64, Conn)> {
        let mut started = false;
        loop {
            let notified = {
                let mut state = self.lock();
                match &*state {
                    State::Ready { generation, conn } => return Ok((*generation, conn.clone())),
                    State::Idle { last_error } if started => {
                        return Err(last_error.clone().unwrap_or_else(|| {
                            RedisError::from((redis::ErrorKind::Io, "could not connect to Redis"))
                        }))
                    }
                    State::Idle { .. } => {
                        let notify = Arc::new(Notify::new());
                        *state = State::Connecting(Arc::clone(&notify));
                        started = true;
                        let attempt = Attempt {
                            connector: Arc::clone(self),
                            notify: Arc::clone(&notify),
                        };
                        // The attempt wakes the waiters when it is dropped: done or not.
                        tokio::spawn(async move { attempt.connector.connect().await });
                        notify
                    }
                    State::Connecting(notify) => {
                        started = true;
                        Arc::clone(notify)
                    }
                }
            };
            let wait = notified.notified();
            // The attempt may have ended between the unlock and `notified()`.
            if !matches!(&*self.lock(), State::Connecting(n) if Arc::ptr_eq(n, &notified)) {
                continue;
            }
            wait.await;
        }
    }

    /// A standalone connection's settings: the connect timeout, and no response timeout
    /// (each call has its own deadline).
    fn config(&self) -> AsyncConnectionConfig {
        AsyncConnectionConfig::new()
            .set_connection_timeout(Some(self.connect_timeout))
            .set_response_timeout(None)
    }

    async fn connect(&self) {
        let attempt = async {
            match &self.target {
                Target::Single(client) => client
                    .get_multiplexed_async_connection_with_config(&self.config())
                    .await
                    .map(Conn::Single),
                Target::Cluster(client, _) => {
                    client.get_async_connection().await.map(Conn::Cluster)
                }
                Target::Sentinel(sentinel) => {
                    // Asks the sentinels for the master's address (they check that it says it
                    // is one), then connects to it like a standalone server.
                    let client = sentinel.lock().await.async_get_client().await?;
                    client
                        .get_multiplexed_async_connection_with_config(&self.config())
                        .await
                        .map(Conn::Single)
                }
            }
        };
        let result = match tokio::time::timeout(self.connect_timeout, attempt).await {
            Ok(r) => r,
            Err(_) => Err(RedisError::from((
                redis::ErrorKind::Io,
                "timed out connecting to Redis",
            ))),
        };
        {
            let mut state = self.lock();
            *state = match result {
                Ok(conn) => {
                    let generation = self
                        .generation
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
                        + 1;
                    tracing::debug!(backend = "redis", "connected");
                    State::Ready { generation, conn }
                }
                Err(e) => {
                    tracing::debug!(backend = "redis", error = %e, "connection attempt failed");
                    State::Idle {
                        last_error: Some(e),
                    }
                }
            };
        }
    }

    /// Drops the current connection, whichever it is: the next call makes a new one.
    pub(crate) fn replace(&self) {
        let mut state = self.lock();
        if matches!(&*state, State::Ready { .. }) {
            *state = State::Idle { last_error: None };
        }
    }

    /// Drops the connection of `generation` after an error that broke it.
    pub(crate) fn invalidate(&self, generation: u64) {
        let mut state = self.lock();
        if matches!(&*state, State::Ready { generation: g, .. } if *g == generation) {
            *state = State::Idle { last_error: None };
        }
    }
}

/// A connection attempt's task. Dropped, it wakes the calls waiting for the attempt; dropped
/// before the attempt ended (its runtime shut down), it first puts the state back to idle, so
/// that the next call starts a new attempt instead of waiting for this one forever.
struct Attempt {
    connector: Arc<Connector>,
    notify: Arc<Notify>,
}

impl Drop for Attempt {
    fn drop(&mut self) {
        {
            let mut state = self.connector.lock();
            if matches!(&*state, State::Connecting(n) if Arc::ptr_eq(n, &self.notify)) {
                *state = State::Idle { last_error: None };
            }
        }
        self.notify.notify_waiters();
    }
}
