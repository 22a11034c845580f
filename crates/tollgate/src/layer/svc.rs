//! The inner service that answers an admitted request, borrowed from the layer's service or
//! owned by the request's future.

use tower_service::Service;

/// The inner service that answers an admitted request: the one the layer's service holds
/// (polled ready; a clone takes its place when the request must wait for it), or one that
/// the future owns already.
pub(crate) enum Svc<'a, S> {
    /// The service's own, and how to clone it.
    Ready(&'a mut S, fn(&S) -> S),
    /// Owned by the future.
    Owned(S),
}

impl<S> Svc<'_, S> {
    pub(crate) fn call<R>(self, req: R) -> S::Future
    where
        S: Service<R>,
    {
        match self {
            Self::Ready(inner, _) => inner.call(req),
            Self::Owned(mut inner) => inner.call(req),
        }
    }

    pub(crate) fn owned(self) -> S {
        match self {
            Self::Ready(inner, clone) => {
                let fresh = clone(inner);
                std::mem::replace(inner, fresh)
            }
            Self::Owned(inner) => inner,
        }
    }
}
