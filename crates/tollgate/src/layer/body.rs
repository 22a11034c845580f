use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;
use tollgate_engine::Landing;

use super::settle::Owed;
use crate::adaptive::Permit;

pin_project! {
    /// The response body of [`RateLimit`](super::RateLimit): the inner service's body, or the
    /// layer's own refusal.
    ///
    /// A refusal's body is one chunk of bytes (a problem+json document for HTTP) or nothing at
    /// all (a gRPC refusal is trailers-only: its status travels in the headers, and the body
    /// reports its end at once, so HTTP/2 sends one HEADERS frame that ends the stream).
    pub struct ResponseBody<B> {
        #[pin]
        kind: Kind<B>,
        // A reservation that settles when the body ends or is dropped, with the cost the
        // handler reported by then.
        owed: Option<Box<Owed>>,
        // What the request holds until its body ends (concurrency slots): finished then, or
        // dropped with the body.
        hold: Option<Box<dyn Hold>>,
        // The body's end (its last frame, or `None`), held back until the backend has the
        // release of the request's slots.
        landing: Option<(Option<Frame<Bytes>>, Landing)>,
    }
}

/// What an admitted request holds until its response ends.
pub(crate) trait Hold: Send + Sync {
    /// Gives it back at the response's end: what the backend's answer will be awaited on
    /// (see [`Slots::release_landing`](tollgate_engine::Slots::release_landing)), if it has to
    /// be.
    fn finish(self: Box<Self>) -> Option<Landing>;
}

/// Two holds, given back together.
pub(crate) struct Both(Box<dyn Hold>, Box<dyn Hold>);

impl Both {
    /// What holds `a` and `b`, whichever there are.
    pub(crate) fn of(a: Option<Box<dyn Hold>>, b: Option<Box<dyn Hold>>) -> Option<Box<dyn Hold>> {
        match (a, b) {
            (Some(a), Some(b)) => Some(Box::new(Both(a, b))),
            (a, b) => a.or(b),
        }
    }
}

impl Hold for Both {
    fn finish(self: Box<Self>) -> Option<Landing> {
        let Both(a, b) = *self;
        let landing = a.finish();
        // Only slots wait for the backend; a permit goes back at once.
        b.finish().or(landing)
    }
}

/// The adaptive limit's permit goes back when the body ends.
impl Hold for Permit {
    fn finish(self: Box<Self>) -> Option<Landing> {
        drop(self);
        None
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<B> {
        Inner {
            #[pin]
            body: B,
        },
        Refusal {
            bytes: Option<Bytes>,
        },
    }
}

impl<B> ResponseBody<B> {
    pub(crate) fn inner(body: B) -> Self {
        Self {
            kind: Kind::Inner { body },
            owed: None,
            hold: None,
            landing: None,
        }
    }

    pub(crate) fn settling(body: B, owed: Box<Owed>) -> Self {
        Self {
            kind: Kind::Inner { body },
            owed: Some(owed),
            hold: None,
            landing: None,
        }
    }

    /// This body, holding `hold` until it ends or is dropped.
    pub(crate) fn holding(mut self, hold: Option<Box<dyn Hold>>) -> Self {
        self.hold = hold;
        self
    }

    pub(crate) fn refusal(bytes: Bytes) -> Self {
        Self {
            kind: Kind::Refusal {
                bytes: Some(bytes).filter(|b| !b.is_empty()),
            },
            owed: None,
            hold: None,
            landing: None,
        }
    }

    /// Whether this is the layer's refusal rather than the inner service's body.
    pub fn is_refusal(&self) -> bool {
        matches!(self.kind, Kind::Refusal { .. })
    }
}

impl<B> Body for ResponseBody<B>
where
    B: Body<Data = Bytes>,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = self.project();
        if let Some((_, landing)) = this.landing.as_mut() {
            ready!(landing.as_mut().poll(cx));
            return Poll::Ready(this.landing.take().and_then(|(end, _)| end).map(Ok));
        }
        match this.kind.project() {
            KindProj::Inner { mut body } => {
                let frame = ready!(body.as_mut().poll_frame(cx));
                // The end of the body (or its failure): the handler has reported all it will,
                // and what the request held goes now, not when the connection drops the body.
                let ended = match &frame {
                    None | Some(Err(_)) => true,
                    Some(Ok(_)) => body.is_end_stream() || body.size_hint().exact() == Some(0),
                };
                if !ended {
                    return Poll::Ready(frame);
                }
                drop(this.owed.take());
                let Some(mut landing) = this.hold.take().and_then(|hold| hold.finish()) else {
                    return Poll::Ready(frame);
                };
                match frame {
                    // The end, held back until the backend has the release: a client that
                    // read it and sends its next request to another replica finds its slot
                    // free there. A failed body ends at once (the client sees no clean end).
                    None | Some(Ok(_)) if landing.as_mut().poll(cx).is_pending() => {
                        *this.landing = Some((frame.and_then(Result::ok), landing));
                        Poll::Pending
                    }
                    frame => Poll::Ready(frame),
                }
            }
            KindProj::Refusal { bytes } => Poll::Ready(bytes.take().map(|b| Ok(Frame::data(b)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        if self.hold.is_some() || self.landing.is_some() {
            // Not before what the request holds is given back (see `poll_frame`).
            return false;
        }
        match &self.kind {
            Kind::Inner { body, .. } => body.is_end_stream(),
            Kind::Refusal { bytes } => bytes.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            // An empty body that holds slots says it may have data: else HTTP/1 sends its
            // end without polling it, before the slots are given back.
            Kind::Inner { body, .. }
                if self.hold.is_some() && body.size_hint().exact() == Some(0) =>
            {
                SizeHint::new()
            }
            Kind::Inner { body, .. } => body.size_hint(),
            Kind::Refusal { bytes } => {
                SizeHint::with_exact(bytes.as_ref().map_or(0, |b| b.len() as u64))
            }
        }
    }
}

impl<B> std::fmt::Debug for ResponseBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.kind {
            Kind::Inner { .. } => f.write_str("ResponseBody::Inner"),
            Kind::Refusal { bytes } => f
                .debug_struct("ResponseBody::Refusal")
                .field("len", &bytes.as_ref().map_or(0, Bytes::len))
                .finish(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn poll<B: Body<Data = Bytes> + Unpin>(body: &mut B) -> Option<Bytes> {
        let mut cx = Context::from_waker(std::task::Waker::noop());
        match Pin::new(body).poll_frame(&mut cx) {
            Poll::Ready(Some(Ok(frame))) => frame.into_data().ok(),
            _ => None,
        }
    }

    #[test]
    fn a_refusal_is_one_chunk_then_the_end() {
        let mut body = ResponseBody::<String>::refusal(Bytes::from_static(b"{}"));
        assert!(body.is_refusal());
        assert!(!body.is_end_stream());
        assert_eq!(body.size_hint().exact(), Some(2));
        assert_eq!(poll(&mut body).as_deref(), Some(&b"{}"[..]));
        assert!(body.is_end_stream());
        assert_eq!(poll(&mut body), None);
    }

    #[test]
    fn an_empty_refusal_ends_at_once() {
        let body = ResponseBody::<String>::refusal(Bytes::new());
        assert!(body.is_end_stream());
        assert_eq!(body.size_hint().exact(), Some(0));
    }

    #[test]
    fn the_inner_body_passes_through() {
        let mut body = ResponseBody::inner(String::from("hello"));
        assert!(!body.is_refusal());
        assert_eq!(poll(&mut body).as_deref(), Some(&b"hello"[..]));
    }
}
