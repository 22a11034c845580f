//! What an admitted request owes its metered limits, from the decision to the settle.
//!
//! An [`Owed`] is made when a request with metered limits is admitted. It travels in the
//! response future, then (if the actual cost may still be reported) in the response body,
//! and settles when it is dropped: with the request's outcome if the response came, under the
//! limits' [`OnDrop`] policy if it did not.

use std::sync::Arc;

use http::Response;
use tollgate_engine::{Algorithm, Backend, Quota, Receipt, Settlement, MAX_CHECKS};

use super::limits::LimitSet;
use super::state::Shared;
use crate::cost::{Charge, OnDrop, ResponseView, Settle};
use crate::decision::Decision;
use crate::key::Key;

/// What a settle needs of one metered limit's check: the units it reserved, where (its key,
/// its receipt, the limiter that counted it) and under which quota.
pub(crate) struct Reservation {
    /// The limit's index in the layer.
    pub(crate) entry: usize,
    pub(crate) key: Key<'static>,
    /// The units the check reserved.
    pub(crate) units: u32,
    pub(crate) receipt: Receipt,
    /// The quota the check was made under (the request's plan's, or the fallback's share).
    pub(crate) quota: Quota,
    /// Counted by the local fallback limiter, not the backend.
    pub(crate) fallback: bool,
}

/// One metered limit's reservation, and what decides its actual cost.
pub(crate) struct Item {
    pub(crate) reservation: Reservation,
    pub(crate) by_handler: bool,
    pub(crate) on_drop: OnDrop,
    /// What the limit's `count_if` said of the response (`true` until it comes).
    pub(crate) counted: bool,
    /// The actual cost the limit's `charge_from` read in the response head.
    pub(crate) charged: Option<u32>,
}

