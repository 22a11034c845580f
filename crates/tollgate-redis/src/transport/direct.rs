//! The `CHECK` calls' own connection to a standalone server, or to one node of a cluster.
//!
//! The merged calls go out one at a time, from one task (see `coalesce`), so they need no
//! multiplexing: this connection writes a call, reads its one reply, and is ready for the
//! next. Writing the RESP here and reading the reply in place spares each call the shared
//! connection's queue, its boxed request and its general-purpose parser, which cost more
//! than everything else of a call on our side (see `docs/benchmarks.md`).
//!
//! Only plain TCP servers named by a `redis://` URL that speak RESP2 get one (TLS, Unix
//! sockets, RESP3 and Sentinel keep the shared connection). The first call that needs it starts
//! an attempt in a task of its own (the URL's `AUTH` and `SELECT` included, bounded by the
//! connect timeout) and waits for it within its deadline. A call that fails on the wire, that
//! is answered `READONLY`, or that is dropped before its reply (its deadline passed), takes the
//! connection down with it, so that a late reply is never read as the next call's; the next
//! call connects again. A call that finds the
//! connection busy (a test's call at a fixed time beside the merged calls) uses the shared
//! connection instead.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use redis::{ConnectionAddr, ErrorKind, RedisError, RedisResult, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::Notify;

use crate::failure::breaks_connection;
use crate::keys::decimal;
use crate::scripts::args::Args;
use crate::scripts::Script;

/// Where the direct connection goes, and how it logs in.
pub(crate) struct Direct {
    host: String,
    port: u16,
    username: Option<String>,
    password: Option<String>,
    db: i64,
    connect_timeout: Duration,
    /// A script loaded on each new connection (a cluster node's cross-slot `CHECK`).
    preload: Option<&'static Script>,
    /// The server refused to load `preload`: it cannot run it.
    refused: AtomicBool,
    state: Mutex<State>,
}

/// The credentials of a cluster's nodes: those of its first seed URL.
#[derive(Clone, Default)]
pub(crate) struct Login {
    username: Option<String>,
    password: Option<String>,
}

impl Login {
    /// The credentials of `url` if it names a plain TCP server spoken to in RESP2 (the only
    /// servers a direct connection reaches); `None` otherwise.
    pub(crate) fn of_url(url: &str) -> Option<Self> {
        let info = redis::IntoConnectionInfo::into_connection_info(url).ok()?;
        if !matches!(info.addr(), ConnectionAddr::Tcp(..)) {
            return None;
        }
        let settings = info.redis_settings();
        if settings.protocol() != redis::ProtocolVersion::RESP2 {
            return None;
        }
        Some(Self {
            username: settings.username().map(str::to_owned),
            password: settings.password().map(str::to_owned),
        })
    }
}

enum State {
    /// No connection: the next call starts an attempt. The last attempt's error, for the call
    /// that waited for it.
    Idle(Option<RedisError>),
    /// An attempt runs in a task of its own, bounded by the connect timeout rather than by a
    /// call's deadline, so that a slow handshake still completes for the next call.
    Connecting(Arc<Notify>),
    /// A call holds the connection.
    Busy,
    Ready(Stream),
}

impl Direct {
    /// The direct connection for `client`'s server, if it is a plain TCP one.
    pub(crate) fn for_client(client: &redis::Client, connect_timeout: Duration) -> Option<Self> {
        let info = client.get_connection_info();
        let ConnectionAddr::Tcp(host, port) = info.addr() else {
            return None;
        };
        let settings = info.redis_settings();
        if settings.protocol() != redis::ProtocolVersion::RESP2 {
            return None;
        }
        Some(Self {
            host: host.clone(),
            port: *port,
            username: settings.username().map(str::to_owned),
            password: settings.password().map(str::to_owned),
            db: settings.db(),
            connect_timeout,
            preload: None,
            refused: AtomicBool::new(false),
            state: Mutex::new(State::Idle(None)),
        })
    }

