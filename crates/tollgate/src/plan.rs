//! The request's plan: the name that chooses each limit's quota.

use std::fmt;
use std::sync::Arc;

/// The plan of a request (`free`, `pro`, a contract's name), put in the request's extensions
/// by the authentication layer in front of the rate limit.
///
/// Each limit maps plan names to quotas ([`Limit::plan`](crate::Limit::plan)); a request with
/// no plan, or a plan the limit does not name, gets the limit's default quota. The plan is
/// read once per request; cloning it is a reference count.
///
/// # Examples
///
/// ```
/// use tollgate::Plan;
///
/// let mut req = http::Request::new(());
/// req.extensions_mut().insert(Plan::new("pro"));
/// assert_eq!(req.extensions().get::<Plan>().map(Plan::as_str), Some("pro"));
/// ```
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Plan(Arc<str>);

impl Plan {
    /// The plan named `name`.
    pub fn new(name: impl Into<Arc<str>>) -> Self {
        Self(name.into())
    }

    /// The plan's name.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Plan").field(&&*self.0).finish()
    }
}

impl fmt::Display for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<&str> for Plan {
    fn from(name: &str) -> Self {
        Self::new(name)
    }
}
