//! Operators' calls on a layer: one client's state under one limit, read (`peek`) or
//! forgotten (`reset`), named as requests name it; and who a limit refuses most
//! (`top_refused`).

use std::fmt;
use std::time::Duration;

use tollgate_engine::{
    Backend, BackendError, BackendErrorKind, Check, KeyState, Refused, MAX_DENY,
};

use super::layer::RateLimitLayer;
use super::report::named;
use crate::key::{Identity, IdentityError};

/// Why [`RateLimitLayer::peek`] or [`RateLimitLayer::reset`] could not answer.
#[derive(Clone)]
#[non_exhaustive]
pub enum AdminError {
    /// The layer has no limit of this name.
    UnknownLimit(String),
    /// The limit has no plan of this name.
    UnknownPlan(String),
    /// No request could have this identity under the limit's key extractor (a name for a
    /// limit keyed by client address, a name with characters tenants cannot have): the
    /// identity, the limit and why.
    Identity(IdentityError),
    /// The backend failed, or does not offer the operation (a concurrency limit's reset).
    Backend(BackendError),
    /// A [`deny`](RateLimitLayer::deny) longer than [`MAX_DENY`] (100 years): refused, never
    /// shortened.
    DenyTooLong(Duration),
}

/// The words of `Display`: `main() -> Result<(), Box<dyn Error>>` prints an error with
/// `Debug`, and a person reading it needs what is wrong and how to fix it.
impl fmt::Debug for AdminError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl fmt::Display for AdminError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::UnknownLimit(name) => write!(f, "no limit named {name:?}"),
            Self::UnknownPlan(name) => write!(f, "no plan named {name:?}"),
            Self::Identity(e) => e.fmt(f),
            Self::Backend(e) => e.fmt(f),
            Self::DenyTooLong(d) => write!(
                f,
                "a deny lasts at most {} s (100 years, MAX_DENY), not {} s",
                MAX_DENY.as_secs(),
                d.as_secs()
            ),
        }
    }
}

impl std::error::Error for AdminError {}

impl<B: Backend> RateLimitLayer<B> {
    /// The state of `identity` under the limit named `limit`, with the limit's default quota,
    /// read without consuming anything: what its next request of one unit would find.
    ///
    /// `identity` is whom requests are counted as: an address for a [`ClientIp`] limit
    /// (grouped as the extractor groups it: any address of an IPv6 /64 is the same client), a
    /// tenant's or a principal's name (see [`KeyExtractor::key_of`]). The backend hashes it
    /// as it hashes requests' keys; nobody handles key bytes.
    ///
    /// ```
    /// use std::net::IpAddr;
    /// use tollgate::key::ClientIp;
    /// use tollgate::{Limit, Quota, RateLimitLayer};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let layer = RateLimitLayer::builder()
    ///     .limit(Limit::gcra("per-ip", Quota::per_minute(60)?)?, ClientIp::peer())
    ///     .build()?;
    /// let ip: IpAddr = "203.0.113.7".parse()?;
    /// assert_eq!(layer.peek("per-ip", ip).await?.remaining, 60);
    /// layer.reset("per-ip", ip).await?;
    /// # Ok(()) }
    /// ```
    ///
    /// [`ClientIp`]: crate::key::ClientIp
    /// [`KeyExtractor::key_of`]: crate::key::KeyExtractor::key_of
    ///
    /// # Errors
    ///
    /// An [`AdminError`]: no such limit, an identity the limit's keys cannot be, or the
    /// backend's error.
    pub async fn peek(
        &self,
        limit: &str,
        identity: impl Into<Identity>,
    ) -> Result<KeyState, AdminError> {
        self.peek_plan(limit, None, identity).await
    }

    /// [`peek`](Self::peek) under the quota of `plan` (`None`: the default quota).
    ///
    /// # Errors
    ///
    /// As [`peek`](Self::peek), and [`AdminError::UnknownPlan`].
    pub async fn peek_plan(
        &self,
        limit: &str,
        plan: Option<&str>,
        identity: impl Into<Identity>,
    ) -> Result<KeyState, AdminError> {
        let identity = identity.into();
        let answer = self.with_check(limit, plan, &identity, |backend, check| {
            match backend.admin() {
                Some(admin) => admin.peek(check),
                None => unsupported_now(backend.kind(), "peek"),
            }
        })?;
        answer.await.map_err(AdminError::Backend)
    }