    /// The connection to a cluster node at `host`:`port`, which loads `script` whenever it
    /// connects.
    pub(crate) fn for_node(
        host: &str,
        port: u16,
        login: &Login,
        connect_timeout: Duration,
        script: &'static Script,
    ) -> Self {
        Self {
            host: host.to_owned(),
            port,
            username: login.username.clone(),
            password: login.password.clone(),
            db: 0,
            connect_timeout,
            preload: Some(script),
            refused: AtomicBool::new(false),
            state: Mutex::new(State::Idle(None)),
        }
    }

    /// Whether the server refused to load the connection's script (a server before Redis 7
    /// refuses a script with flags).
    pub(crate) fn refuses_script(&self) -> bool {
        self.refused.load(Ordering::Relaxed)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The connection for one call, once an attempt has made one if there is none; `None`
    /// when another call holds it. The caller bounds the wait with its deadline.
    pub(crate) async fn take(self: &Arc<Self>) -> Option<RedisResult<Lent>> {
        let mut started = false;
        loop {
            let notify = {
                let mut state = self.lock();
                match std::mem::replace(&mut *state, State::Busy) {
                    State::Ready(stream) => {
                        return Some(Ok(Lent {
                            direct: Arc::clone(self),
                            stream: Some(stream),
                            in_step: true,
                        }))
                    }
                    State::Busy => return None,
                    State::Idle(last_error) if started => {
                        *state = State::Idle(None);
                        return Some(Err(last_error.unwrap_or_else(|| {
                            RedisError::from((ErrorKind::Io, "could not connect to Redis"))
                        })));
                    }
                    State::Idle(_) => {
                        let notify = Arc::new(Notify::new());
                        *state = State::Connecting(Arc::clone(&notify));
                        let attempt = Attempt {
                            direct: Arc::clone(self),
                            notify: Arc::clone(&notify),
                        };
                        tokio::spawn(attempt.run());
                        notify
                    }
                    State::Connecting(notify) => {
                        *state = State::Connecting(Arc::clone(&notify));
                        notify
                    }
                }
            };
            started = true;
            let wait = notify.notified();
            // The attempt may have ended between the unlock and `notified()`.
            if !matches!(&*self.lock(), State::Connecting(n) if Arc::ptr_eq(n, &notify)) {
                continue;
            }
            wait.await;
        }
    }

    /// Drops the connection (unless a call holds it: that call's failure drops it).
    pub(crate) fn replace(&self) {
        let mut state = self.lock();
        if matches!(&*state, State::Ready(_)) {
            *state = State::Idle(None);
        }
    }

    async fn connect(&self) -> RedisResult<Stream> {
        let tcp = TcpStream::connect((self.host.as_str(), self.port)).await?;
        tcp.set_nodelay(true)?;
        let mut stream = Stream {
            tcp,
            input: Vec::with_capacity(512),
            output: Vec::with_capacity(512),
        };
        if let Some(password) = &self.password {
            let mut auth = redis::cmd("AUTH");
            if let Some(username) = &self.username {
                auth.arg(username);
            }
            auth.arg(password);
            // Refused credentials are a server that cannot be used, as redis-rs reports them
            // for the shared connection: not an answer that makes no sense.
            stream.query(&auth).await.map_err(|e| {
                RedisError::from((
                    ErrorKind::AuthenticationFailed,
                    "Redis refused the URL's credentials",
                    e.to_string(),
                ))
            })?;
        }
        if self.db != 0 {
            stream
                .query(redis::cmd("SELECT").arg(self.db))
                .await
                .map_err(|e| {
                    RedisError::from((
                        ErrorKind::InvalidClientConfig,
                        "Redis refused the URL's database",
                        e.to_string(),
                    ))
                })?;
        }
        if let Some(script) = self.preload {
            if let Err(e) = stream.query(&script.load()).await {
                let text = e.to_string();
                // Redis 6 cannot compile the flags' line; Redis 7 would name a flag it lacks.
                if text.contains("compiling") || text.contains("shebang") {
                    self.refused.store(true, Ordering::Relaxed);
                }
                return Err(e);
            }
        }
        Ok(stream)
    }
}

/// A connection attempt's task. Dropped, it wakes the calls waiting for it; dropped before
/// the attempt ended (its runtime shut down), it first puts the state back to idle, so that
/// the next call starts a new attempt instead of waiting for this one forever.
struct Attempt {
    direct: Arc<Direct>,
    notify: Arc<Notify>,
}

impl Attempt {
    async fn run(self) {
        let result = tokio::time::timeout(self.direct.connect_timeout, self.direct.connect())
            .await
            .unwrap_or_else(|_| {
                Err(RedisError::from((
                    ErrorKind::Io,
                    "timed out connecting to Redis",
                )))
            });
        let mut state = self.direct.lock();
        if matches!(&*state, State::Connecting(n) if Arc::ptr_eq(n, &self.notify)) {
            *state = match result {
                Ok(stream) => State::Ready(stream),
                Err(e) => {
                    tracing::debug!(backend = "redis", error = %e, "connection attempt failed");
                    State::Idle(Some(e))
                }
            };
        }
    }
}

impl Drop for Attempt {
    fn drop(&mut self) {
        {
            let mut state = self.direct.lock();
            if matches!(&*state, State::Connecting(n) if Arc::ptr_eq(n, &self.notify)) {
                *state = State::Idle(None);
            }
        }
        self.notify.notify_waiters();
    }
}

/// The connection, lent to one call. Dropped, it hands the connection back only if its last
/// query ended with a reply read whole: a call dropped while it waits (its deadline passed),
/// or one that failed on the wire, leaves no connection behind, so that a late reply is
/// never read as the next call's.
pub(crate) struct Lent {
    direct: Arc<Direct>,
    stream: Option<Stream>,
    in_step: bool,
}

impl Lent {
    /// Sends `cmd` and reads its reply; an error reply is an `Err`.
    pub(crate) async fn query(&mut self, cmd: &redis::Cmd) -> RedisResult<Value> {
        self.exchange(|output| cmd.write_packed_command(output), &mut to_vec)
            .await
            .map(owned)
    }

