//! The last default `429`, reused whole by the refusals of a flood.

use arc_swap::ArcSwapOption;
use bytes::Bytes;
use http::header::{HeaderMap, HeaderValue, CONTENT_LENGTH, RETRY_AFTER};
use http::{Response, StatusCode};

use crate::fields::{seconds_value, whole_seconds, write_headers, FieldOptions, Fields, Item};
use crate::problem::{problem, problem_body};
use crate::rejection::{Rejection, RejectionKind};

/// What the last refusal wrote, reused while the next refusal would write the same: a client
/// over its limit is refused with the same figures for a second at a time, and the refusal
/// path runs most during a flood. It holds one, which a refusal that differs replaces. Admitted
/// responses do not use it: their figures change from one request to the next.
pub(crate) struct Last<T>(ArcSwapOption<T>);

impl<T> Default for Last<T> {
    fn default() -> Self {
        Self(ArcSwapOption::empty())
    }
}

impl<T> std::fmt::Debug for Last<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Last").finish_non_exhaustive()
    }
}

impl<T> Last<T> {
    /// `take` of the last one if `same` holds of it, else of `make`'s, which is kept.
    fn get<R>(
        &self,
        same: impl Fn(&T) -> bool,
        make: impl FnOnce() -> Option<T>,
        take: impl Fn(&T) -> R,
    ) -> Option<R> {
        if let Some(last) = &*self.0.load() {
            if same(last) {
                return Some(take(last));
            }
        }
        let made = make()?;
        let taken = take(&made);
        self.0.store(Some(std::sync::Arc::new(made)));
        Some(taken)
    }
}

/// The last default `429`: what it was written from (the refusing limit, its wait, the
/// rate-limit fields' items and policy), and its body and header fields.
pub(crate) struct WrittenRefusal {
    limit: Box<str>,
    seconds: u64,
    items: Box<[Item<Box<str>>]>,
    policy: Option<HeaderValue>,
    body: Bytes,
    headers: HeaderMap,
}

/// The default `429` of `rejection`, with `Retry-After` and the rate-limit fields of `fields`
/// and `policy`: the last one's body and header fields again when it was written from the
/// same. `None` for any other refusal, which is written each time.
pub(crate) fn reused_or_written(
    last: &Last<WrittenRefusal>,
    rejection: &Rejection<'_>,
    fields: &Fields<'_>,
    policy: Option<&HeaderValue>,
    options: FieldOptions,
) -> Option<Response<Bytes>> {
    let seconds = match (
        rejection.kind(),
        rejection.retry_after(),
        rejection.is_grpc(),
    ) {
        (RejectionKind::TooManyRequests, Some(after), false) => whole_seconds(after),
        _ => return None,
    };
    let (body, headers) = last.get(
        |r| {
            r.seconds == seconds
                && *r.limit == *rejection.limit()
                && match (&r.policy, policy) {
                    // The layer's own policy value, shared: the same bytes where they lie.
                    (Some(a), Some(b)) => std::ptr::eq(a.as_bytes(), b.as_bytes()) || a == b,
                    (a, b) => a.is_none() && b.is_none(),
                }
                && r.items
                    .iter()
                    .map(|(remaining, seconds, name)| (*remaining, *seconds, &**name))
                    .eq(fields.items())
        },
        || {
            let mut response = problem(StatusCode::TOO_MANY_REQUESTS, problem_body(rejection));
            let length = HeaderValue::from(response.body().len());
            let headers = response.headers_mut();
            headers.insert(RETRY_AFTER, seconds_value(seconds));
            write_headers(headers, fields, policy, options);
            // Known here, so that the server does not add it to each copy of the fields (which
            // would grow a map cloned with room for exactly these).
            headers.insert(CONTENT_LENGTH, length);
            let (parts, body) = response.into_parts();
            Some(WrittenRefusal {
                limit: rejection.limit().into(),
                seconds,
                items: fields
                    .items()
                    .map(|(remaining, seconds, name)| (remaining, seconds, name.into()))
                    .collect(),
                policy: policy.cloned(),
                body,
                headers: parts.headers,
            })
        },
        |r| (r.body.clone(), r.headers.clone()),
    )?;
    let mut response = Response::new(body);
    *response.status_mut() = StatusCode::TOO_MANY_REQUESTS;
    *response.headers_mut() = headers;
    Some(response)
}
