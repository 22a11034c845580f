//! The transport: sends a script call by a deadline, and answers with Redis' reply or a
//! [`BackendError`].
//!
//! It owns the connections (the shared one in [`conn`], the `CHECK` calls' own in [`direct`]),
//! the circuit breaker ([`breaker`]), the queues that merge concurrent requests' `CHECK`s
//! ([`coalesce`], sent by [`merged`]), the estimate of the server's clock ([`clock`]), and the
//! health gauge and duration histogram. What a call means (a check, a settle, a refund) is
//! the business of the layers above; what it sends and reads is the scripts' codecs'.

mod answer;
pub(crate) mod breaker;
mod check_error;
pub(crate) mod clock;
pub(crate) mod coalesce;
pub(crate) mod conn;
pub(crate) mod direct;
pub(crate) mod merged;
pub(crate) mod nodes;

use std::future::Future;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use redis::{ErrorKind, ServerErrorKind};
use tokio::time::Instant;
use tollgate_engine::{BackendError, BackendErrorKind, Micros};

use crate::failure::{breaks_connection, map_error};
use crate::keys::{self, Suffix};
use crate::scripts::args::Args;
use crate::scripts::check::{CheckArgs, EncodedCheck, Form};
use crate::scripts::lean;
use crate::scripts::reply::{self, Reply};
use crate::scripts::Script;
use breaker::{Breaker, BreakerConfig, CircuitState, Permit};
pub(crate) use check_error::CheckError;
use clock::ServerClock;
use coalesce::Coalescers;
use conn::{Connector, Target};
use direct::Direct;
use nodes::{Nodes, Route};

/// The backend's name in metrics and logs.
pub(crate) const BACKEND: &str = "redis";

/// The error code of a call whose fixed windows were declared for another time.
pub(crate) const WINDOW_ERROR: &str = "TOLLGATE_WINDOW";

/// What a transport is made of.
pub(crate) struct TransportConfig {
    pub(crate) prefix: String,
    pub(crate) deadline: Duration,
    pub(crate) target: Target,
    pub(crate) connect_timeout: Duration,
    pub(crate) breaker: BreakerConfig,
    /// Whether calls that fit it use the lean `CHECK` script (`scripts::lean`).
    pub(crate) lean: bool,
}

/// Connections, breaker, merged-call queues and the server's clock: everything a call to
/// Redis goes through.
pub(crate) struct Transport {
    /// The keys' prefix, written into each call's `KEYS`.
    prefix: String,
    deadline: Duration,
    /// The shared connection: every call but the merged `CHECK`s on a plain TCP server.
    shared: Arc<Connector>,
    /// The merged `CHECK` calls' own connection, for a plain TCP standalone server.
    direct: Option<Arc<Direct>>,
    /// A plain TCP cluster's nodes: the slot map and a connection per node.
    nodes: Option<Arc<Nodes>>,
    breaker: Breaker,
    /// Whether calls that fit it use the lean `CHECK` script.
    lean: bool,
    /// The requests waiting for a merged `CHECK` call.
    coalescers: Coalescers,
    clock: ServerClock,
    /// Registered on the first call, like the layer's, so that a recorder installed after the
    /// backend was built still receives them; after that a call only updates them.
    metrics: OnceLock<Metrics>,
}

struct Metrics {
    up: metrics::Gauge,
    duration: metrics::Histogram,
}

impl Transport {
    /// The transport `config` describes. No connection is made here.
    pub(crate) fn new(config: TransportConfig) -> Self {
        let direct = match &config.target {
            Target::Single(client) => {
                Direct::for_client(client, config.connect_timeout).map(Arc::new)
            }
            _ => None,
        };
        let nodes = match &config.target {
            Target::Cluster(_, Some(login)) => {
                Some(Arc::new(Nodes::new(login.clone(), config.connect_timeout)))
            }
            _ => None,
        };
        Self {
            prefix: config.prefix,
            deadline: config.deadline,
            shared: Arc::new(Connector::new(config.target, config.connect_timeout)),
            direct,
            nodes,
            breaker: Breaker::new(config.breaker),
            lean: config.lean,
            coalescers: Coalescers::default(),
            clock: ServerClock::default(),
            metrics: OnceLock::new(),
        }
    }

    /// The deadline of one call.
    pub(crate) fn deadline(&self) -> Duration {
        self.deadline
    }

    /// Whether the server is a Redis Cluster.
    pub(crate) fn is_cluster(&self) -> bool {
        self.shared.is_cluster()
    }

