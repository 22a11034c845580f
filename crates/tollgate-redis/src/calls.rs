//! Script calls: the keys and arguments of an `EVALSHA`, the `CHECK` call (made again once
//! when the server's fixed window is not the one declared), and sending.

use std::sync::atomic::Ordering;

use redis::{ErrorKind, ServerErrorKind};
use tollgate_core::{BackendError, BackendErrorKind, Micros};

use crate::backend::Inner;
use crate::conn::breaks_connection;
use crate::failure::map_error;
use crate::keys::{self, Suffix};
use crate::script::{self, Prepared, Reply, Script};

/// Where a script call's arguments go: a redis-rs command for the shared connection, or RESP
/// written in place for the `CHECK` calls' own connection (`direct`).
pub(crate) trait Args {
    fn bytes(&mut self, arg: &[u8]);
    fn number(&mut self, n: u64);
}

impl Args for redis::Cmd {
    fn bytes(&mut self, arg: &[u8]) {
        self.arg(arg);
    }

    fn number(&mut self, n: u64) {
        self.arg(n);
    }
}

impl Inner {
    /// An `EVALSHA` of `script` with what both scripts take first: the keys of `checks`
    /// (each base key with its suffix), then `now` (empty for the server's `TIME`). The caller
    /// adds `args` more numbers.
    pub(crate) fn script_call<'p>(
        &self,
        script: &Script,
        checks: impl Iterator<Item = (&'p Prepared, Suffix)> + Clone,
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
        checks: impl Iterator<Item = (&'p Prepared, Suffix)> + Clone,
        now: Option<Micros>,
    ) {
        out.bytes(b"EVALSHA");
        out.bytes(script.sha().as_bytes());
        out.number(checks.clone().count() as u64);
        for (p, suffix) in checks {
            let key = keys::BaseKey::new(&self.prefix, &p.name, &p.digest).with(suffix);
            out.bytes(key.as_bytes());
        }
        match now {
            Some(now) => out.number(now),
            None => out.bytes(b""),
        }
    }

    /// Writes a `CHECK` call of `args` into `out`; [`check_len`] arguments.
    fn check_args(&self, out: &mut dyn Args, args: &script::CheckArgs<'_>, now: Option<Micros>) {
        self.script_args(out, &self.check_script, args.keys.iter().copied(), now);
        out.number(args.limits.len() as u64);
        for limit in &args.limits {
            for &n in limit {
                out.number(n);
            }
        }
        out.bytes(&args.packed);
    }

    /// One `CHECK` call for checks that share a slot (or a standalone server).
    pub(crate) async fn eval_check(
        &self,
        group: &[&[Prepared]],
        now: Option<Micros>,
    ) -> Result<Reply, BackendError> {
        let mut replies = self.eval_checks(group, now).await?;
        replies
            .pop()
            .ok_or_else(|| BackendError::new(BackendErrorKind::Protocol, "empty script reply"))
    }

    /// One `CHECK` call for the batches of several requests, each all-or-nothing on its own.
    ///
    /// Its fixed windows are declared for the server's time as last seen (or `now`). If the
    /// server's window turns out to be another (a clock that stepped, a first call), the
    /// script writes nothing and says its time; the call is made once more for that time.
    pub(crate) async fn eval_checks(
        &self,
        batches: &[&[Prepared]],
        now: Option<Micros>,
    ) -> Result<Vec<Reply>, BackendError> {
        let mut window_now = now.unwrap_or_else(|| self.server_time());
        for retry in [false, true] {
            let args = script::CheckArgs::new(batches, window_now)?;
            let write = |out: &mut dyn Args| self.check_args(out, &args, now);
            let sent = monotonic_time();
            match self.invoke_check(check_len(&args), &write).await {
                Ok(value) => {
                    let replies = script::parse_replies(&value, batches)?;
                    if let (None, Some(reply)) = (now, replies.first()) {
                        self.saw_server_time(reply.now, sent);
                    }
                    return Ok(replies);
                }
                Err(e) if !retry && e.code() == Some(WINDOW_ERROR) => {
                    match e.detail().and_then(|d| d.trim().parse().ok()) {
                        Some(server_now) => {
                            window_now = server_now;
                            if now.is_none() {
                                self.saw_server_time(server_now, sent);
                            }
                        }
                        None => return Err(map_error(e)),
                    }
                }
                Err(e) => return Err(map_error(e)),
            }
        }
        Err(BackendError::new(
            BackendErrorKind::Protocol,
            "the server's fixed window moved twice in a row",
        ))
    }

    /// The client's estimate of the server's `TIME`: a monotonic clock, corrected by the
    /// difference last seen between the server's time in a reply and when its call was sent.
    /// The server read its time after the call was sent, so the estimate is at or after the
    /// server's time (by up to a round trip, while the clocks run at the same rate), and a
    /// step of the local wall clock does not move it. It names the fixed windows a call
    /// declares, and times leased slices: a slice then ends no later, by the server's clock,
    /// than its window or its pace allows.
    pub(crate) fn server_time(&self) -> Micros {
        let skew = self.skew.load(Ordering::Relaxed);
        monotonic_time().saturating_add_signed(skew)
    }

    /// Keeps the difference between the server's time, `server_now`, and the monotonic clock
    /// when the call that read it was `sent`.
    fn saw_server_time(&self, server_now: Micros, sent: Micros) {
        let skew = i64::try_from(i128::from(server_now) - i128::from(sent));
        self.skew.store(skew.unwrap_or(0), Ordering::Relaxed);
    }

    /// Sends `call`, an `EVALSHA` of `script`.
    pub(crate) async fn invoke(
        &self,
        script: &Script,
        call: &redis::Cmd,
    ) -> Result<redis::Value, BackendError> {
        self.invoke_raw(script, call).await.map_err(map_error)
    }

    /// Sends a plain command.
    pub(crate) async fn query(&self, cmd: &redis::Cmd) -> Result<redis::Value, BackendError> {
        let (generation, mut conn) = self.connector.get().await.map_err(map_error)?;
        conn.query(cmd).await.map_err(|e| {
            if breaks_connection(&e) {
                self.connector.invalidate(generation);
            }
            map_error(e)
        })
    }

    /// Sends the `CHECK` call that `write` writes (`count` arguments): on the direct
    /// connection, as RESP written in place, when there is one and it is free; else as a
    /// redis-rs command, as [`invoke_raw`](Self::invoke_raw) does.
    async fn invoke_check(
        &self,
        count: usize,
        write: &(dyn Fn(&mut dyn Args) + Sync),
    ) -> Result<redis::Value, redis::RedisError> {
        if let Some(held) = match &self.direct {
            Some(direct) => direct.take().await,
            None => None,
        } {
            let mut conn = held?;
            return match conn.query_with(count, write).await {
                Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                    conn.query(&self.check_script.load()).await?;
                    conn.query_with(count, write).await
                }
                other => other,
            };
        }
        let mut call = redis::Cmd::with_capacity(count, 64 * count);
        write(&mut call);
        self.invoke_raw(&self.check_script, &call).await
    }

