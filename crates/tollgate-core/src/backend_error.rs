//! Why a backend could not answer.

use std::fmt;

/// Why a backend could not answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum BackendErrorKind {
    /// No answer within the deadline.
    Timeout,
    /// The backend could not be reached or answered with an error.
    Unavailable,
    /// The circuit breaker is open: the backend failed recently and is not being called.
    CircuitOpen,
    /// The backend answered something that could not be understood.
    Protocol,
    /// This process had more checks waiting for the backend than it could send by their
    /// deadline (a full queue, or a deadline that passed before the check was sent): the
    /// backend was not asked, and says nothing about its health.
    Overloaded,
    /// The backend does not offer what was asked (see [`Backend::peek`](crate::Backend::peek) and
    /// [`Backend::reset`](crate::Backend::reset)).
    Unsupported,
}

/// A backend that could not answer a batch.
#[derive(Debug, Clone)]
pub struct BackendError {
    kind: BackendErrorKind,
    message: String,
}

impl BackendError {
    /// An error of `kind`, described by `message`.
    pub fn new(kind: BackendErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
        }
    }

    /// What went wrong.
    pub fn kind(&self) -> BackendErrorKind {
        self.kind
    }

    /// Whether the deadline passed.
    pub fn is_timeout(&self) -> bool {
        self.kind == BackendErrorKind::Timeout
    }

    /// Whether the circuit breaker refused the call.
    pub fn is_circuit_open(&self) -> bool {
        self.kind == BackendErrorKind::CircuitOpen
    }

    /// Whether the check was not sent because this process had too many waiting.
    pub fn is_overloaded(&self) -> bool {
        self.kind == BackendErrorKind::Overloaded
    }

    /// A fixed label for metrics: `timeout`, `error`, `circuit_open`, `protocol`,
    /// `overloaded` or `unsupported`.
    pub fn reason(&self) -> &'static str {
        match self.kind {
            BackendErrorKind::Timeout => "timeout",
            BackendErrorKind::Unavailable => "error",
            BackendErrorKind::CircuitOpen => "circuit_open",
            BackendErrorKind::Protocol => "protocol",
            BackendErrorKind::Overloaded => "overloaded",
            BackendErrorKind::Unsupported => "unsupported",
        }
    }
}

impl fmt::Display for BackendError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rate-limit backend {}: {}", self.reason(), self.message)
    }
}

impl std::error::Error for BackendError {}

/// The error of an operation `backend` does not offer.
pub fn unsupported(backend: &str, what: &str) -> BackendError {
    BackendError::new(
        BackendErrorKind::Unsupported,
        format!("the {backend} backend cannot {what} this key"),
    )
}
