//! What an upstream API's response says of its own limit: how long to hold its key back
//! ([`Metered::pause_from_upstream`](crate::cost::Metered::pause_from_upstream)).

use std::time::{Duration, SystemTime};

use http::{HeaderMap, StatusCode};

use crate::cost::ResponseView;

/// The longest pause an upstream's answer can ask for: a day. A longer one (a broken clock,
/// a hostile upstream) is cut to it.
pub const MAX_UPSTREAM_PAUSE: Duration = Duration::from_secs(86_400);

/// How long `response` asks its caller to wait before the next call, if it says so:
///
/// - a `429 Too Many Requests` or `503 Service Unavailable` with `Retry-After`, in seconds
///   or as an HTTP date (counted from `now`);
/// - on any response, a `RateLimit` field whose item has `r=0` and `t=<seconds>` (the IETF
///   draft's form, `"default";r=0;t=30`), or `RateLimit-Remaining: 0` with
///   `RateLimit-Reset: <seconds>` (its earlier form).
///
/// At most [`MAX_UPSTREAM_PAUSE`]; `None` for anything else, or a value that is not one of
/// these forms.
pub(crate) fn pause_of(response: &ResponseView<'_>, now: SystemTime) -> Option<Duration> {
    let headers = response.headers();
    let refused = matches!(
        response.status(),
        StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE
    );
    let retry_after = refused.then(|| retry_after(headers, now)).flatten();
    retry_after
        .or_else(|| ratelimit_field(headers))
        .or_else(|| ratelimit_pair(headers))
        .map(|d| d.min(MAX_UPSTREAM_PAUSE))
        .filter(|d| !d.is_zero())
}

fn text<'h>(headers: &'h HeaderMap, name: &str) -> Option<&'h str> {
    headers.get(name)?.to_str().ok().map(str::trim)
}

fn seconds(value: &str) -> Option<Duration> {
    if value.is_empty() || !value.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    // Digits beyond u64 are a pause longer than any cap.
    Some(Duration::from_secs(value.parse().unwrap_or(u64::MAX)))
}

fn retry_after(headers: &HeaderMap, now: SystemTime) -> Option<Duration> {
    let value = text(headers, "retry-after")?;
    seconds(value).or_else(|| {
        let at = httpdate::parse_http_date(value).ok()?;
        Some(at.duration_since(now).unwrap_or(Duration::ZERO))
    })
}

/// `RateLimit: "default";r=0;t=30, "daily";r=10;t=3600`: the longest `t` among the items
/// with `r=0`.
fn ratelimit_field(headers: &HeaderMap) -> Option<Duration> {
    let mut longest = None;
    for value in headers.get_all("ratelimit") {
        let Ok(value) = value.to_str() else { continue };
        for item in value.split(',') {
            let (mut r, mut t) = (None, None);
            for param in item.split(';').skip(1) {
                match param.trim().split_once('=') {
                    Some(("r", v)) => r = seconds(v.trim()),
                    Some(("t", v)) => t = seconds(v.trim()),
                    _ => {}
                }
            }
            if r == Some(Duration::ZERO) {
                longest = longest.max(t);
            }
        }
    }
    longest
}

fn ratelimit_pair(headers: &HeaderMap) -> Option<Duration> {
    let remaining = seconds(text(headers, "ratelimit-remaining")?)?;
    if !remaining.is_zero() {
        return None;
    }
    seconds(text(headers, "ratelimit-reset")?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pause(status: u16, headers: &[(&'static str, &str)]) -> Option<u64> {
        let mut response = http::Response::new(());
        *response.status_mut() = StatusCode::from_u16(status).unwrap();
        for (name, value) in headers {
            response.headers_mut().append(*name, value.parse().unwrap());
        }
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(784_111_777);
        pause_of(&ResponseView::new(&response), now).map(|d| d.as_secs())
    }

    #[test]
    fn a_refusal_s_retry_after_in_seconds_or_as_a_date() {
        assert_eq!(pause(429, &[("retry-after", "7")]), Some(7));
        assert_eq!(pause(503, &[("retry-after", " 12 ")]), Some(12));
        // 1994-11-06 08:49:37 GMT is `now`; 30 s later.
        assert_eq!(
            pause(429, &[("retry-after", "Sun, 06 Nov 1994 08:50:07 GMT")]),
            Some(30)
        );
        assert_eq!(
            pause(429, &[("retry-after", "Sun, 06 Nov 1994 08:49:00 GMT")]),
            None
        );
        // Not a refusal: its Retry-After is not a pause.
        assert_eq!(pause(200, &[("retry-after", "7")]), None);
        assert_eq!(pause(429, &[("retry-after", "-3")]), None);
        assert_eq!(pause(429, &[("retry-after", "soon")]), None);
        assert_eq!(pause(429, &[]), None);
        assert_eq!(
            pause(429, &[("retry-after", "99999999999999999999999")]),
            Some(86_400)
        );
    }

    #[test]
    fn ratelimit_fields_with_nothing_left() {
        assert_eq!(
            pause(200, &[("ratelimit", "\"default\";r=0;t=30")]),
            Some(30)
        );
        assert_eq!(
            pause(200, &[("ratelimit", "\"a\";r=5;t=9, \"b\";r=0;t=40")]),
            Some(40)
        );
        assert_eq!(pause(200, &[("ratelimit", "\"a\";r=1;t=30")]), None);
        assert_eq!(
            pause(
                200,
                &[("ratelimit-remaining", "0"), ("ratelimit-reset", "15")]
            ),
            Some(15)
        );
        assert_eq!(
            pause(
                200,
                &[("ratelimit-remaining", "3"), ("ratelimit-reset", "15")]
            ),
            None
        );
    }
}