    /// As [`invoke`](Self::invoke), with Redis' own error.
    async fn invoke_raw(
        &self,
        script: &Script,
        call: &redis::Cmd,
    ) -> Result<redis::Value, redis::RedisError> {
        let (generation, mut conn) = self.connector.get().await?;
        conn.invoke(script, call).await.inspect_err(|e| {
            if breaks_connection(e) {
                self.connector.invalidate(generation);
            }
        })
    }
}

/// The arguments of a `CHECK` call of `args`: `EVALSHA`, the digest, the number of keys, the
/// keys, `now`, the number of limits, 4 figures per limit, the packed checks.
fn check_len(args: &script::CheckArgs<'_>) -> usize {
    3 + args.keys.len() + 1 + 1 + 4 * args.limits.len() + 1
}

/// The error code of a `CHECK` call whose fixed windows were declared for another time.
const WINDOW_ERROR: &str = "TOLLGATE_WINDOW";

/// The local wall clock in microseconds since the Unix epoch (0 before it).
fn local_time() -> Micros {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

/// A monotonic clock in microseconds, which read the wall clock's time when first asked: it
/// never steps back or forward with the wall clock.
fn monotonic_time() -> Micros {
    static START: std::sync::OnceLock<(std::time::Instant, Micros)> = std::sync::OnceLock::new();
    let (instant, wall) = START.get_or_init(|| (std::time::Instant::now(), local_time()));
    let elapsed = u64::try_from(instant.elapsed().as_micros()).unwrap_or(u64::MAX);
    wall.saturating_add(elapsed)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use tollgate_core::{Backend, Check, Limit, Quota};
    use tollgate_testsupport::RedisServer;

    use crate::RedisBackend;

    /// The estimate of the server's time is never behind it: the server read its `TIME` after
    /// the call was sent, and the estimate counts from the sending.
    #[tokio::test]
    async fn the_servers_time_is_estimated_at_or_after_it() {
        let server = RedisServer::start();
        let backend = RedisBackend::builder().url(server.url()).build().unwrap();
        let limit = Limit::gcra("clock", Quota::per_minute(100).unwrap()).unwrap();
        let mut conn = server.client();
        for _ in 0..20 {
            backend.check(&[Check::new(&limit, b"k")]).await.unwrap();
            let (secs, micros): (u64, u64) = redis::cmd("TIME").query(&mut conn).unwrap();
            let estimate = backend.inner.server_time();
            assert!(
                estimate >= secs * 1_000_000 + micros,
                "{estimate} behind the server"
            );
        }
    }
}