    /// Forgets what `identity` has used under the limit named `limit` (after a false
    /// positive, say): its next request finds the whole quota. The backend's state of the key
    /// is removed, and so is this replica's cached denial of it (a Redis backend's deny
    /// cache; other replicas' expire on their own, within the cache's lease). A block of the
    /// limit's [penalty box](tollgate_engine::Penalty) is lifted; a [`deny`](Self::deny) is not.
    ///
    /// A concurrency limit cannot be reset: its slots are requests still in flight, given back
    /// as they end.
    ///
    /// # Errors
    ///
    /// As [`peek`](Self::peek); `AdminError::Backend` with
    /// [`BackendErrorKind::Unsupported`](tollgate_engine::BackendErrorKind::Unsupported) for
    /// a concurrency limit.
    pub async fn reset(
        &self,
        limit: &str,
        identity: impl Into<Identity>,
    ) -> Result<(), AdminError> {
        let identity = identity.into();
        let answer = self.with_check(limit, None, &identity, |backend, check| {
            match backend.admin() {
                Some(admin) => admin.reset(check),
                None => unsupported_now(backend.kind(), "reset"),
            }
        })?;
        answer.await.map_err(AdminError::Backend)
    }

    /// Refuses `identity` under the limit named `limit` for `duration`, on every replica
    /// that shares the backend: `403` ([`Outcome::Denylisted`](crate::Outcome::Denylisted),
    /// counted as `outcome="denylisted"`) with a `Retry-After` to the deny's end, whatever the
    /// request's cost or plan, and nothing consumed. A replica whose deny cache or leased
    /// slice answers the key refuses it once that answer runs out (the cache's TTL, 1 s by
    /// default; the lease's lifetime). A [`reset`](Self::reset) leaves a deny in place; the
    /// layer's allowlist still wins over it. The static [`Denylist`](crate::Denylist) is the
    /// layer's own; this one lives in the backend.
    ///
    /// ```
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// use std::time::Duration;
    /// use tollgate::{key::ClientIp, Limit, Quota, RateLimitLayer};
    ///
    /// let layer = RateLimitLayer::builder()
    ///     .limit(Limit::gcra("per-ip", Quota::per_minute(60)?)?, ClientIp::peer())
    ///     .build()?;
    /// layer.deny("per-ip", "203.0.113.9", Duration::from_secs(3600)).await?;
    /// layer.undeny("per-ip", "203.0.113.9").await?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// As [`peek`](Self::peek); [`AdminError::DenyTooLong`] for a `duration` past
    /// [`MAX_DENY`] (100 years), nothing changed; `AdminError::Backend` with
    /// [`BackendErrorKind::Unsupported`](tollgate_engine::BackendErrorKind::Unsupported) for a
    /// backend that keeps no denies.
    pub async fn deny(
        &self,
        limit: &str,
        identity: impl Into<Identity>,
        duration: Duration,
    ) -> Result<(), AdminError> {
        if duration > MAX_DENY {
            return Err(AdminError::DenyTooLong(duration));
        }
        let identity = identity.into();
        let answer = self.with_check(limit, None, &identity, |backend, check| {
            match backend.admin() {
                Some(admin) => admin.deny(check, duration),
                None => unsupported_now(backend.kind(), "deny"),
            }
        })?;
        answer.await.map_err(AdminError::Backend)
    }

    /// Lifts a [`deny`](Self::deny) of `identity` under the limit named `limit` (nothing if
    /// there is none): at once on this replica, within the deny cache's TTL on the others.
    ///
    /// # Errors
    ///
    /// As [`deny`](Self::deny).
    pub async fn undeny(
        &self,
        limit: &str,
        identity: impl Into<Identity>,
    ) -> Result<(), AdminError> {
        let identity = identity.into();
        let answer = self.with_check(limit, None, &identity, |backend, check| {
            match backend.admin() {
                Some(admin) => admin.undeny(check),
                None => unsupported_now(backend.kind(), "undeny"),
            }
        })?;
        answer.await.map_err(AdminError::Backend)
    }