/// Settles reservations; the layer's shared state, without its backend's type.
pub(crate) trait Settler: Send + Sync + 'static {
    /// Whether the limit at `entry` counts `response`.
    fn counts(&self, entry: usize, response: &ResponseView<'_>) -> bool;

    /// The algorithm of the limit at `entry`.
    fn algorithm(&self, entry: usize) -> Algorithm;

    /// Whether a limit is charged by the handler (its requests then carry a [`Settle`]).
    fn charged_by_handler(&self) -> bool;

    /// The actual cost the limit at `entry` reads in `response`, if it reads one.
    fn charge_of(&self, entry: usize, response: &ResponseView<'_>) -> Option<u32>;

    /// Holds `held`'s key back for as long as `response` asks, if its limit learns from
    /// upstream answers.
    fn pause_for(&self, held: &Reservation, response: &ResponseView<'_>);

    /// Settles each item at its actual cost.
    fn settle(&self, items: &[Item], actual: &[u32]);
}

/// The reservations of one admitted request; settles them when dropped.
pub(crate) struct Owed {
    sink: Arc<dyn Settler>,
    items: Vec<Item>,
    handle: Option<Settle>,
    /// A [`Charge`] found in the response's extensions.
    charged: Option<u32>,
    responded: bool,
}

impl Owed {
    /// The reservations `items`; with a [`Settle`] handle when the layer has a limit charged
    /// by the handler, which counts when one of `items` is.
    pub(crate) fn new(sink: Arc<dyn Settler>, items: Vec<Item>) -> Self {
        let handle = sink
            .charged_by_handler()
            .then(|| Settle::new(items.iter().any(|i| i.by_handler)));
        Self {
            sink,
            items,
            handle,
            charged: None,
            responded: false,
        }
    }

    /// The handle for the request's extensions, if a limit is charged by the handler.
    pub(crate) fn handle(&self) -> Option<&Settle> {
        self.handle.as_ref()
    }

    /// Reads the cost from `outer`, the handle of a layer around this one, so that the one
    /// handle the handler finds reports to both layers.
    pub(crate) fn share(&mut self, outer: &Settle) {
        if let Some(mine) = &self.handle {
            if mine.is_counting() {
                outer.count();
            }
            self.handle = Some(outer.clone());
        }
    }

    /// Takes what the response head says: each limit's `count_if`, and a [`Charge`].
    pub(crate) fn responded<T>(&mut self, response: &Response<T>) {
        let view = ResponseView::new(response);
        for item in &mut self.items {
            item.counted = self.sink.counts(item.reservation.entry, &view);
            item.charged = self.sink.charge_of(item.reservation.entry, &view);
            self.sink.pause_for(&item.reservation, &view);
        }
        self.charged = response.extensions().get::<Charge>().map(|c| c.0);
        self.responded = true;
    }

    /// Takes the inner service's error as its answer: a `500 Internal Server Error` for each
    /// limit's `count_if` (the response a server makes of an error), and whatever the handler
    /// reported.
    pub(crate) fn failed(&mut self) {
        let mut response = Response::new(());
        *response.status_mut() = http::StatusCode::INTERNAL_SERVER_ERROR;
        self.responded(&response);
    }

    /// Drops these reservations without a settle: they stand as taken.
    pub(crate) fn disarm(mut self) {
        self.items.clear();
    }

    /// Whether the actual cost may still be reported through the handle, while the body runs.
    pub(crate) fn waits_for_body(&self) -> bool {
        let reported =
            self.charged.is_some() || self.handle.as_ref().is_some_and(|h| h.charged().is_some());
        !reported && self.items.iter().any(|i| i.by_handler && i.counted)
    }

    /// `decision` as the settle leaves it, when the actual costs are known with the response
    /// head (after [`responded`](Self::responded)); as it is otherwise.
    pub(crate) fn settled(&self, decision: Decision) -> Decision {
        if self.waits_for_body()
            || self
                .items
                .iter()
                .all(|item| self.actual(item) == item.reservation.units)
        {
            return decision;
        }
        decision
            .limits()
            .iter()
            .enumerate()
            .map(
                |(i, limit)| match self.items.iter().find(|item| item.reservation.entry == i) {
                    Some(item) => limit.clone().settled(
                        self.sink.algorithm(i),
                        item.reservation.units,
                        self.actual(item),
                    ),
                    None => limit.clone(),
                },
            )
            .collect()
    }

    fn actual(&self, item: &Item) -> u32 {
        if !self.responded {
            return match item.on_drop {
                OnDrop::Refund => 0,
                OnDrop::Keep => item.reservation.units,
            };
        }
        if !item.counted {
            return 0;
        }
        if let Some(charged) = item.charged {
            return charged;
        }
        if !item.by_handler {
            return item.reservation.units;
        }
        self.handle
            .as_ref()
            .and_then(Settle::charged)
            .or(self.charged)
            .unwrap_or(item.reservation.units)
    }
}

impl Drop for Owed {
    fn drop(&mut self) {
        let mut actual = [0u32; MAX_CHECKS];
        for (a, item) in actual.iter_mut().zip(&self.items) {
            *a = self.actual(item);
        }
        let n = self.items.len().min(MAX_CHECKS);
        if self.items[..n]
            .iter()
            .zip(&actual)
            .any(|(item, &a)| a != item.reservation.units)
        {
            self.sink.settle(&self.items[..n], &actual[..n]);
        }
    }
}

/// What a waiting request owes: the refund of every unit it took, should it be dropped
/// before its time, and its metered limits' reservations, which that refund settles too.
pub(crate) struct Refund {
    refund: Option<Owed>,
    metered: Option<Box<Owed>>,
}

impl Refund {
    pub(crate) fn new(refund: Option<Owed>, metered: Option<Box<Owed>>) -> Self {
        Self { refund, metered }
    }

    /// The request's time has come: its units stay taken; what it owes its metered limits
    /// goes on with it.
    pub(crate) fn release(mut self) -> Option<Box<Owed>> {
        if let Some(refund) = self.refund.take() {
            refund.disarm();
        }
        self.metered.take()
    }
}

impl Drop for Refund {
    fn drop(&mut self) {
        // Dropped while it waits: the refund gives back every unit, the metered limits' too,
        // so their own settle (its drop policy) must not count them again.
        if self.refund.is_some() {
            if let Some(metered) = self.metered.take() {
                metered.disarm();
            }
        }
    }
}

/// Settles against the limit set a request was checked under.
pub(crate) struct SetSink<B> {
    pub(crate) shared: Arc<Shared<B>>,
    pub(crate) set: Arc<LimitSet>,
}

impl<B: Backend> Settler for SetSink<B> {
    fn counts(&self, entry: usize, response: &ResponseView<'_>) -> bool {
        self.set
            .limits
            .get(entry)
            .and_then(|e| e.metered.as_ref())
            .and_then(|m| m.count_if.as_ref())
            .is_none_or(|count| count(response))
    }

    fn algorithm(&self, entry: usize) -> Algorithm {
        self.set
            .limits
            .get(entry)
            .map_or(Algorithm::Gcra, |e| e.limit.algorithm())
    }

    fn charged_by_handler(&self) -> bool {
        self.set.charged_by_handler
    }

    fn charge_of(&self, entry: usize, response: &ResponseView<'_>) -> Option<u32> {
        let charge = self
            .set
            .limits
            .get(entry)?
            .metered
            .as_ref()?
            .charge_from
            .as_ref()?;
        charge(response)
    }

    fn pause_for(&self, held: &Reservation, response: &ResponseView<'_>) {
        let Some(entry) = self.set.limits.get(held.entry) else {
            return;
        };
        if !entry.metered.as_ref().is_some_and(|m| m.learns) {
            return;
        }
        let Some(pause) = crate::upstream::pause_of(response, std::time::SystemTime::now()) else {
            return;
        };
        let micros = u64::try_from(pause.as_micros()).unwrap_or(u64::MAX);
        tracing::debug!(
            limit = entry.limit.name(),
            pause_ms = pause.as_millis() as u64,
            "the upstream asked to wait: its key is held back"
        );
        match (held.fallback, &entry.local) {
            (false, _) => {
                let check = tollgate_engine::Check::new(&entry.limit, held.key.as_bytes())
                    .with_quota(held.quota);
                self.shared.backend.pause(&check, micros);
            }
            (true, Some(local)) => {
                let check =
                    tollgate_engine::Check::new(local, held.key.as_bytes()).with_quota(held.quota);
                self.shared.fallback.pause(&check, micros);
            }
            (true, None) => {}
        }
    }

    fn settle(&self, items: &[Item], actual: &[u32]) {
        let empty = Settlement::new(
            &self.set.limits[0].limit,
            b"",
            0,
            0,
            Receipt::default(),
            *self.set.limits[0].limit.quota(),
        );
        let mut remote = [empty; MAX_CHECKS];
        let mut local = [empty; MAX_CHECKS];
        let (mut r, mut l) = (0, 0);
        for (item, &actual) in items.iter().zip(actual) {
            let held = &item.reservation;
            let Some(entry) = self.set.limits.get(held.entry) else {
                continue;
            };
            if actual == held.units {
                continue;
            }
            let limit = match (held.fallback, &entry.local) {
                (false, _) => &entry.limit,
                (true, Some(local)) => local,
                (true, None) => continue,
            };
            let settlement = Settlement::new(
                limit,
                held.key.as_bytes(),
                held.units,
                actual,
                held.receipt,
                held.quota,
            );
            if held.fallback {
                local[l] = settlement;
                l += 1;
            } else {
                remote[r] = settlement;
                r += 1;
            }
        }
        if r > 0 {
            self.shared.backend.settle(&remote[..r]);
        }
        if l > 0 {
            self.shared.fallback.settle_now(&local[..l]);
        }
    }
}
