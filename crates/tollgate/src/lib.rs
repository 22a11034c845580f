//! Rate limiting for tower and axum.
