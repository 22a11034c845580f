//! Redis backend for tollgate.