    /// `batch`'s checks grouped by where they go: by node once the slot map is known (it is
    /// read on the first call), else by hash slot.
    pub(crate) fn routes(self: &Arc<Self>, batch: &[EncodedCheck]) -> Vec<(Route, Vec<usize>)> {
        if let Some(nodes) = &self.nodes {
            if !nodes.mapped() {
                self.refresh_nodes();
            }
        }
        match &self.nodes {
            Some(nodes) => nodes.groups(batch),
            None => nodes::hash_slot_groups(batch, 0..batch.len()),
        }
    }

    /// Node `number`'s own connection.
    pub(crate) fn node(&self, number: u16) -> Option<Arc<Direct>> {
        self.nodes.as_ref().and_then(|nodes| nodes.node(number))
    }

    /// Reads the slot map again, in a task of its own, unless a read runs or ran just now.
    pub(crate) fn refresh_nodes(self: &Arc<Self>) {
        let Some(nodes) = &self.nodes else {
            return;
        };
        if !nodes.start_refresh() {
            return;
        }
        let refresh = nodes::Refresh::new(Arc::clone(nodes));
        let transport = Arc::clone(self);
        tokio::spawn(async move {
            let mut cmd = redis::cmd("CLUSTER");
            cmd.arg("SLOTS");
            let answer = transport
                .within_deadline(transport.query(&cmd), "to CLUSTER SLOTS")
                .await;
            if let Err(e) = &answer {
                tracing::debug!(backend = BACKEND, error = %e, "reading the slot map failed");
            }
            refresh.finish(answer.ok().as_ref());
        });
    }

    /// The merged-call queues.
    pub(crate) fn coalescers(&self) -> &Coalescers {
        &self.coalescers
    }

    /// The client's estimate of the server's `TIME` (see [`ServerClock`]).
    pub(crate) fn server_time(&self) -> Micros {
        self.clock.now()
    }

    #[cfg(test)]
    pub(crate) fn clock(&self) -> &ServerClock {
        &self.clock
    }

    fn metrics(&self) -> &Metrics {
        self.metrics.get_or_init(|| Metrics {
            up: metrics::gauge!("tollgate_backend_up", "backend" => BACKEND),
            duration: metrics::histogram!("tollgate_backend_duration_seconds", "backend" => BACKEND),
        })
    }

    /// Records how long a request's call, started at `started`, took.
    pub(crate) fn record_duration(&self, started: Instant) {
        self.metrics()
            .duration
            .record(started.elapsed().as_secs_f64());
    }

    /// The breaker's permit for a call, or `None` while it is open.
    pub(crate) fn admit(&self) -> Option<Permit> {
        self.breaker.admit()
    }

    /// Where the circuit breaker stands.
    pub(crate) fn circuit_state(&self) -> CircuitState {
        self.breaker.state()
    }

    /// Tells the breaker and the health gauge how one call to Redis went: once per call,
    /// however many requests it carried. A check that was not sent (`Overloaded`) says
    /// nothing of Redis and is never reported.
    pub(crate) fn report(&self, result: Result<(), &BackendError>, permit: Permit) {
        match result {
            Ok(()) => self.answered(permit),
            // Redis answered, with something we did not expect: it is up.
            Err(e) if e.kind() == BackendErrorKind::Protocol => self.answered(permit),
            Err(e) if e.is_overloaded() => {}
            Err(_) => {
                if self.breaker.failure(permit) {
                    self.shared.replace();
                    if let Some(direct) = &self.direct {
                        direct.replace();
                    }
                    if let Some(nodes) = &self.nodes {
                        nodes.replace();
                    }
                }
                self.metrics().up.set(0.0);
            }
        }
    }

    fn answered(&self, permit: Permit) {
        self.breaker.success(permit);
        self.metrics().up.set(1.0);
    }

    /// Sends `PING` within the deadline, whatever the breaker says, and sets the health gauge.
    pub(crate) async fn ping(&self) -> Result<(), BackendError> {
        let ping = async { self.query(&redis::cmd("PING")).await.map(|_| ()) };
        let result = self.within_deadline(ping, "to PING").await;
        self.metrics()
            .up
            .set(if result.is_ok() { 1.0 } else { 0.0 });
        result
    }

    /// `call`'s answer, or a timeout once the deadline has passed; `what` names the answer
    /// awaited, for the error.
    pub(crate) async fn within_deadline<T>(
        &self,
        call: impl Future<Output = Result<T, BackendError>>,
        what: &str,
    ) -> Result<T, BackendError> {
        self.until(Instant::now() + self.deadline, call, what).await
    }