    /// Sends the command of `count` arguments that `write` writes, as RESP, and reads its
    /// reply: a bulk string is handed to `read` where it lies in the read buffer (a `CHECK`
    /// reply is decoded without a copy), any other reply comes back as a [`Value`]; an error
    /// reply is an `Err`.
    pub(crate) async fn query_with<T>(
        &mut self,
        count: usize,
        write: &(dyn Fn(&mut dyn Args) + Sync),
        read: &mut (impl FnMut(&[u8]) -> T + Send),
    ) -> RedisResult<Result<T, Value>> {
        self.exchange(
            |output| {
                let mut resp = Resp::new(output, count);
                write(&mut resp);
                debug_assert_eq!(resp.left, 0, "a command of {count} arguments");
            },
            read,
        )
        .await
    }

    async fn exchange<T>(
        &mut self,
        write: impl FnOnce(&mut Vec<u8>),
        read: &mut (impl FnMut(&[u8]) -> T + Send),
    ) -> RedisResult<Result<T, Value>> {
        let Some(stream) = self.stream.as_mut() else {
            return Err(RedisError::from((
                ErrorKind::Io,
                "the connection was closed",
            )));
        };
        self.in_step = false;
        let reply = stream.exchange(write, read).await;
        // A server's error reply leaves the connection in step; a failure to write or read
        // one does not. `READONLY` (a demoted master, whose address may soon name the new
        // one) drops it too, as it drops the shared connection.
        self.in_step = match &reply {
            Ok(_) => true,
            Err(e) => e.kind() != ErrorKind::Parse && !breaks_connection(e),
        };
        reply
    }
}

/// A bulk string's bytes, owned.
fn to_vec(bytes: &[u8]) -> Vec<u8> {
    bytes.to_vec()
}

/// A reply read by [`to_vec`], as a [`Value`].
fn owned(reply: Result<Vec<u8>, Value>) -> Value {
    match reply {
        Ok(bytes) => Value::BulkString(bytes),
        Err(value) => value,
    }
}

impl Drop for Lent {
    fn drop(&mut self) {
        let stream = self.stream.take().filter(|_| self.in_step);
        let mut state = self.direct.lock();
        *state = match stream {
            Some(stream) => State::Ready(stream),
            None => State::Idle(None),
        };
    }
}

struct Stream {
    tcp: TcpStream,
    /// What has been read of the current reply.
    input: Vec<u8>,
    /// The command being written.
    output: Vec<u8>,
}

impl Stream {
    async fn query(&mut self, cmd: &redis::Cmd) -> RedisResult<Value> {
        self.exchange(|output| cmd.write_packed_command(output), &mut to_vec)
            .await
            .map(owned)
    }

