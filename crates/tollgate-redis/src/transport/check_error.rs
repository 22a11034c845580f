//! A `CHECK` call's failure, before it becomes the backend's error.

use tollgate_engine::BackendError;

use crate::failure::map_error;

/// A `CHECK` call's failure: the backend's error, or Redis' own (which a cluster node's
/// redirection is read from before it becomes the backend's).
pub(crate) enum CheckError {
    Backend(BackendError),
    Redis(redis::RedisError),
}

impl From<BackendError> for CheckError {
    fn from(e: BackendError) -> Self {
        Self::Backend(e)
    }
}

impl From<redis::RedisError> for CheckError {
    fn from(e: redis::RedisError) -> Self {
        Self::Redis(e)
    }
}

impl CheckError {
    /// The backend's error for it.
    pub(crate) fn into_backend(self) -> BackendError {
        match self {
            Self::Backend(e) => e,
            Self::Redis(e) => map_error(e),
        }
    }
}
