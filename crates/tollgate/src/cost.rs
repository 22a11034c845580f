//! Costs that come from the request, and settling them after the response.
//!
//! A limit added with [`RateLimitLayerBuilder::metered`](crate::RateLimitLayerBuilder::metered)
//! takes a [`Metered`]: where its cost comes from, and how the units it reserved when the
//! request was admitted are settled once the inner service has answered.
//!
//! - **The cost** of each request is [`Metered::cost_from`] a function of the request's parts
//!   (a header, `content-length`, a typed extension), or [`Metered::header`]. A cost that is
//!   not a whole number of units (absent, not a number, negative, above `u32::MAX`) refuses
//!   the request with `400 Bad Request` ([`RejectionKind::InvalidCost`]) and consumes nothing
//!   anywhere. A cost above what the limit can ever admit is refused with 429 and no
//!   `Retry-After` ([`DenyReason::CostTooHigh`]), as for a fixed cost. A cost of 0 is admitted
//!   and takes nothing, except on a concurrency limit: a request in flight holds at least one
//!   slot, so a cost of 0 there is refused as an invalid cost (400, nothing consumed).
//! - **Refund by outcome**: with [`Metered::count_if`], a response for which the predicate is
//!   `false` gives the whole reservation back (only 401s count for a login limit; 5xx answers
//!   do not count).
//! - **Charge the actual cost**: with [`Metered::charged_by_handler`], the reservation is an
//!   estimate and the handler reports the actual cost, through the [`Settle`] handle it finds
//!   in the request's extensions (usable until the response body ends: a streamed answer knows
//!   its count only at the end), or with a [`Charge`] in the response's extensions. Settling
//!   consumes or refunds the difference; a cost above what was left puts the key into debt
//!   (see [`Settlement`](tollgate_engine::Settlement) for each algorithm). A handler that
//!   reports nothing keeps the reservation.
//! - **A request dropped before it answered** (the client went away) keeps its reservation by
//!   default, or gives it back under [`OnDrop::Refund`]. A response whose body is dropped
//!   before its end settles with what the handler reported by then.
//!
//! The settle is one more backend call, sent when the cost is known: when the response head
//! comes if nothing waits for the body, otherwise when the body ends or is dropped. It never
//! delays the response: the backend sends it and does not wait.
//!
//! The response's [`Decision`] and `RateLimit` fields are written with the head. When the
//! actual cost is known by then (a `count_if`, a [`Charge`], or the handle charged before the
//! handler returned) they show the settled state: the units left and, for GCRA, the reset, as
//! the settle leaves them (a key in debt has 0 left). A cost reported while the body streams
//! comes after the head: the head shows the state after the reservation. The handler's own
//! `Decision` (in the request's extensions) always shows the reservation.
//!
//! [`RejectionKind::InvalidCost`]: crate::RejectionKind::InvalidCost
//! [`DenyReason::CostTooHigh`]: crate::DenyReason::CostTooHigh
//! [`Decision`]: crate::Decision

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use http::{HeaderMap, HeaderName, StatusCode};

use crate::key::RequestView;

type CostFn = Box<dyn Fn(&RequestView<'_>) -> Result<u32, InvalidCost> + Send + Sync>;
type CountFn = Box<dyn Fn(&ResponseView<'_>) -> bool + Send + Sync>;
type ChargeFn = Box<dyn Fn(&ResponseView<'_>) -> Option<u32> + Send + Sync>;

/// A request's cost that is not a whole number of units.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InvalidCost;

impl fmt::Display for InvalidCost {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("the request's cost is not a whole number of units")
    }
}

impl std::error::Error for InvalidCost {}

/// What happens to the reservation of a request dropped before the inner service answered.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum OnDrop {
    /// It keeps its reservation (the default): the work it started may have cost money.
    #[default]
    Keep,
    /// It gives its reservation back.
    Refund,
}

/// The parts of a response a [`Metered::count_if`] predicate reads.
#[derive(Debug, Clone, Copy)]
pub struct ResponseView<'r> {
    status: StatusCode,
    headers: &'r HeaderMap,
    extensions: &'r http::Extensions,
}

impl<'r> ResponseView<'r> {
    pub(crate) fn new<B>(response: &'r http::Response<B>) -> Self {
        Self {
            status: response.status(),
            headers: response.headers(),
            extensions: response.extensions(),
        }
    }