    /// Writes the command `write` writes and reads its one reply: a bulk string is handed to
    /// `read` in place, any other reply comes back as a [`Value`].
    async fn exchange<T>(
        &mut self,
        write: impl FnOnce(&mut Vec<u8>),
        read: &mut (impl FnMut(&[u8]) -> T + Send),
    ) -> RedisResult<Result<T, Value>> {
        self.output.clear();
        write(&mut self.output);
        self.tcp.write_all(&self.output).await?;
        self.input.clear();
        loop {
            match parse(&self.input)? {
                Some(Parsed::Bulk(at)) => return Ok(Ok(read(&self.input[at]))),
                Some(Parsed::Other(reply)) => return reply.map(Err),
                None => {}
            }
            if self.tcp.read_buf(&mut self.input).await? == 0 {
                return Err(RedisError::from((
                    ErrorKind::Io,
                    "Redis closed the connection",
                )));
            }
        }
    }
}

/// A command written as RESP: its number of arguments, then each as a bulk string.
struct Resp<'a> {
    out: &'a mut Vec<u8>,
    /// Arguments still to write, of those announced.
    left: usize,
}

impl<'a> Resp<'a> {
    fn new(out: &'a mut Vec<u8>, count: usize) -> Self {
        out.push(b'*');
        push_decimal(out, count as u64);
        out.extend_from_slice(b"\r\n");
        Self { out, left: count }
    }
}

impl Args for Resp<'_> {
    fn bytes(&mut self, arg: &[u8]) {
        self.left = self.left.wrapping_sub(1);
        self.out.push(b'$');
        push_decimal(self.out, arg.len() as u64);
        self.out.extend_from_slice(b"\r\n");
        self.out.extend_from_slice(arg);
        self.out.extend_from_slice(b"\r\n");
    }

    fn number(&mut self, n: u64) {
        let mut digits = [0u8; 20];
        let at = decimal(n, &mut digits);
        self.bytes(&digits[at..]);
    }
}

fn push_decimal(out: &mut Vec<u8>, n: u64) {
    let mut digits = [0u8; 20];
    let at = decimal(n, &mut digits);
    out.extend_from_slice(&digits[at..]);
}

/// The longest bulk string read: far more than a merged call's reply (8 bytes a figure, a few
/// figures a check, at most 64 requests of 8 checks) or a script's digest.
const MAX_BULK: usize = 1 << 20;

/// One whole reply of `input`.
#[derive(Debug)]
enum Parsed {
    /// A bulk string, where it lies in `input`.
    Bulk(std::ops::Range<usize>),
    /// Any other reply: nil, an error, a status line or an integer.
    Other(RedisResult<Value>),
}

/// One whole reply at the start of `input`: `None` while it is incomplete. A `CHECK` answers
/// with a bulk string, read in place; errors, status lines and integers are read by the
/// `redis` crate's own parser. Anything more than one reply, or of another kind, is a protocol
/// error (`Parse`), and the connection is closed.
fn parse(input: &[u8]) -> RedisResult<Option<Parsed>> {
    let Some(line_end) = input.windows(2).position(|w| w == b"\r\n") else {
        return Ok(None);
    };
    let line = &input[..line_end];
    match line.first() {
        Some(b'$') => {
            let len = std::str::from_utf8(&line[1..])
                .ok()
                .and_then(|s| s.parse::<i64>().ok())
                .ok_or_else(|| unreadable("a bulk string's length"))?;
            if len < 0 {
                return whole(input, line_end + 2, Parsed::Other(Ok(Value::Nil)));
            }
            let len = usize::try_from(len)
                .ok()
                .filter(|&len| len <= MAX_BULK)
                .ok_or_else(|| unreadable("a bulk string's length"))?;
            let start = line_end + 2;
            let end = start + len;
            if input.len() < end + 2 {
                return Ok(None);
            }
            if &input[end..end + 2] != b"\r\n" {
                return Err(unreadable("a bulk string's end"));
            }
            whole(input, end + 2, Parsed::Bulk(start..end))
        }
        Some(b'-' | b'+' | b':') => {
            let reply = &input[..line_end + 2];
            if input.len() != reply.len() {
                return Err(unreadable("more than one reply"));
            }
            Ok(Some(Parsed::Other(
                redis::parse_redis_value(reply)?.extract_error(),
            )))
        }
        _ => Err(unreadable("a reply of an unexpected kind")),
    }
}