    /// `call`'s answer, or a timeout at `deadline`.
    pub(crate) async fn until<T>(
        &self,
        deadline: Instant,
        call: impl Future<Output = Result<T, BackendError>>,
        what: &str,
    ) -> Result<T, BackendError> {
        tokio::time::timeout_at(deadline, call)
            .await
            .unwrap_or_else(|_| Err(self.timed_out(what)))
    }

    fn timed_out(&self, what: &str) -> BackendError {
        BackendError::new(
            BackendErrorKind::Timeout,
            format!("no answer {what} within {:?}", self.deadline),
        )
    }

    /// An `EVALSHA` of `script` with what every script takes first: the keys of `checks`
    /// (each base key with its suffix), then `now` (empty for the server's `TIME`). The caller
    /// adds `args` more numbers.
    pub(crate) fn script_call<'p>(
        &self,
        script: &Script,
        checks: impl Iterator<Item = (&'p EncodedCheck, Suffix)> + Clone,
        now: Option<Micros>,
        args: usize,
    ) -> redis::Cmd {
        // Room for every argument: each takes about 16 bytes of framing; a key is the prefix,
        // the limit's name, 36 more bytes and a suffix of at most 21, a number at most 20
        // digits.
        const NUMBER: usize = 16 + 20;
        let keys = checks.clone().count();
        let key_bytes: usize = checks
            .clone()
            .map(|(p, _)| 16 + self.prefix.len() + p.name.len() + 36 + 21)
            .sum();
        let mut call =
            redis::Cmd::with_capacity(3 + keys + 1 + args, 64 + key_bytes + NUMBER * (1 + args));
        self.script_args(&mut call, script, checks, now);
        call
    }

    /// Writes into `out` what [`script_call`](Self::script_call) makes: `EVALSHA`, the
    /// script's digest, the keys and `now`. `3 + keys + 1` arguments.
    fn script_args<'p>(
        &self,
        out: &mut dyn Args,
        script: &Script,
        checks: impl Iterator<Item = (&'p EncodedCheck, Suffix)> + Clone,
        now: Option<Micros>,
    ) {
        self.script_keys(out, script, checks);
        match now {
            Some(now) => out.number(now),
            None => out.bytes(b""),
        }
    }

    /// Writes `EVALSHA`, the script's digest and the declared keys of `checks` into `out`.
    fn script_keys<'p>(
        &self,
        out: &mut dyn Args,
        script: &Script,
        checks: impl Iterator<Item = (&'p EncodedCheck, Suffix)> + Clone,
    ) {
        out.bytes(b"EVALSHA");
        out.bytes(script.sha().as_bytes());
        out.number(checks.clone().count() as u64);
        for (p, suffix) in checks {
            self.key_arg(out, p, suffix);
        }
    }

    fn key_arg(&self, out: &mut dyn Args, p: &EncodedCheck, suffix: Suffix) {
        let key = keys::BaseKey::new(&self.prefix, &p.name, &p.digest).with(suffix);
        out.bytes(key.as_bytes());
    }

    /// Writes a `CHECK` call of `args` in `form` into `out`; [`check_len`] arguments.
    fn check_args(
        &self,
        out: &mut dyn Args,
        args: &CheckArgs<'_>,
        now: Option<Micros>,
        form: Form,
    ) {
        let declared = match form {
            Form::Declared => &args.keys[..],
            Form::CrossSlot => &args.keys[..args.keys.len().min(1)],
        };
        self.script_args(out, form.script(), declared.iter().copied(), now);
        out.number(args.limits.len() as u64);
        for limit in &args.limits {
            for &n in limit {
                out.number(n);
            }
        }
        out.bytes(&args.packed);
        for &(p, suffix) in &args.keys[declared.len()..] {
            self.key_arg(out, p, suffix);
        }
    }

    /// Writes a lean `CHECK` call of `batches` (which `lean::fits`, sharing `first`'s
    /// figures) in `form` into `out`; `lean::len` arguments. One key per request.
    fn lean_args<B: AsRef<[EncodedCheck]>>(
        &self,
        out: &mut dyn Args,
        batches: &[B],
        first: &EncodedCheck,
        now: Option<Micros>,
        form: Form,
    ) {
        let declared = match form {
            Form::Declared => batches.len(),
            Form::CrossSlot => batches.len().min(1),
        };
        // Each request's one check (as `lean::fits` found), at its TAT's key.
        fn tat<B: AsRef<[EncodedCheck]>>(batch: &B) -> (&EncodedCheck, Suffix) {
            (&batch.as_ref()[0], Suffix::Tat)
        }
        self.script_keys(out, lean::script(form), batches[..declared].iter().map(tat));
        lean::write_figures(out, first, now);
        for (p, suffix) in batches[declared..].iter().map(tat) {
            self.key_arg(out, p, suffix);
        }
    }