    /// `f` of the backend and the check of `identity` under the limit named `limit` (with
    /// `plan`'s quota): the limit set is held only while the check is made.
    fn with_check<T>(
        &self,
        limit: &str,
        plan: Option<&str>,
        identity: &Identity,
        f: impl FnOnce(&B, &Check<'_>) -> T,
    ) -> Result<T, AdminError> {
        let set = self.shared.set.load();
        let entry = set
            .limits
            .iter()
            .find(|e| e.limit.name() == limit)
            .ok_or_else(|| AdminError::UnknownLimit(limit.to_owned()))?;
        let quota = match plan {
            None => *entry.limit.quota(),
            Some(name) => *entry
                .limit
                .plans()
                .find(|(n, _)| *n == name)
                .map(|(_, q)| q)
                .ok_or_else(|| AdminError::UnknownPlan(name.to_owned()))?,
        };
        let key = entry.key.key_of(identity).map_err(|missing| {
            AdminError::Identity(IdentityError::new(limit, identity.clone(), missing))
        })?;
        let check = Check::new(&entry.limit, key.as_bytes()).with_quota(quota);
        Ok(f(&self.shared.backend, &check))
    }
}

/// The answer of a backend that offers no [`Admin`](tollgate_engine::Admin).
fn unsupported_now<T: Send + 'static>(kind: &str, what: &str) -> tollgate_engine::AdminFuture<T> {
    Box::pin(std::future::ready(Err(tollgate_engine::unsupported(
        kind, what,
    ))))
}

impl<B: Backend> RateLimitLayer<B> {
    /// The `n` identities the limit named `limit` refused most, most refused first: over the
    /// current bucket of [`REPORT_BUCKET`](tollgate_engine::REPORT_BUCKET) and the
    /// previous one, across every replica that shares the backend. This replica's refusals
    /// not yet handed to the backend are handed first; other replicas' reach it within a
    /// [`REPORT_TICK`](tollgate_engine::REPORT_TICK) of their next
    /// refusal.
    ///
    /// Each entry names the client as the limit's extractor does ([`KeyExtractor::identity_of`]:
    /// a fingerprint by default, `sk_live_…a1b2` for an API key; an address, an IPv6 `/64`
    /// network, a tenant or a principal where it reveals identities) with its count of
    /// refusals, the
    /// most that count may be over (Space-Saving's error bound, 0 when exact), and when its
    /// refusals were first and last seen.
    ///
    /// ```
    /// use tollgate::key::Global;
    /// use tollgate::{Limit, Quota, RateLimitLayer};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let layer = RateLimitLayer::builder()
    ///     .limit(Limit::gcra("all", Quota::per_minute(60)?)?, Global)
    ///     .build()?;
    /// assert!(layer.top_refused("all", 10).await?.is_empty());
    /// # Ok(()) }
    /// ```
    ///
    /// [`KeyExtractor::identity_of`]: crate::key::KeyExtractor::identity_of
    ///
    /// # Errors
    ///
    /// [`AdminError::UnknownLimit`]; `AdminError::Backend` when the backend keeps no reports
    /// ([`BackendErrorKind::Unsupported`]) or could not answer.
    pub async fn top_refused(&self, limit: &str, n: usize) -> Result<Vec<Refused>, AdminError> {
        let shared = &*self.shared;
        let Some(reports) = shared.backend.reports() else {
            return Err(AdminError::Backend(BackendError::new(
                BackendErrorKind::Unsupported,
                format!("the {} backend keeps no reports", shared.backend.kind()),
            )));
        };
        let (merge, now) = {
            let set = shared.set.load();
            let entry = set
                .limits
                .iter()
                .find(|e| e.limit.name() == limit)
                .ok_or_else(|| AdminError::UnknownLimit(limit.to_owned()))?;
            let (counters, now) = shared.refused.take(limit);
            let merge = (!counters.is_empty())
                .then(|| reports.merge(limit, shared.refused.keep(), named(entry, counters), now));
            (merge, now)
        };
        if let Some(merge) = merge {
            merge.await.map_err(AdminError::Backend)?;
        }
        reports
            .top(limit, n, now)
            .await
            .map_err(AdminError::Backend)
    }
}
