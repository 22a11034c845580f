//! Failure mapping: what a Redis error, a missed deadline or a full queue become.

use std::future::Future;

use tokio::time::Instant;
use tollgate_core::{BackendError, BackendErrorKind};

use crate::backend::Inner;
use crate::conn::breaks_connection;

impl Inner {
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

    pub(crate) fn timed_out(&self, what: &str) -> BackendError {
        BackendError::new(
            BackendErrorKind::Timeout,
            format!("no answer {what} within {:?}", self.deadline),
        )
    }
}

pub(crate) fn unavailable(msg: impl Into<String>) -> BackendError {
    BackendError::new(BackendErrorKind::Unavailable, msg)
}

/// A check that this process did not send, having too many waiting: Redis was not asked, so
/// its breaker and health gauge must not hear of it.
pub(crate) fn overloaded(msg: impl Into<String>) -> BackendError {
    BackendError::new(BackendErrorKind::Overloaded, msg)
}

/// Sorts a Redis error into the backend's kinds: the server could not be used
/// (`Unavailable`), did not answer in time (`Timeout`), or answered nonsense (`Protocol`).
pub(crate) fn map_error(e: redis::RedisError) -> BackendError {
    use redis::{ErrorKind, ServerErrorKind};
    let kind = if e.is_timeout() {
        BackendErrorKind::Timeout
    } else if breaks_connection(&e)
        || e.is_cluster_error()
        || matches!(
            e.code(),
            Some("BUSY" | "LOADING" | "MASTERDOWN" | "READONLY")
        )
    {
        BackendErrorKind::Unavailable
    } else {
        match e.kind() {
            ErrorKind::AuthenticationFailed
            | ErrorKind::InvalidClientConfig
            // The sentinels name no master that answers as one (mid-failover), or none answers.
            | ErrorKind::MasterNameNotFoundBySentinel
            | ErrorKind::NoValidReplicasFoundBySentinel
            | ErrorKind::EmptySentinelList
            | ErrorKind::Server(
                ServerErrorKind::BusyLoading
                | ServerErrorKind::MasterDown
                | ServerErrorKind::ReadOnly
                | ServerErrorKind::NoPerm,
            ) => BackendErrorKind::Unavailable,
            _ => BackendErrorKind::Protocol,
        }
    };
    BackendError::new(kind, e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sentinels_that_name_no_usable_master_mean_redis_is_unavailable() {
        // Between a master's death and its replica's promotion the sentinels name the dead
        // master, which fails its check: Redis is down, not answering nonsense (a `Protocol`
        // error would count as an answer and close the breaker).
        for kind in [
            redis::ErrorKind::MasterNameNotFoundBySentinel,
            redis::ErrorKind::NoValidReplicasFoundBySentinel,
            redis::ErrorKind::EmptySentinelList,
        ] {
            let e = map_error(redis::RedisError::from((kind, "no master")));
            assert_eq!(e.kind(), BackendErrorKind::Unavailable, "{kind:?}");
        }
    }
}