    /// The response's status.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// The response's header fields.
    pub fn headers(&self) -> &'r HeaderMap {
        self.headers
    }

    /// The response's extensions.
    pub fn extensions(&self) -> &'r http::Extensions {
        self.extensions
    }
}

/// The actual cost of a request, put by the handler in its response's extensions (for
/// limits [`charged_by_handler`](Metered::charged_by_handler)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Charge(pub u32);

const UNSET: u64 = u64::MAX;

/// The handle through which a handler reports a request's actual cost, in the request's
/// extensions when one of the layer's limits is
/// [`charged_by_handler`](Metered::charged_by_handler).
///
/// It stays usable until the response body ends (or is dropped): a streamed answer can
/// report its count after its last chunk is produced. The last value reported wins; every
/// limit of the layer charged by the handler settles at it.
///
/// ```
/// # fn f(req: &http::Request<()>) {
/// if let Some(settle) = req.extensions().get::<tollgate::cost::Settle>() {
///     settle.charge(1_250);
/// }
/// # }
/// ```
///
/// Every request that a layer with such a limit admits carries one, also when nothing counts
/// its cost: a request admitted because the backend failed and the limit fails open
/// ([`Outcome::Bypassed`](crate::Outcome::Bypassed)), or one without the limit's key. Its
/// reports then go nowhere, and [`is_counting`](Self::is_counting) says so.
#[derive(Clone)]
pub struct Settle(Arc<Handle>);

struct Handle {
    charged: AtomicU64,
    counting: AtomicBool,
}

impl Settle {
    pub(crate) fn new(counting: bool) -> Self {
        Self(Arc::new(Handle {
            charged: AtomicU64::new(UNSET),
            counting: AtomicBool::new(counting),
        }))
    }

    /// Reports the request's actual cost.
    pub fn charge(&self, units: u32) {
        self.0.charged.store(u64::from(units), Ordering::Release);
    }

    /// What was reported so far.
    pub fn charged(&self) -> Option<u32> {
        u32::try_from(self.0.charged.load(Ordering::Acquire)).ok()
    }

    /// Whether a report settles anything: `false` when no limit charged by the handler
    /// reserved units for this request (it failed open, or had no key for them), so that
    /// what it reports goes nowhere.
    pub fn is_counting(&self) -> bool {
        self.0.counting.load(Ordering::Acquire)
    }

    /// Marks this handle as counting for another layer too.
    pub(crate) fn count(&self) {
        self.0.counting.store(true, Ordering::Release);
    }
}

impl fmt::Debug for Settle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Settle")
            .field("charged", &self.charged())
            .field("counting", &self.is_counting())
            .finish()
    }
}

/// How a limit's cost is found and settled (see the [module](self)).
#[derive(Default)]
pub struct Metered {
    pub(crate) cost: Option<CostFn>,
    pub(crate) count_if: Option<CountFn>,
    pub(crate) by_handler: bool,
    pub(crate) on_drop: OnDrop,
    pub(crate) charge_from: Option<ChargeFn>,
    pub(crate) learns: bool,
}

impl Metered {
    /// The limit's own cost, no settle: add what follows.
    pub fn new() -> Self {
        Self::default()
    }

