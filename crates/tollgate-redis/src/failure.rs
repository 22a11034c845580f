//! Failure mapping: what a Redis error or a full queue become.

use tollgate_core::{BackendError, BackendErrorKind};

use crate::transport::conn::breaks_connection;

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
