//! What is wrong with a Redis URL, said before the client's parser says only that it did not
//! parse. A message never quotes the URL's user part: it may hold a password.

/// The schemes the Redis client connects to.
const SCHEMES: [&str; 7] = [
    "redis",
    "rediss",
    "valkey",
    "valkeys",
    "unix",
    "redis+unix",
    "valkey+unix",
];

/// What is wrong with `url`'s scheme or port, if anything; the rest is left to the client.
pub(crate) fn mistake(url: &str) -> Option<String> {
    let url = url.trim();
    let Some((scheme, rest)) = url.split_once("://") else {
        return Some(
            "no scheme: a Redis URL starts with redis:// (rediss:// for TLS, unix:// for a \
             socket), as in redis://127.0.0.1:6379"
                .to_owned(),
        );
    };
    if !SCHEMES.iter().any(|s| s.eq_ignore_ascii_case(scheme)) {
        // A scheme is short and holds no secret; cut it anyway, in case it is no scheme.
        let scheme: String = scheme.chars().take(16).collect();
        return Some(format!(
            "{scheme}:// is not a Redis scheme: use redis://HOST:PORT, rediss://HOST:PORT for \
             TLS or unix:///PATH for a socket"
        ));
    }
    if scheme.to_ascii_lowercase().ends_with("unix") {
        return None;
    }
    let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
    let host_port = authority.rsplit_once('@').map_or(authority, |(_, hp)| hp);
    let port = match host_port.strip_prefix('[') {
        // An IPv6 address: [::1]:6379.
        Some(v6) => v6.split_once(']').and_then(|(_, p)| p.strip_prefix(':')),
        None => host_port.split_once(':').map(|(_, p)| p),
    };
    match port {
        None | Some("") => None,
        Some(port) if !port.bytes().all(|b| b.is_ascii_digit()) => {
            let port: String = port.chars().take(16).collect();
            Some(format!("port {port:?} is not a number from 1 to 65535"))
        }
        Some(port) => match port.parse::<u32>() {
            Ok(1..=65_535) => None,
            _ => {
                let port: String = port.chars().take(16).collect();
                Some(format!("port {port} is out of range: a port is 1 to 65535"))
            }
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_mistake_says_what_was_expected() {
        let cases = [
            (
                "127.0.0.1:6379",
                "no scheme: a Redis URL starts with redis:// (rediss:// for TLS, unix:// for a \
                 socket), as in redis://127.0.0.1:6379",
            ),
            (
                "http://:secret@127.0.0.1:6379/",
                "http:// is not a Redis scheme: use redis://HOST:PORT, rediss://HOST:PORT for \
                 TLS or unix:///PATH for a socket",
            ),
            (
                "redis://:secret@127.0.0.1:99999/",
                "port 99999 is out of range: a port is 1 to 65535",
            ),
            (
                "redis://127.0.0.1:0",
                "port 0 is out of range: a port is 1 to 65535",
            ),
            (
                "redis://[::1]:70000",
                "port 70000 is out of range: a port is 1 to 65535",
            ),
            (
                "redis://127.0.0.1:63x9",
                "port \"63x9\" is not a number from 1 to 65535",
            ),
        ];
        for (url, said) in cases {
            assert_eq!(mistake(url).as_deref(), Some(said), "{url}");
        }
        for good in [
            "redis://127.0.0.1:6379/",
            "redis://127.0.0.1",
            "REDIS://user:p:a:s:s@host:6379/0",
            "rediss://[::1]:6380",
            "unix:///run/redis.sock",
            "redis+unix:///run/redis.sock?db=1",
            "valkey://host",
        ] {
            assert_eq!(mistake(good), None, "{good}");
        }
    }
}