    /// One `CHECK` call for checks that share a hash slot (or a standalone server).
    pub(crate) async fn eval_check(
        &self,
        group: &[EncodedCheck],
        now: Option<Micros>,
    ) -> Result<Reply, BackendError> {
        let mut replies = Vec::with_capacity(1);
        self.eval_checks(&[group], now, &mut replies).await?;
        replies
            .pop()
            .flatten()
            .ok_or_else(|| BackendError::new(BackendErrorKind::Protocol, "empty script reply"))
    }

    /// One `CHECK` call for the batches of several requests, each all-or-nothing on its own;
    /// their replies, in order, replace what `replies` held (every one of them `Some`).
    ///
    /// Its fixed windows are declared for the server's time as last seen (or `now`). If the
    /// server's window turns out to be another (a clock that stepped, a first call), the
    /// script writes nothing and says its time; the call is made once more for that time.
    pub(crate) async fn eval_checks<B: AsRef<[EncodedCheck]> + Sync>(
        &self,
        batches: &[B],
        now: Option<Micros>,
        replies: &mut Vec<Option<Reply>>,
    ) -> Result<(), BackendError> {
        self.eval_checks_on(batches, now, self.direct.as_ref(), Form::Declared, replies)
            .await
            .map_err(CheckError::into_backend)?;
        // Every key declared: Redis made sure the server serves them all before the script ran.
        if replies.iter().any(Option::is_none) {
            return Err(BackendError::new(
                BackendErrorKind::Protocol,
                "the script did not run a request whose key it was given",
            ));
        }
        Ok(())
    }

    /// As [`eval_checks`](Self::eval_checks), in `form`, on `direct` when it is free (else on
    /// the shared connection), with Redis' own error (a cluster node's redirection included);
    /// `None` for a request that the lean script in the cross-slot form did not run, because
    /// the node does not serve its key.
    pub(crate) async fn eval_checks_on<B: AsRef<[EncodedCheck]> + Sync>(
        &self,
        batches: &[B],
        now: Option<Micros>,
        direct: Option<&Arc<Direct>>,
        form: Form,
        replies: &mut Vec<Option<Reply>>,
    ) -> Result<(), CheckError> {
        if let Some(first) = self.lean.then(|| lean::fits(batches)).flatten() {
            let write = |out: &mut dyn Args| self.lean_args(out, batches, first, now, form);
            let sent = clock::monotonic_time();
            let mut read = |bytes: &[u8]| self.replies(bytes, batches, now, sent, replies);
            let read = self
                .invoke_check(lean::len(batches.len()), &write, direct, form, &mut read)
                .await?;
            return Ok(read.map_err(unexpected)??);
        }
        let mut window_now = now.unwrap_or_else(|| self.clock.now());
        for retry in [false, true] {
            let args = CheckArgs::new(batches, window_now)?;
            let write = |out: &mut dyn Args| self.check_args(out, &args, now, form);
            let sent = clock::monotonic_time();
            let mut read = |bytes: &[u8]| self.replies(bytes, batches, now, sent, replies);
            match self
                .invoke_check(check_len(&args), &write, direct, form, &mut read)
                .await
            {
                Ok(read) => {
                    return Ok(read.map_err(unexpected)??);
                }
                Err(e) if !retry && e.code() == Some(WINDOW_ERROR) => {
                    match e.detail().and_then(|d| d.trim().parse().ok()) {
                        Some(server_now) => {
                            window_now = server_now;
                            if now.is_none() {
                                self.clock.saw(server_now, sent);
                            }
                        }
                        None => return Err(e.into()),
                    }
                }
                Err(e) => return Err(e.into()),
            }
        }
        Err(BackendError::new(
            BackendErrorKind::Protocol,
            "the server's fixed window moved twice in a row",
        )
        .into())
    }