    /// Each request costs what `cost` answers, instead of the limit's fixed cost. On a
    /// concurrency limit the cost is the slots the request holds, and a cost of 0 is refused
    /// with `400` ([`RejectionKind::InvalidCost`](crate::RejectionKind::InvalidCost)): a
    /// request that held none would pass a full limit.
    pub fn cost_from<F>(mut self, cost: F) -> Self
    where
        F: Fn(&RequestView<'_>) -> Result<u32, InvalidCost> + Send + Sync + 'static,
    {
        self.cost = Some(Box::new(cost));
        self
    }

    /// Each request costs the number in its header `name`: ASCII digits only, at most
    /// `u32::MAX`. Anything else (no such header, a sign, a fraction, spaces, more) is an
    /// [`InvalidCost`].
    pub fn header(self, name: HeaderName) -> Self {
        self.cost_from(move |req| parse_units(req.headers().get(&name).map(|v| v.as_bytes())))
    }

    /// Only responses for which `count` is `true` keep their units; the others give the whole
    /// reservation back.
    pub fn count_if<F>(mut self, count: F) -> Self
    where
        F: Fn(&ResponseView<'_>) -> bool + Send + Sync + 'static,
    {
        self.count_if = Some(Box::new(count));
        self
    }

    /// The reservation is an estimate: the handler reports the actual cost through
    /// [`Settle`] or [`Charge`], and the difference is consumed or given back.
    pub fn charged_by_handler(mut self) -> Self {
        self.by_handler = true;
        self
    }

    /// The reservation is an estimate: the response head says the actual cost, as `charge`
    /// reads it (a usage header an upstream API sends, say), and the difference is consumed
    /// or given back when the head comes. `None` keeps the reservation. With
    /// [`count_if`](Self::count_if), a response it does not count gives everything back.
    ///
    /// ```
    /// use tollgate::cost::{parse_units, Metered};
    ///
    /// // Tokens a model API reports it used.
    /// let tokens = Metered::new().charge_from(|response| {
    ///     parse_units(response.headers().get("x-usage-tokens").map(|v| v.as_bytes())).ok()
    /// });
    /// ```
    pub fn charge_from<F>(mut self, charge: F) -> Self
    where
        F: Fn(&ResponseView<'_>) -> Option<u32> + Send + Sync + 'static,
    {
        self.charge_from = Some(Box::new(charge));
        self
    }

    /// For a layer around a client: when an upstream API's answer says to wait (a `429` or
    /// `503` with `Retry-After`, or `RateLimit` fields with nothing left: see
    /// [`MAX_UPSTREAM_PAUSE`](crate::MAX_UPSTREAM_PAUSE) for the forms read), the request's
    /// key of this GCRA limit is held back until then on every replica sharing the backend
    /// ([`Backend::pause`](tollgate_engine::Backend::pause): one write), and the calls that
    /// follow wait for it in delay mode, or are refused with a `Retry-After` that says so.
    /// Nothing is retried.
    ///
    /// Only a GCRA limit has an emission time to hold back: a layer refuses this on any other
    /// limit at build ([`ConfigError::PauseUnsupported`](tollgate_engine::ConfigError::PauseUnsupported)).
    pub fn pause_from_upstream(mut self) -> Self {
        self.learns = true;
        self
    }

    /// What a request dropped before it answered does with its reservation (default
    /// [`OnDrop::Keep`]).
    pub fn on_drop(mut self, policy: OnDrop) -> Self {
        self.on_drop = policy;
        self
    }

    /// Whether anything is settled after the response.
    pub(crate) fn settles(&self) -> bool {
        self.count_if.is_some()
            || self.by_handler
            || self.on_drop != OnDrop::Keep
            || self.charge_from.is_some()
            || self.learns
    }
}

impl fmt::Debug for Metered {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Metered")
            .field("cost_from_request", &self.cost.is_some())
            .field("count_if", &self.count_if.is_some())
            .field("charged_by_handler", &self.by_handler)
            .field("on_drop", &self.on_drop)
            .field("charge_from", &self.charge_from.is_some())
            .field("pause_from_upstream", &self.learns)
            .finish()
    }
}

/// A whole number of units in ASCII digits, at most `u32::MAX`.
///
/// # Errors
///
/// [`InvalidCost`] for no value, an empty one, or anything but digits, or too large.
pub fn parse_units(value: Option<&[u8]>) -> Result<u32, InvalidCost> {
    let digits = value.filter(|v| !v.is_empty()).ok_or(InvalidCost)?;
    let mut n: u32 = 0;
    for &b in digits {
        if !b.is_ascii_digit() {
            return Err(InvalidCost);
        }
        n = n
            .checked_mul(10)
            .and_then(|n| n.checked_add(u32::from(b - b'0')))
            .ok_or(InvalidCost)?;
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_are_digits_up_to_u32_max() {
        assert_eq!(parse_units(Some(b"0")), Ok(0));
        assert_eq!(parse_units(Some(b"4294967295")), Ok(u32::MAX));
        for bad in [
            &b""[..],
            b"-1",
            b"+1",
            b"1.5",
            b" 1",
            b"4294967296",
            b"99999999999999999999999",
            b"ten",
        ] {
            assert_eq!(parse_units(Some(bad)), Err(InvalidCost), "{bad:?}");
        }
        assert_eq!(parse_units(None), Err(InvalidCost));
    }
}
