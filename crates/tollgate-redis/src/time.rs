//! Where a backend's time comes from: the estimate of the server's `TIME`, or a test's clock.

use std::sync::Arc;

use tollgate_engine::{Clock, FakeClock, Micros};

use crate::transport::Transport;

/// A backend's time: what its quota leases time slices by and, for a test's clock, the time
/// every call is made at.
#[derive(Clone)]
pub(crate) enum Time {
    /// The client's estimate of the server's `TIME` (see `transport::clock`); calls let the
    /// server read its own.
    Server(Arc<Transport>),
    /// A test's clock (`RedisBackendBuilder::clock`): every call is made at its time.
    Test(FakeClock),
}

impl Time {
    /// The time to make a call at: `None` for the server's own.
    pub(crate) fn call_time(&self) -> Option<Micros> {
        match self {
            Self::Server(_) => None,
            Self::Test(clock) => Some(clock.now()),
        }
    }
}

impl Clock for Time {
    fn now(&self) -> Micros {
        match self {
            Self::Server(transport) => transport.server_time(),
            Self::Test(clock) => clock.now(),
        }
    }
}
