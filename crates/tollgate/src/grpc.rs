//! Refusals the gRPC way: a trailers-only response that gRPC clients read as a status.
//!
//! A gRPC client that gets an HTTP 429 sees a transport error, not a status it can back off
//! on. A request whose `content-type` starts with `application/grpc` is therefore refused with
//! HTTP 200, `content-type: application/grpc`, `grpc-status` and `grpc-message` in the
//! headers, and an empty body that ends the stream (so HTTP/2 sends one HEADERS frame):
//!
//! | refusal | `grpc-status` |
//! |---|---|
//! | a limit is used up, or the cost can never be admitted | 8 `RESOURCE_EXHAUSTED` |
//! | a fail-closed limit's backend failed | 14 `UNAVAILABLE` |
//! | a missing or invalid key under the reject policy | 3 `INVALID_ARGUMENT` |
//! | a deny list matched the call | 7 `PERMISSION_DENIED` |
//! | the adaptive concurrency limit shed the call (the server is overloaded) | 14 `UNAVAILABLE` |
//!
//! The retry delay, when there is one, is in a `retry-after` metadata entry (whole seconds,
//! rounded up, as the HTTP header) and, with the `tonic` feature, in a `google.rpc.RetryInfo`
//! inside `grpc-status-details-bin`. The `RateLimit-Policy` and `RateLimit` fields are metadata
//! entries too.

use bytes::Bytes;
use http::header::{HeaderName, HeaderValue, CONTENT_TYPE};
use http::{HeaderMap, Response};

use crate::rejection::{Rejection, RejectionKind};

static GRPC_STATUS: HeaderName = HeaderName::from_static("grpc-status");
static GRPC_MESSAGE: HeaderName = HeaderName::from_static("grpc-message");
static APPLICATION_GRPC: HeaderValue = HeaderValue::from_static("application/grpc");

