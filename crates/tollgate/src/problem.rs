//! The default refusal: a short `application/problem+json` body.

use bytes::Bytes;
use http::header::{HeaderValue, CONTENT_TYPE};
use http::{Response, StatusCode};

use crate::fields::{digits, whole_seconds};
use crate::rejection::{Rejection, RejectionKind};

static PROBLEM_JSON: HeaderValue = HeaderValue::from_static("application/problem+json");

/// The default refusal: a short `application/problem+json` body.
pub(crate) fn default_response(rejection: &Rejection<'_>) -> Response<Bytes> {
    problem(rejection.status(), problem_body(rejection))
}

/// A response of `status` with the problem+json `body`.
pub(crate) fn problem(status: StatusCode, body: Bytes) -> Response<Bytes> {
    let mut response = Response::new(body);
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(CONTENT_TYPE, PROBLEM_JSON.clone());
    response
}

/// The default refusal's body.
///
/// Built from byte pieces into one exactly-sized buffer, without `fmt`: in a flood this runs
/// for every refused request (but see `refusal_cache`). Limit names are `[A-Za-z0-9_.-]`, so nothing
/// needs escaping.
pub(crate) fn problem_body(rejection: &Rejection<'_>) -> Bytes {
    let status = rejection.status();
    let name = rejection.limit().as_bytes();
    let mut seconds = [0; 20];
    let mut code = [0; 20];
    // A missing key's words, escaped for JSON (the source names a header in quotes).
    let about = match rejection.kind() {
        RejectionKind::MissingKey(why) => why
            .message_about(rejection.source())
            .replace('\\', "\\\\")
            .replace('"', "\\\""),
        _ => String::new(),
    };
    let detail: [&[u8]; 5] = match (rejection.kind(), rejection.retry_after()) {
        (RejectionKind::TooManyRequests, Some(after)) => [
            b"Rate limit \\\"",
            name,
            b"\\\" exceeded; retry in ",
            digits(whole_seconds(after), &mut seconds),
            b" s.",
        ],
        (RejectionKind::TooManyRequests, None) => [
            b"The request costs more than rate limit \\\"",
            name,
            b"\\\" can ever admit.",
            b"",
            b"",
        ],
        (RejectionKind::Unavailable, _) => [
            b"Rate limit \\\"",
            name,
            b"\\\" cannot be checked right now.",
            b"",
            b"",
        ],
        (RejectionKind::MissingKey(_), _) => {
            [about.as_bytes(), b" (rate limit \\\"", name, b"\\\").", b""]
        }
        (RejectionKind::InvalidCost, _) => [
            b"The request's cost for rate limit \\\"",
            name,
            b"\\\" is not a whole number of units.",
            b"",
            b"",
        ],
        // No limit named: a static deny is the layer's, not one limit's.
        (RejectionKind::Denylisted, Some(after)) => [
            b"The request is refused by a deny list; retry in ",
            digits(whole_seconds(after), &mut seconds),
            b" s.",
            b"",
            b"",
        ],
        (RejectionKind::Denylisted, None) => [
            b"The request is refused by a deny list.",
            b"",
            b"",
            b"",
            b"",
        ],
        (RejectionKind::Shed, after) => [
            b"The server is overloaded (\\\"",
            name,
            b"\\\"); retry in ",
            digits(after.map_or(1, whole_seconds), &mut seconds),
            b" s.",
        ],
    };
    let head: [&[u8]; 5] = [
        b"{\"type\":\"about:blank\",\"title\":\"",
        status.canonical_reason().unwrap_or("").as_bytes(),
        b"\",\"status\":",
        digits(u64::from(status.as_u16()), &mut code),
        b",\"detail\":\"",
    ];
    let tail: &[u8] = b"\"}";
    let parts = head.iter().chain(&detail).chain([&tail]);
    // Exactly sized, so that `Bytes::from` keeps the allocation as it is.
    let mut body = Vec::with_capacity(parts.clone().map(|p| p.len()).sum());
    for part in parts {
        body.extend_from_slice(part);
    }
    Bytes::from(body)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::key::MissingKey;

    fn body(rejection: &Rejection<'_>) -> String {
        String::from_utf8(default_response(rejection).into_body().to_vec()).unwrap()
    }

    #[test]
    fn default_bodies_are_problem_json() {
        let r = Rejection::new(
            RejectionKind::TooManyRequests,
            "burst",
            Some(Duration::from_millis(11_500)),
            None,
        );
        assert_eq!(
            body(&r),
            r#"{"type":"about:blank","title":"Too Many Requests","status":429,"detail":"Rate limit \"burst\" exceeded; retry in 12 s."}"#
        );
        let r = Rejection::new(
            RejectionKind::MissingKey(MissingKey::Absent),
            "shop",
            None,
            None,
        );
        assert_eq!(
            body(&r),
            r#"{"type":"about:blank","title":"Bad Request","status":400,"detail":"the rate-limit key is missing (rate limit \"shop\")."}"#
        );
        let r = Rejection::new(RejectionKind::Unavailable, "daily", None, None);
        assert!(body(&r).ends_with(
            r#""status":503,"detail":"Rate limit \"daily\" cannot be checked right now."}"#
        ));
        assert_eq!(
            default_response(&r).status(),
            StatusCode::SERVICE_UNAVAILABLE
        );
        let r = Rejection::new(RejectionKind::Denylisted, "per-ip", None, None);
        assert_eq!(
            body(&r),
            r#"{"type":"about:blank","title":"Forbidden","status":403,"detail":"The request is refused by a deny list."}"#
        );
        assert_eq!(default_response(&r).status(), StatusCode::FORBIDDEN);
        let r = Rejection::new(
            RejectionKind::Denylisted,
            "per-ip",
            Some(Duration::from_millis(89_100)),
            None,
        );
        assert!(body(&r).ends_with(
            r#""status":403,"detail":"The request is refused by a deny list; retry in 90 s."}"#
        ));
    }
}
