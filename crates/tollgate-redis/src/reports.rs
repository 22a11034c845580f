//! The reports of refused identities (`Reports`): per limit and bucket of
//! [`REPORT_BUCKET`], a sorted set of counts and a hash of when each identity was seen, under
//! `<prefix>:top:{<limit>}:<bucket>` (the hash tag keeps a limit's buckets in one hash slot).
//!
//! A merge is one `EVAL` that adds each counter to the bucket's summary as Space-Saving does,
//! as the in-memory backend's board: a known identity adds to its counter (`ZINCRBY`), a new
//! one takes a free counter or, once `keep` are taken, the smallest, whose count it inherits
//! as its error; then `PEXPIRE` to two buckets. A replica makes it at most once per limit and
//! tick, never per refusal. A read is one `EVAL` of the current and previous buckets, merged
//! here. Both have the backend's deadline; neither goes through the breaker.
//!
//! The identities are stored as the layer names them (`KeyExtractor::identity_of`): a
//! fingerprint by default, an address or a tenant only where the limit's extractor was told to
//! reveal identities. They live two buckets.

use std::sync::Arc;

use redis::Value;
use tollgate_engine::{bucket_of, combine, REPORT_BUCKET};
use tollgate_engine::{BackendError, Micros, Refused};

use crate::failure::map_error;
use crate::scripts::top;
use crate::transport::Transport;

/// The calls of one backend's reports, on its transport.
pub(crate) struct Reports {
    transport: Arc<Transport>,
    prefix: String,
}

impl Reports {
    pub(crate) fn new(transport: Arc<Transport>, prefix: String) -> Self {
        Self { transport, prefix }
    }

    /// Adds `refused` to `limit`'s report for the bucket of `now`.
    pub(crate) async fn merge(
        &self,
        limit: &str,
        keep: usize,
        refused: &[Refused],
        now: Micros,
    ) -> Result<(), BackendError> {
        if refused.is_empty() {
            return Ok(());
        }
        let keys = top::keys(&self.prefix, limit, bucket_of(now));
        let life = 2 * REPORT_BUCKET.as_millis() as u64;
        self.call(
            &top::merge(&keys, keep, life, refused),
            "to report refusals",
        )
        .await
        .map(|_| ())
    }

    /// The `n` most refused of `limit` in the bucket of `now` and the one before.
    pub(crate) async fn top(
        &self,
        limit: &str,
        n: usize,
        now: Micros,
    ) -> Result<Vec<Refused>, BackendError> {
        let bucket = bucket_of(now);
        let current = top::keys(&self.prefix, limit, bucket);
        let previous = top::keys(&self.prefix, limit, bucket.saturating_sub(1));
        let reply = self
            .call(&top::read(&current, &previous), "to read refusals")
            .await?;
        Ok(combine(top::parse_read(&reply)?, n))
    }

    async fn call(&self, cmd: &redis::Cmd, what: &str) -> Result<Value, BackendError> {
        self.transport
            .within_deadline(
                async { self.transport.query_raw(cmd).await.map_err(map_error) },
                what,
            )
            .await
    }
}
