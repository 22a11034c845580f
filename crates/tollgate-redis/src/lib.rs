//! The Redis and Redis Cluster backend of tollgate: limits that hold across every replica.
//!
//! [`RedisBackend`] implements [`tollgate_engine::Backend`] on a standalone Redis (or Valkey)
//! server, a master that Redis Sentinel watches, or a Redis Cluster, with the maths of [`tollgate_engine::algorithm`] in Lua.
//!
//! # Examples
//!
//! ```no_run
//! use std::time::Duration;
//! use tollgate_engine::{Backend, Check, Limit, Quota};
//! use tollgate_redis::RedisBackend;
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let backend = RedisBackend::builder()
//!     .url("redis://127.0.0.1:6379/")
//!     .deadline(Duration::from_millis(50))
//!     .build()?;
//! let burst = Limit::gcra("burst", Quota::per_minute(10)?)?;
//! let daily = Limit::fixed_window("daily", Quota::per_day(1_000)?)?;
//!
//! // Both limits, one round trip, all-or-nothing.
//! let verdicts = backend
//!     .check(&[Check::new(&burst, b"203.0.113.7"), Check::new(&daily, b"shop-42")])
//!     .await?;
//! if verdicts.iter().all(|v| v.is_allowed()) {
//!     println!("admitted; {} left today", verdicts[1].remaining);
//! }
//! # Ok(())
//! # }
//! ```
//!
//! # One call per batch, all-or-nothing
//!
//! One Lua script checks every limit of a request and writes only if every enforced check
//! admits (shadow checks write what they admit and never refuse the batch); a denied check
//! writes nothing. Time is the server's (`TIME` in microseconds), so replicas with skewed clocks
//! agree. Scripts are called with `EVALSHA` and loaded again after a `NOSCRIPT`; they use only
//! commands that Valkey has too.
//!
//! On a standalone server the batches of concurrent requests share calls: while a call is in
//! flight, new batches wait, and the next call carries all of them (up to 64), each still
//! all-or-nothing on its own and run in arrival order. Nothing waits for a timer: before it
//! takes a call, the task sending them yields to the runtime while more requests join (at
//! most 8 times), so that those whose bytes arrived during the last round trip go in this
//! call; a lone request goes out after one such yield. Under load, Redis runs one script per
//! round trip instead of one per request. These calls go out one at a time on a connection of their own (for a
//! `redis://` URL: TLS and Unix sockets share the other connection), which writes the command
//! and reads its one reply in place; settles, slot releases and operators' calls use a
//! second, shared connection. Within a call, each GCRA or fixed-window key is read once and written once,
//! however many of the call's requests it serves. In a cluster a script can touch the keys of
//! one hash slot only, so the merging is per hash slot: the batches (or a batch's hash-slot
//! groups) of concurrent requests whose keys share a hash slot share that hash slot's calls,
//! in the same way, and the calls of different hash slots go out side by side.
//!
//! - **GCRA**: one string key, `<key>:v3`, holding the theoretical arrival time, the
//!   emission interval it was counted in, when the key's sanctions end (0 for none) and when
//!   its run began (`<tat>:<interval>:<until>:<since>`, microseconds: tollgate_engine's
//!   `algorithm::GcraState`), expiring when the state becomes that of a fresh key. While the
//!   key has a block or a deny the key lives until the later of them ends: the commonest checks read a key's sanctions only when its value says so. A check under another interval (the key's plan
//!   changed, or the limit was reloaded with another quota) first carries the units the key
//!   used to its own interval, as `tollgate_engine::algorithm::gcra_carry` does. Fixed windows
//!   and sliding logs keep their state under keys of their own (below).
//! - **Fixed window**: `INCRBY` on `<key>:<window index>`; the TTL is set by the first write of
//!   the window only. The window is the one that holds the server's `TIME`, which the client
//!   cannot know exactly: it declares the keys of its estimate's window and the next (its
//!   estimate is the local clock corrected by the server time of the last answer). If the
//!   server's window is neither, the script writes nothing and answers with its time, and the
//!   call is made once more for it.
//! - **Sliding log**: a sorted set at `<key>:log` with one unique member per admitted unit
//!   (`<now>-<seq>`, the sequence kept in `<key>:seq`, so two units in the same microsecond
//!   are two members), trimmed when written of the entries older than the longest period of
//!   the limit's quotas (a plan of a longer period still counts them) and of all but the
//!   newest 2 × `MAX_LOG_UNITS`. A check adds its members with one `ZADD` per
//!   1,000 (a refund removes them likewise), and a quota counts at most
//!   [`MAX_LOG_UNITS`](tollgate_engine::MAX_LOG_UNITS) units: a larger quota is refused when
//!   the limit is built, and a check costlier than its quota is refused as
//!   [`CostTooHigh`](tollgate_engine::Status::CostTooHigh) before anything is written.
//!
//! # Keys
//!
//! `<prefix>:<limit name>:{<digest>}`, where the digest is the first 16 bytes of SHA-256 over
//! `"tollgate/v1\0" ‖ u32be(len name) ‖ name ‖ u32be(len key) ‖ key`, in lowercase hex — or of
//! HMAC-SHA256 of the same bytes under a secret, given
//! [`key_secret`](RedisBackendBuilder::key_secret) (the same on every replica). Raw
//! identities never reach Redis, keys have a fixed length, and one limit's key cannot be
//! another's. The reports of refused clients (below `<prefix>:top:`) hold what the layer's
//! `KeyExtractor::identity_of` names them by: a fingerprint unless the limit's extractor was
//! told to reveal identities. `docs/operations.md` ("What Redis holds") says what a reader of
//! Redis learns. The cluster hash tag wraps the digest, so identities spread over the hash slots.
//! The digests of recently checked pairs are remembered (1,024 of them, about 120 KB per
//! backend), so a client that comes back is not digested again.
//! Each algorithm keeps its state under keys of its own (above), so a limit whose algorithm
//! changes under the same name starts afresh instead of finding a key of another type.
//! All of a key's keys share the hash tag, so a cluster routes them to one hash slot. Every
//! key a script touches is declared in its `KEYS` (in the cross-slot form below, passed as
//! arguments), but one: a key's sanctions, `<key>:pb` (refusals toward a penalty, a block, a
//! deny), which the checks (`check.lua`, and `check_lean.lua` when the key's value says it has
//! sanctions) read and write without declaring it. It shares the key's hash slot; declaring
//! it would make every check of a key whose hash slot is migrating answer `TRYAGAIN` (the node
//! rarely holds a `:pb`, and Redis refuses a call that declares keys it has only in part),
//! whereas undeclared, such a check goes on without the sanctions for that moment (see
//! docs/operations.md). Redis lets a script touch a key it does not declare in the node's hash
//! slots; a server that refuses undeclared keys cannot run the checks. The operators' scripts
//! (a peek, a reset, a deny, an undeny) declare it.
//!
//! # Redis Cluster
//!
//! The checks bound for one node share its merged calls, whatever their hash slots: on Redis 7
//! and later, `CHECK` runs in a cross-slot form (flagged `allow-cross-slot-keys`) that
//! declares one key, by which the call is routed, and takes the others as arguments; it goes
//! on a connection of its own per node, as on a standalone server. The backend reads the slot
//! map (`CLUSTER SLOTS`) on its first call and again when a call meets a hash slot that
//! moved. Such a call has run nothing (a redirection of its declared key), or has failed
//! before it wrote anything (the script reads every key before it writes one, and a key the
//! node does not serve fails that read): its checks are sent again, once, by hash slot, as
//! below. A call of the commonest kind (every request one GCRA check, with no penalty, on a
//! key of its own) runs the requests whose keys the node serves and sends only the others
//! again. A server that refuses to load the flagged script (Redis before 7) is detected when
//! its connection is made, and its checks keep a call per hash slot; so do clusters reached
//! over TLS, and calls at a test's fixed time.
//!
//! A batch whose keys fall on several nodes (or, where a node's call cannot be made, in
//! several hash slots) becomes one group per node (or hash slot), each waiting for its next
//! merged call, concurrently. If any refuses (or fails), the
//! calls that wrote are refunded by a second script
//! that undoes exactly their writes (GCRA: the TAT moves back by `cost` units of the interval it
//! is stored under then, which a check of another plan may have carried it to; fixed window:
//! `DECRBY`; sliding log: `ZREM` of the members added). The consume and the refund run in a task
//! of their own, so a caller that gives up at its deadline does not leave them half done.
//! Between the two, the units are held: a check of the same key that runs meanwhile (another
//! request, or a waiter of a queued limit checked again while its slots are full) sees them
//! used and may be refused for them. This errs toward limiting, for one round trip.
//!
//! A call per hash slot goes on the shared connection. The cluster client routes each call by its keys' hash slot, and when a hash slot moves (`MOVED`, or
//! `ASK` while it migrates) it sends that call again to the node named, after `ASKING` for an
//! `ASK`: a redirected script has not run, so nothing is counted twice, and the other hash slots'
//! calls are not touched. Calls bound for one node share one connection to it, so those sent
//! together reach Redis in one write and come back in one read. (A pipeline of several hash slots'
//! calls is not used: redis-rs sends a whole pipeline again when one of its commands is
//! redirected, which would run the other hash slots' scripts twice.)
//!
//! The cost of this, compared with one atomic script:
//!
//! - Between a group's consume and its refund (about one round trip), other requests see its
//!   units as taken and may be refused although they would have fit: under-admission, bounded
//!   by the cost of the refused batches in flight. A denial that such a request brings into
//!   the local deny cache is dropped when the refund succeeds, on the replica that refunded;
//!   another replica's cache keeps it for at most the deny cache's TTL, so that replica may
//!   refuse for that long an identity whose quota the refund reopened.
//! - A group made only of shadow checks never fails the batch: if it fails, or has not answered
//!   a tenth of the deadline before the request's deadline, its checks are not checked and the
//!   enforced groups' answers stand.
//! - Over-admission is bounded by one request's cost per limit and refund, and only in one
//!   case: a GCRA key that idles between the consume and the refund long enough for the
//!   consumed units to have drained anyway (the refund then gives back time that was not owed).
//!   Fixed windows and sliding logs are refunded exactly.
//! - If a refund itself fails (Redis down at that moment), the units stay consumed until they
//!   expire: under-admission again, never over-admission.
//!
//! # Redis Sentinel
//!
//! [`RedisBackendBuilder::sentinel`] takes the master's name and the sentinels' URLs. Each
//! connection attempt asks the sentinels for the master (and checks that it says it is one);
//! from there it is a standalone server, merged calls included. The connection is replaced,
//! and the master looked up again, when it breaks (the master died) or when the server answers
//! `READONLY` (it was demoted to a replica, and its connections may stay open). Between the
//! master's death and the promotion of a replica, which takes at least the sentinels'
//! `down-after-milliseconds`, checks fail as `Unavailable` and each limit applies its failure
//! policy; admissions the old master acknowledged but had not yet copied to the replica are
//! lost with it (Redis replication is asynchronous), so the promoted replica may admit up to
//! that many more.
//! # TLS and credentials
//!
//! A URL may carry an ACL user and password (`redis://app:secret@host:6379/`, or
//! `redis://:secret@host/` for `requirepass`); every connection logs in with them, the merged
//! calls' own connection included. No `Debug` output, error or log line of this crate shows a
//! password: URLs are shown as `redis://app:***@host:6379/` ([`redact_url`] does the same for
//! an application's own banner).
//!
//! `rediss://` URLs (standalone, cluster seeds, sentinels) need the `tls` feature, built on
//! rustls with its `ring` provider (installed as the process's default unless the application
//! installed one): the server's certificate is checked against the webpki roots, or only
//! against the CA given to [`RedisBackendBuilder::tls_ca_pem`]; a client certificate for
//! servers with `tls-auth-clients yes` goes to [`RedisBackendBuilder::tls_client_cert_pem`].
//! Over TLS every call uses the shared connection (the merged calls share calls as they do on
//! plain TCP, without a connection of their own). Without the feature, a `rediss://` URL is
//! [`BuildError::TlsNotEnabled`].
//!
//! ```toml
//! tollgate-redis = { version = "0.1", features = ["tls"] }
//! ```
//!
//! # Settles
//!
//! [`Backend::settle`](tollgate_engine::Backend::settle) (the layer's metered limits) gives back
//! or consumes the difference between what admitted checks reserved and what they cost, with
//! the arithmetic of the in-memory backend (see `tollgate_engine::Settlement`), in one `SETTLE`
//! call: on a standalone server merged with the settles that arrive while one is in flight
//! (a lone settle is sent at once), in a cluster one call per hash slot. It is sent from a task
//! and nobody waits for it; a settle that fails, or finds the breaker open, leaves the
//! reservations as they were. A verdict's receipt (the server's time of the check, a window's
//! end, a log's last sequence number) tells the settle where the units went. A settle that
//! gives units back clears this replica's cached denial of the key.
//! `RedisBackend::settle_at` (feature `testing`) is the same call, awaited, for tests.
//!
//! # Failures
//!
//! Every check has a deadline (default 50 ms, counted from when the check is made, waiting for
//! a merged call and connecting included): a slow answer is a
//! [`BackendErrorKind::Timeout`](tollgate_engine::BackendErrorKind::Timeout); an unreachable or
//! unusable server is `Unavailable`; an answer that makes no sense is `Protocol`. Building the
//! backend makes no connection: the first call connects in the background, and a broken
//! connection is replaced on the next call, so an application boots while Redis is down and its
//! limits apply their failure policy until Redis is back. A check call that times out also
//! closes the connection it was sent on (its reply, should it come, would otherwise be read as
//! the next call's); the next call connects again.
//!
//! A call that timed out may still reach Redis and take effect later (a server that was only
//! slow runs the script when it catches up): a timeout can consume units the caller never saw
//! admitted, which errs on the side of limiting.
//!
//! A check this process could not send in time is
//! [`BackendErrorKind::Overloaded`](tollgate_engine::BackendErrorKind::Overloaded): more than
//! 8,192 checks already waiting for a merged call, or a deadline that passed while the check
//! waited for one (it is then not sent, so it consumes nothing). Redis was not asked, so
//! neither the breaker nor `tollgate_backend_up` hears of it.
//!
//! A circuit breaker opens after 3 consecutive failed calls (configurable) and then fails
//! checks at once with `CircuitOpen`, without paying the deadline. It counts calls, not
//! requests: a merged call that carried 64 requests and failed is one failure, and one that
//! was answered one success. After 250 ms one call probes Redis; success closes the breaker,
//! failure keeps it open twice as long, up to 5 s.
//!
//! # The local deny cache
//!
//! When Redis denies an enforced check until T, later batches with that (limit, key) are
//! refused locally until T: each check with a cached denial reports `Denied` with the time
//! left (so the refusal's `Retry-After` is the longest of them), the other checks of the batch
//! [`NotChecked`](tollgate_engine::Status::NotChecked), and Redis is not called. A denial covers
//! requests of its cost and costlier ones, which wait longer by what each unit adds (a GCRA
//! interval; nothing in a fixed window); a sliding log's costlier requests ask Redis. An
//! admission that used the last unit of a GCRA or fixed-window limit foretells its denial, which
//! is cached the same way; and when a denial runs out, one request asks Redis while the others
//! wait for its answer (at most one deadline), and go on waiting, one asker at a time, until
//! Redis reports room for all of those held back. A flood on one identity then costs Redis about
//! one call per admitted request per replica, and none for the refused ones. A denial is
//! answered locally for at most [`deny_cache_ttl`](RedisBackendBuilder::deny_cache_ttl) (1 s by
//! default), then one request asks Redis again: a reset or a raised quota on another replica
//! is seen here within that time, at the cost of about one call per second per flooded key and
//! replica. The cache is bounded
//! (10,000 entries by default; at capacity expired entries are dropped and, if it is still full,
//! new denials are not cached) and holds digests, never keys.
//!
//! # Quota leases
//!
//! A limit with a [`Lease`](tollgate_engine::Lease) is leased to each replica in slices (by
//! [`Leased`](tollgate_engine::leased::Leased) over the Redis calls, timed by the estimate of
//! the server's clock): a check that finds no slice in hand asks Redis for the request's cost
//! and a slice more, in the same all-or-nothing `CHECK`, and later checks of the key are
//! admitted from the slice without a call (marked by
//! [`Verdicts::from_lease`](tollgate_engine::Verdicts::from_lease)). Redis counts every unit
//! before it is admitted, so over-admission is 0 across replicas; the shortfall is at most the
//! units held in slices. A slice in hand answers before the deny cache and while Redis is down;
//! a slice's answer never fills the deny cache. Unused units go back with a `SETTLE` refund
//! when a slice expires (its lifetime, its fixed window's end, or the pace of its GCRA TAT)
//! and at [`Lifecycle::shutdown`](tollgate_engine::Lifecycle::shutdown), which resolves once
//! Redis has answered them; a GCRA refund applies only while the key's TAT is still the one the
//! take left (otherwise other slices, paced by TATs that count these units, could run ahead of
//! the rate, and the units refill with the TAT instead). See `docs/leases.md` for the bound and
//! the simulation that measures it.
//!
//! # Metrics
//!
//! `tollgate_backend_duration_seconds{backend="redis"}` (histogram, per request sent to Redis),
//! `tollgate_backend_up{backend="redis"}` (gauge, 1 after an answer, 0 after a failure) and
//! `tollgate_deny_cache_hits_total{limit}`. No label ever holds a key.

mod admin;
mod backend;
mod builder;
mod checks;
mod cluster;
mod denials;
mod deny_cache;
mod digests;
mod dispatch;
mod error;
mod failure;
mod few;
mod future;
mod inner;
mod keys;
mod pending;
mod reports;
mod scripts;
mod settle;
mod slots;
mod time;
mod tls;
mod transport;
mod url;

pub use backend::RedisBackend;
pub use builder::{
    RedisBackendBuilder, DEFAULT_DEADLINE, DEFAULT_DENY_CACHE_CAPACITY, DEFAULT_DENY_CACHE_TTL,
    DEFAULT_PREFIX, MAX_DEADLINE, MAX_DENY_CACHE_TTL, MIN_KEY_SECRET_LEN,
};
pub use error::BuildError;
pub use future::CheckFuture;
pub use tls::redact_url;
pub use transport::breaker::CircuitState;
