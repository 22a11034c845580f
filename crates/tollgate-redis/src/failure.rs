//! Failure mapping: what a Redis error or a full queue become, and which errors break a
//! connection.

use tollgate_engine::{BackendError, BackendErrorKind};

use redis::{ErrorKind, RedisError, ServerErrorKind};

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
pub(crate) fn map_error(e: RedisError) -> BackendError {
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
    BackendError::new(kind, one_line(&e))
}

/// The error's message on one line. A reply that does not parse comes from a server that is
/// not Redis (an HTTP server, a proxy, the wrong port): the parser's own message, over
/// several lines of unexpected bytes, is cut to its first line after saying so.
fn one_line(e: &RedisError) -> String {
    let text = e.to_string();
    let mut lines = text.lines().map(str::trim).filter(|l| !l.is_empty());
    let first: String = lines.next().unwrap_or_default().chars().take(120).collect();
    if e.kind() == ErrorKind::Parse {
        return format!(
            "the server does not answer as Redis does: is it a Redis server? ({first})"
        );
    }
    let rest: Vec<&str> = lines.collect();
    if rest.is_empty() {
        first
    } else {
        format!("{first}; {}", rest.join("; "))
    }
}

/// Whether an error means the connection itself is broken and must be replaced.
///
/// `READONLY` is one of them: the server was demoted to a replica (a Sentinel failover) and
/// the connection to it still works, so nothing else would ever move the backend to the new
/// master. Replacing it makes the next call look the master up again.
pub(crate) fn breaks_connection(e: &RedisError) -> bool {
    e.kind() == ErrorKind::Server(ServerErrorKind::ReadOnly)
        || e.is_io_error()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_unrecoverable_error()
        || e.kind() == ErrorKind::ClusterConnectionNotFound
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
