//! Requests that hold a concurrency slot, counted by the handler: from its entry to the end
//! of its response's body. A count over the limit's slots is a slot doubled.

use std::collections::HashMap;
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame};
use tollgate::{Decision, Outcome, Source};

/// Per key, the requests in the handler or streaming their body that hold a slot of the
/// "slots" limit (admitted by the backend, not bypassed nor allowlisted).
#[derive(Debug, Default)]
pub(crate) struct InFlight {
    slots: Option<u32>,
    state: Mutex<Flight>,
}

#[derive(Debug, Default)]
struct Flight {
    /// Redis restarts without persistence forget every slot: the requests of an earlier
    /// epoch no longer hold one.
    epoch: u32,
    now: HashMap<String, u32>,
    /// Every time a key had more requests holding a slot than it has slots.
    over: Vec<String>,
}

impl InFlight {
    pub(crate) fn new(slots: Option<u32>) -> Arc<Self> {
        Arc::new(Self {
            slots,
            state: Mutex::default(),
        })
    }

    /// A request entered the handler with `decision`: counted if it holds a slot of `key`;
    /// the guard, kept in its body, counts it out.
    pub(crate) fn enter(self: &Arc<Self>, key: &str, decision: Option<&Decision>) -> Option<Guard> {
        let slots = self.slots?;
        let holds = decision.and_then(|d| d.get("slots")).is_some_and(|l| {
            matches!(l.outcome(), Outcome::Allowed { .. }) && l.source() == Source::Backend
        });
        if !holds {
            return None;
        }
        let mut state = self.state.lock().unwrap();
        let epoch = state.epoch;
        let n = state.now.entry(key.to_owned()).or_default();
        *n += 1;
        if *n > slots {
            let n = *n;
            state
                .over
                .push(format!("{n} requests of {key} hold a slot, of {slots}"));
        }
        Some(Guard {
            flight: Arc::clone(self),
            key: key.to_owned(),
            epoch,
        })
    }

    /// Redis forgot every slot.
    pub(crate) fn forget(&self) {
        let mut state = self.state.lock().unwrap();
        state.epoch += 1;
        state.now.clear();
    }

    /// The slots doubled since the last call.
    pub(crate) fn doubled(&self) -> Vec<String> {
        std::mem::take(&mut self.state.lock().unwrap().over)
    }
}

/// One request counted in; counted out when dropped.
#[derive(Debug)]
pub(crate) struct Guard {
    flight: Arc<InFlight>,
    key: String,
    epoch: u32,
}

impl Drop for Guard {
    fn drop(&mut self) {
        let mut state = self.flight.state.lock().unwrap();
        if state.epoch == self.epoch {
            if let Some(n) = state.now.get_mut(&self.key) {
                *n = n.saturating_sub(1);
            }
        }
    }
}

/// A body of one chunk that holds its request's guard until its chunk is taken, or until it
/// is dropped unread: the end of the handler's body, the earliest the layer may give the slot
/// back (it gives it back before the response's body ends to the client, so a guard dropped
/// with the layer's body would still count a request whose slot another one already holds).
#[derive(Debug)]
pub(crate) struct Guarded {
    pub(crate) data: Option<Bytes>,
    /// Held only to be dropped at the body's end.
    #[allow(dead_code)]
    pub(crate) guard: Option<Guard>,
    /// The invariants' record of its exit: the slot's end when the chunk is taken, the rest
    /// (settles) when the body is dropped.
    pub(crate) exit: Option<super::invariants::Exit>,
}

impl Body for Guarded {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        let this = self.get_mut();
        let data = this.data.take();
        // The last frame: the handler's body ends here.
        this.guard = None;
        if let Some(exit) = this.exit.as_mut() {
            exit.ended();
        }
        Poll::Ready(data.map(|d| Ok(Frame::data(d))))
    }

    fn is_end_stream(&self) -> bool {
        self.data.is_none()
    }
}