/// `reply`, if it ends `input` at `end`.
fn whole(input: &[u8], end: usize, reply: Parsed) -> RedisResult<Option<Parsed>> {
    if input.len() != end {
        return Err(unreadable("more than one reply"));
    }
    Ok(Some(reply))
}

fn unreadable(what: &'static str) -> RedisError {
    RedisError::from((
        ErrorKind::Parse,
        "unreadable reply from Redis",
        what.to_owned(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(input: &[u8]) -> Option<RedisResult<Value>> {
        parse(input).unwrap().map(|parsed| match parsed {
            Parsed::Bulk(at) => Ok(Value::BulkString(input[at].to_vec())),
            Parsed::Other(reply) => reply,
        })
    }

    #[test]
    fn a_bulk_string_is_read_once_whole() {
        assert!(parsed(b"").is_none());
        assert!(parsed(b"$5\r").is_none());
        assert!(parsed(b"$5\r\nhel").is_none());
        assert!(parsed(b"$5\r\nhello\r").is_none());
        let v = parsed(b"$5\r\nhello\r\n").unwrap().unwrap();
        assert_eq!(v, Value::BulkString(b"hello".to_vec()));
        // Binary content, CR LF inside included.
        let v = parsed(b"$4\r\n\r\n\x00\xff\r\n").unwrap().unwrap();
        assert_eq!(v, Value::BulkString(b"\r\n\x00\xff".to_vec()));
        assert_eq!(parsed(b"$-1\r\n").unwrap().unwrap(), Value::Nil);
        assert_eq!(
            parsed(b"$0\r\n\r\n").unwrap().unwrap(),
            Value::BulkString(Vec::new())
        );
    }

    #[test]
    fn error_replies_keep_their_code_and_detail() {
        let e = parsed(b"-TOLLGATE_WINDOW 1700000000000000\r\n")
            .unwrap()
            .unwrap_err();
        assert_eq!(e.code(), Some("TOLLGATE_WINDOW"));
        assert_eq!(e.detail(), Some("1700000000000000"));
        let e = parsed(b"-NOSCRIPT No matching script.\r\n")
            .unwrap()
            .unwrap_err();
        assert_eq!(
            e.kind(),
            ErrorKind::Server(redis::ServerErrorKind::NoScript)
        );
        assert!(parsed(b"-ERR").is_none());
        assert_eq!(parsed(b"+OK\r\n").unwrap().unwrap(), Value::Okay);
        assert_eq!(parsed(b":42\r\n").unwrap().unwrap(), Value::Int(42));
    }

    #[test]
    fn a_command_is_written_as_redis_writes_it() {
        let write = |out: &mut dyn Args| {
            out.bytes(b"EVALSHA");
            out.bytes(b"");
            out.number(0);
            out.number(u64::MAX);
            out.bytes(b"\r\n\x00\xff");
        };
        let mut ours = Vec::new();
        let mut resp = Resp::new(&mut ours, 5);
        write(&mut resp);
        assert_eq!(resp.left, 0);
        let mut cmd = redis::Cmd::new();
        write(&mut cmd);
        assert_eq!(ours, cmd.get_packed_command());
    }

    #[test]
    fn what_is_not_one_reply_is_a_protocol_error() {
        for bad in [
            &b"$x\r\n"[..],
            b"$5\r\nhelloXY",
            b"$5\r\nhello\r\n+OK\r\n",
            b"+OK\r\n+OK\r\n",
            b"*1\r\n$1\r\na\r\n",
            b"$99999999999999999999\r\n",
            b"$9223372036854775807\r\n",
            b"$1048577\r\n",
        ] {
            let e = parse(bad).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Parse, "{bad:?}");
        }
    }
}