    /// Reads into `replies` the replies of a `CHECK` call (of either script) sent at `sent`,
    /// from the reply's bytes; the server's time in them updates the clock's estimate unless
    /// the call was made at a fixed `now`.
    fn replies<B: AsRef<[EncodedCheck]>>(
        &self,
        bytes: &[u8],
        batches: &[B],
        now: Option<Micros>,
        sent: Micros,
        replies: &mut Vec<Option<Reply>>,
    ) -> Result<(), BackendError> {
        reply::parse_replies(bytes, batches, replies)?;
        if let (None, Some(reply)) = (now, replies.iter().flatten().next()) {
            self.clock.saw(reply.now, sent);
        }
        Ok(())
    }

    /// Sends `call`, an `EVALSHA` of `script`, on the shared connection.
    pub(crate) async fn invoke(
        &self,
        script: &Script,
        call: &redis::Cmd,
    ) -> Result<redis::Value, BackendError> {
        self.invoke_raw(&[script], call).await.map_err(map_error)
    }

    /// Sends a plain command on the shared connection.
    pub(crate) async fn query(&self, cmd: &redis::Cmd) -> Result<redis::Value, BackendError> {
        self.query_raw(cmd).await.map_err(map_error)
    }

    /// As [`query`](Self::query), with Redis' own error.
    pub(crate) async fn query_raw(
        &self,
        cmd: &redis::Cmd,
    ) -> Result<redis::Value, redis::RedisError> {
        let (generation, mut conn) = self.shared.get().await?;
        conn.query(cmd).await.inspect_err(|e| {
            if breaks_connection(e) {
                self.shared.invalidate(generation);
            }
        })
    }

    /// Sends the `CHECK` call that `write` writes (`count` arguments): on the direct
    /// connection, as RESP written in place, when there is one and it is free; else as a
    /// redis-rs command, as [`invoke_raw`](Self::invoke_raw) does. A bulk string reply is
    /// handed to `read` (on the direct connection, where it lies in the read buffer); any
    /// other reply comes back as it is.
    ///
    /// A server that does not know the script (restarted, flushed, or never called) has both
    /// `CHECK` scripts of `form` loaded, the general and the lean one, so that the other is
    /// not missing at the next call.
    async fn invoke_check<T>(
        &self,
        count: usize,
        write: &(dyn Fn(&mut dyn Args) + Sync),
        direct: Option<&Arc<Direct>>,
        form: Form,
        read: &mut (impl FnMut(&[u8]) -> T + Send),
    ) -> Result<Result<T, redis::Value>, redis::RedisError> {
        let no_script =
            |e: &redis::RedisError| e.kind() == ErrorKind::Server(ServerErrorKind::NoScript);
        let scripts = [form.script(), lean::script(form)];
        if let Some(held) = match direct {
            Some(direct) => direct.take().await,
            None => None,
        } {
            let mut conn = held?;
            return match conn.query_with(count, write, read).await {
                Err(e) if no_script(&e) => {
                    for script in scripts {
                        conn.query(&script.load()).await?;
                    }
                    conn.query_with(count, write, read).await
                }
                other => other,
            };
        }
        let mut call = redis::Cmd::with_capacity(count, 64 * count);
        write(&mut call);
        match self.invoke_raw(&scripts, &call).await? {
            redis::Value::BulkString(bytes) => Ok(Ok(read(&bytes))),
            other => Ok(Err(other)),
        }
    }

    /// As [`invoke`](Self::invoke), with Redis' own error; all of `scripts` are loaded when
    /// the server does not know the first.
    async fn invoke_raw(
        &self,
        scripts: &[&Script],
        call: &redis::Cmd,
    ) -> Result<redis::Value, redis::RedisError> {
        let (generation, mut conn) = self.shared.get().await?;
        conn.invoke(scripts, call).await.inspect_err(|e| {
            if breaks_connection(e) {
                self.shared.invalidate(generation);
            }
        })
    }
}

/// Shown as its shared connection: where it goes, and whether it is up.
impl std::fmt::Debug for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(&self.shared, f)
    }
}

/// A `CHECK` reply that is not a string of figures.
fn unexpected(value: redis::Value) -> BackendError {
    BackendError::new(
        BackendErrorKind::Protocol,
        format!("unexpected script reply {value:?}"),
    )
}

/// The arguments of a `CHECK` call of `args`: `EVALSHA`, the digest, the number of keys, the
/// keys, `now`, the number of limits, 8 figures per limit, the packed checks.
fn check_len(args: &CheckArgs<'_>) -> usize {
    3 + args.keys.len() + 1 + 1 + 8 * args.limits.len() + 1
}
