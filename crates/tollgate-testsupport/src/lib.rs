//! Test support: real Redis servers on loopback.