/// Whether `headers` belong to a gRPC request (`application/grpc`, `application/grpc+proto`,
/// `application/grpc-web`...). Read only when a request is refused.
pub(crate) fn is_grpc(headers: &HeaderMap) -> bool {
    headers
        .get(CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"))
}

/// The default gRPC refusal: trailers-only, status and message in the headers.
pub(crate) fn default_response(rejection: &Rejection<'_>) -> Response<Bytes> {
    let message = message(rejection);
    let code = rejection.grpc_code();
    let mut response = Response::new(Bytes::new());
    let headers = response.headers_mut();
    headers.insert(CONTENT_TYPE, APPLICATION_GRPC.clone());
    headers.insert(GRPC_STATUS.clone(), HeaderValue::from(u16::from(code)));
    if let Ok(value) = HeaderValue::from_maybe_shared(Bytes::from(percent_encode(&message))) {
        headers.insert(GRPC_MESSAGE.clone(), value);
    }
    #[cfg(feature = "tonic")]
    if let Some(after) = rejection.retry_after() {
        retry_info(headers, code, &message, after);
    }
    response
}

fn message(rejection: &Rejection<'_>) -> String {
    let limit = rejection.limit();
    match (rejection.kind(), rejection.retry_after()) {
        (RejectionKind::TooManyRequests, Some(after)) => format!(
            "rate limit \"{limit}\" exceeded; retry in {} s",
            crate::fields::whole_seconds(after)
        ),
        (RejectionKind::TooManyRequests, None) => {
            format!("the call costs more than rate limit \"{limit}\" can ever admit")
        }
        (RejectionKind::Unavailable, _) => {
            format!("rate limit \"{limit}\" cannot be checked right now")
        }
        (RejectionKind::MissingKey(why), _) => {
            let about = why.message_about(rejection.source());
            format!("{about} (rate limit \"{limit}\")")
        }
        (RejectionKind::InvalidCost, _) => {
            format!("the call's cost for rate limit \"{limit}\" is not a whole number of units")
        }
        (RejectionKind::Denylisted, Some(after)) => format!(
            "the call is refused by a deny list; retry in {} s",
            crate::fields::whole_seconds(after)
        ),
        (RejectionKind::Denylisted, None) => "the call is refused by a deny list".to_owned(),
        (RejectionKind::Shed, after) => format!(
            "the server is overloaded (\"{limit}\"); retry in {} s",
            after.map_or(1, crate::fields::whole_seconds)
        ),
    }
}

/// `grpc-message` is percent-encoded: every byte outside printable ASCII, and `%` itself.
fn percent_encode(message: &str) -> Vec<u8> {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    let mut out = Vec::with_capacity(message.len());
    for &b in message.as_bytes() {
        if (0x20..=0x7e).contains(&b) && b != b'%' {
            out.push(b);
        } else {
            out.extend_from_slice(&[b'%', HEX[usize::from(b >> 4)], HEX[usize::from(b & 0xf)]]);
        }
    }
    out
}

/// `google.rpc.RetryInfo` in `grpc-status-details-bin`, built by tonic-types so that the
/// encoding is the one tonic's client decodes.
#[cfg(feature = "tonic")]
fn retry_info(headers: &mut HeaderMap, code: u8, message: &str, after: std::time::Duration) {
    use tonic_types::{ErrorDetails, StatusExt};

    let delay = std::time::Duration::from_secs(crate::fields::whole_seconds(after));
    let status = tonic::Status::with_error_details(
        tonic::Code::from(i32::from(code)),
        message,
        ErrorDetails::with_retry_info(Some(delay)),
    );
    let mut encoded = HeaderMap::new();
    if status.add_header(&mut encoded).is_ok() {
        if let Some(details) = encoded.remove("grpc-status-details-bin") {
            headers.insert(HeaderName::from_static("grpc-status-details-bin"), details);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::key::MissingKey;

    #[test]
    fn grpc_content_types() {
        let mut headers = HeaderMap::new();
        assert!(!is_grpc(&headers));
        for (value, grpc) in [
            ("application/grpc", true),
            ("application/grpc+proto", true),
            ("application/grpc-web", true),
            ("application/json", false),
            ("text/plain", false),
        ] {
            headers.insert(CONTENT_TYPE, HeaderValue::from_static(value));
            assert_eq!(is_grpc(&headers), grpc, "{value}");
        }
    }

    #[test]
    fn messages_are_percent_encoded() {
        assert_eq!(percent_encode("a b\"c"), b"a b\"c");
        assert_eq!(percent_encode("100%"), b"100%25");
        assert_eq!(percent_encode("é\n"), b"%C3%A9%0A");
    }

    #[test]
    fn refusals_carry_their_status() {
        let cases = [
            (
                Rejection::new(
                    RejectionKind::TooManyRequests,
                    "burst",
                    Some(Duration::from_millis(11_500)),
                    None,
                ),
                "8",
                "rate limit \"burst\" exceeded; retry in 12 s",
            ),
            (
                Rejection::new(RejectionKind::TooManyRequests, "burst", None, None),
                "8",
                "the call costs more than rate limit \"burst\" can ever admit",
            ),
            (
                Rejection::new(RejectionKind::Unavailable, "daily", None, None),
                "14",
                "rate limit \"daily\" cannot be checked right now",
            ),
            (
                Rejection::new(
                    RejectionKind::MissingKey(MissingKey::Absent),
                    "shop",
                    None,
                    None,
                ),
                "3",
                "the rate-limit key is missing (rate limit \"shop\")",
            ),
            (
                Rejection::new(RejectionKind::Denylisted, "per-ip", None, None),
                "7",
                "the call is refused by a deny list",
            ),
            (
                Rejection::new(
                    RejectionKind::Denylisted,
                    "per-ip",
                    Some(Duration::from_millis(89_100)),
                    None,
                ),
                "7",
                "the call is refused by a deny list; retry in 90 s",
            ),
            (
                Rejection::new(
                    RejectionKind::Shed,
                    "api",
                    Some(Duration::from_millis(1_000)),
                    None,
                ),
                "14",
                "the server is overloaded (\"api\"); retry in 1 s",
            ),
        ];
        for (rejection, code, message) in cases {
            let response = default_response(&rejection);
            assert_eq!(response.status(), 200);
            assert_eq!(response.headers()[CONTENT_TYPE], "application/grpc");
            assert_eq!(response.headers()["grpc-status"], code);
            assert_eq!(response.headers()["grpc-message"], message);
            assert!(response.body().is_empty());
        }
    }
}
