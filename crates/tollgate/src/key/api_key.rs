//! API keys: a secret the client sends in a header of its own or as a bearer token.

use std::fmt;

use http::header::{HeaderName, AUTHORIZATION};
use tollgate_engine::ConfigError;

use super::{text, Identity, Key, KeyExtractor, MissingKey, RequestView, MAX_KEY_LEN};

/// The shortest key accepted by default, in bytes.
const DEFAULT_MIN_LEN: usize = 16;

/// The longest key accepted by default, in bytes.
const DEFAULT_MAX_LEN: usize = 256;

/// The most bytes of a prefix a fingerprint shows (`sk_live_`).
const MAX_PREFIX: usize = 8;

/// The fewest bytes a fingerprint keeps hidden before it shows a key's last characters.
const HIDDEN: usize = 16;

/// Keys requests by API key: a header of its own ([`header`](Self::header)) or the token of
/// `Authorization: Bearer <token>` ([`bearer`](Self::bearer)).
///
/// Keys are compared byte for byte: `sk_live_ABC` and `sk_live_abc` are two keys. Surrounding
/// ASCII whitespace is trimmed, nothing else is changed. A key is valid when it is
/// [`DEFAULT_MIN_LEN`](Self::DEFAULT_MIN_LEN) to [`DEFAULT_MAX_LEN`](Self::DEFAULT_MAX_LEN)
/// bytes (16 to 256; [`len_range`](Self::len_range) sets other bounds, within 1 to
/// [`MAX_KEY_LEN`]) of the alphabets real keys use: letters, digits, `-`, `.`, `_`, `~`, `+`,
/// `/` — base64 and base64url, hex, prefixes such as `sk_live_`, JWT-like tokens — and at most
/// two `=` of padding at the end.
///
/// A request without the header (or with another `Authorization` scheme, for a bearer key) is
/// [`MissingKey::Absent`]: the limit's missing-key policy applies. A key that is there but
/// unusable is refused with 400 and a body that says why, never what the key was: empty or
/// repeated ([`MissingKey::Invalid`]), too long ([`MissingKey::TooLong`]), too short
/// ([`MissingKey::TooShort`]), a character outside the alphabet
/// ([`MissingKey::BadCharacter`]).
///
/// A key is a secret. The extractor holds none, a [`Key`]'s `Debug` shows only its length,
/// backends store digests of keys, and reports of refused clients name a key by a
/// fingerprint ([`identity_of`](KeyExtractor::identity_of)):
/// - its prefix, when it starts with at most 8 bytes of lowercase letters, digits and `_`
///   ending in `_` (`sk_live_`, `ghp_`);
/// - `…`;
/// - its last 4 characters when at least 20 bytes follow the prefix (16 stay hidden), else
///   `#` and 8 hex digits of a digest of the key.
///
/// So `sk_live_` and 24 characters ending in `a1b2` read `sk_live_…a1b2`: the form in which
/// dashboards show keys to their owners.
///
/// # Examples
///
/// ```
/// use tollgate::key::{ApiKey, KeyExtractor, MissingKey, RequestView};
///
/// let by_key = ApiKey::header("x-api-key");
/// let req = |key: &str| http::Request::get("/").header("x-api-key", key).body(()).unwrap();
///
/// let upper = req("sk_live_ABCDEFGH1234567890ab");
/// let lower = req("sk_live_abcdefgh1234567890ab");
/// assert_ne!(
///     by_key.extract(&RequestView::new(&upper)).unwrap(),
///     by_key.extract(&RequestView::new(&lower)).unwrap(),
/// );
///
/// let base64 = req("q83vEjRWeJq83vEjRWeJ+/8=");
/// assert!(by_key.extract(&RequestView::new(&base64)).is_ok());
///
/// let short = req("abc");
/// assert_eq!(by_key.extract(&RequestView::new(&short)), Err(MissingKey::TooShort));
///
/// let key = by_key.extract(&RequestView::new(&upper)).unwrap();
/// assert_eq!(by_key.identity_of(key.as_bytes()), "sk_live_…90ab");
///
/// let by_token = ApiKey::bearer().len_range(8, 512)?;
/// let req = http::Request::get("/")
///     .header("authorization", "Bearer eyJhbGciOiJIUzI1NiJ9.e30.abc-_")
///     .body(())
///     .unwrap();
/// assert!(by_token.extract(&RequestView::new(&req)).is_ok());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone)]
pub struct ApiKey {
    source: Source,
    min_len: usize,
    max_len: usize,
}

#[derive(Clone)]
enum Source {
    Header(HeaderName),
    Bearer,
}

impl ApiKey {
    /// The shortest key accepted unless [`len_range`](Self::len_range) says otherwise.
    pub const DEFAULT_MIN_LEN: usize = DEFAULT_MIN_LEN;

    /// The longest key accepted unless [`len_range`](Self::len_range) says otherwise.
    pub const DEFAULT_MAX_LEN: usize = DEFAULT_MAX_LEN;

    /// The key in the header `name` (any case); the header must appear once.
    ///
    /// # Panics
    ///
    /// If `name` is not a valid header name. It is a constant of the program, so this shows at
    /// the first start; for a name read from configuration use
    /// [`header_name`](Self::header_name).
    pub fn header(name: &'static str) -> Self {
        match HeaderName::from_bytes(name.as_bytes()) {
            Ok(name) => Self::header_name(name),
            Err(_) => panic!("ApiKey::header: {name:?} is not a valid HTTP header name"),
        }
    }

    /// The key in the header `name`; the header must appear once.
    pub fn header_name(name: HeaderName) -> Self {
        Self::with_source(Source::Header(name))
    }

    /// The token of `Authorization: Bearer <token>` (the scheme in any case); the header must
    /// appear once. Another scheme (`Basic`) is no key: [`MissingKey::Absent`].
    pub fn bearer() -> Self {
        Self::with_source(Source::Bearer)
    }

    fn with_source(source: Source) -> Self {
        Self {
            source,
            min_len: DEFAULT_MIN_LEN,
            max_len: DEFAULT_MAX_LEN,
        }
    }

    /// Accepts keys of `min` to `max` bytes (default 16 to 256). Shorter ones are
    /// [`MissingKey::TooShort`], longer ones [`MissingKey::TooLong`]. A token longer than
    /// [`MAX_KEY_LEN`] (a JWT with many claims) cannot be a key: key on the principal an
    /// authentication layer reads from it instead.
    ///
    /// # Errors
    ///
    /// [`ConfigError::InvalidKeyLength`] when `min` is 0, `max` is above [`MAX_KEY_LEN`], or
    /// `min` is above `max`.
    pub fn len_range(mut self, min: usize, max: usize) -> Result<Self, ConfigError> {
        if max == 0 || max > MAX_KEY_LEN {
            return Err(ConfigError::InvalidKeyLength {
                len: max,
                max: MAX_KEY_LEN,
            });
        }
        if min == 0 || min > max {
            return Err(ConfigError::InvalidKeyLength { len: min, max });
        }
        self.min_len = min;
        self.max_len = max;
        Ok(self)
    }

    /// The raw value the key is read from.
    fn raw<'r>(&self, req: &RequestView<'r>) -> Result<&'r [u8], MissingKey> {
        let name = match &self.source {
            Source::Header(name) => name,
            Source::Bearer => &AUTHORIZATION,
        };
        let mut values = req.headers().get_all(name).into_iter();
        let value = values.next().ok_or(MissingKey::Absent)?;
        if values.next().is_some() {
            return Err(MissingKey::Invalid);
        }
        match self.source {
            Source::Header(_) => Ok(value.as_bytes()),
            Source::Bearer => bearer_token(value.as_bytes()),
        }
    }

    /// `value` trimmed, when it is a valid key.
    fn validate<'v>(&self, value: &'v [u8]) -> Result<Key<'v>, MissingKey> {
        let value = value.trim_ascii();
        if value.is_empty() {
            return Err(MissingKey::Invalid);
        }
        if value.len() > self.max_len {
            return Err(MissingKey::TooLong);
        }
        let body = value
            .strip_suffix(b"==")
            .or_else(|| value.strip_suffix(b"="))
            .unwrap_or(value);
        if !body.iter().all(|&b| in_alphabet(b)) {
            return Err(MissingKey::BadCharacter);
        }
        if value.len() < self.min_len {
            return Err(MissingKey::TooShort);
        }
        Key::borrowed(value)
    }
}

/// Letters, digits and `-._~+/`: base64, base64url, hex, prefixes and JWT-like tokens (the
/// characters of a bearer token, `=` apart).
fn in_alphabet(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~' | b'+' | b'/')
}

/// The token of a `Bearer` credential; another scheme is no bearer key.
fn bearer_token(value: &[u8]) -> Result<&[u8], MissingKey> {
    let value = value.trim_ascii_start();
    let scheme_len = value.iter().position(|&b| b == b' ').unwrap_or(value.len());
    if !value[..scheme_len].eq_ignore_ascii_case(b"bearer") {
        return Err(MissingKey::Absent);
    }
    Ok(&value[scheme_len..])
}

impl KeyExtractor for ApiKey {
    fn extract<'r>(&self, req: &RequestView<'r>) -> Result<Key<'r>, MissingKey> {
        self.raw(req).and_then(|raw| self.validate(raw))
    }

    /// The key itself, validated as a request's is.
    fn key_of(&self, identity: &Identity) -> Result<Key<'static>, MissingKey> {
        let text = identity.to_string();
        self.validate(text.as_bytes())
            .and_then(|key| Key::copied(key.as_bytes()))
    }

    /// `header <name>` or `bearer token`.
    fn describe(&self) -> String {
        match &self.source {
            Source::Header(name) => format!("header {name}"),
            Source::Bearer => "bearer token".to_owned(),
        }
    }

    /// A fingerprint such as `sk_live_…a1b2`, never the key (see [`ApiKey`]).
    fn identity_of(&self, key: &[u8]) -> String {
        key_fingerprint(key)
    }
}

/// The fingerprint of an API key (see [`ApiKey`]).
fn key_fingerprint(key: &[u8]) -> String {
    let head = &key[..key.len().min(MAX_PREFIX)];
    let prefix_len = head
        .iter()
        .rposition(|&b| b == b'_')
        .map(|i| i + 1)
        .filter(|&n| {
            key[..n]
                .iter()
                .all(|&b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
        })
        .unwrap_or(0);
    // The prefix is ASCII (checked above); a key is ASCII (validated), else it shows no tail.
    let mut out = String::from_utf8_lossy(&key[..prefix_len]).into_owned();
    out.push('…');
    let rest = &key[prefix_len..];
    match std::str::from_utf8(rest) {
        Ok(rest) if rest.is_ascii() && rest.len() >= HIDDEN + 4 => {
            out.push_str(&rest[rest.len() - 4..]);
        }
        _ => {
            out.push('#');
            text::push_digest(&mut out, key, 8);
        }
    }
    out
}

impl fmt::Debug for ApiKey {
    /// The source and the bounds: an extractor holds no key.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut s = f.debug_struct("ApiKey");
        match &self.source {
            Source::Header(name) => s.field("header", name),
            Source::Bearer => s.field("bearer", &true),
        };
        s.field("min_len", &self.min_len)
            .field("max_len", &self.max_len)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use http::HeaderValue;

    use super::*;

    fn extract(ex: &ApiKey, name: &str, values: &[&[u8]]) -> Result<Vec<u8>, MissingKey> {
        let mut req = http::Request::get("/").body(()).unwrap();
        for value in values {
            req.headers_mut().append(
                HeaderName::from_bytes(name.as_bytes()).unwrap(),
                HeaderValue::from_bytes(value).unwrap(),
            );
        }
        ex.extract(&RequestView::new(&req))
            .map(|key| key.as_bytes().to_vec())
    }

    #[test]
    fn header_values() {
        let ex = ApiKey::header("x-api-key");
        let max = "k".repeat(256);
        let over = "k".repeat(257);
        type Want = Result<&'static [u8], MissingKey>;
        let cases: Vec<(Vec<&[u8]>, Want)> = vec![
            (vec![b"sk_live_ABCDEF123456"], Ok(b"sk_live_ABCDEF123456")),
            (
                vec![b" sk_live_ABCDEF123456\t"],
                Ok(b"sk_live_ABCDEF123456"),
            ),
            (
                vec![b"q83vEjRWeJq83vEjRW+/=="],
                Ok(b"q83vEjRWeJq83vEjRW+/=="),
            ),
            (
                vec![b"q83vEjRWeJq83vEjRW-_8="],
                Ok(b"q83vEjRWeJq83vEjRW-_8="),
            ),
            (vec![b"0123456789abcdef"], Ok(b"0123456789abcdef")),
            (vec![b"eyJhbGciOi.e30.sig~x"], Ok(b"eyJhbGciOi.e30.sig~x")),
            (vec![], Err(MissingKey::Absent)),
            (vec![b""], Err(MissingKey::Invalid)),
            (vec![b"   "], Err(MissingKey::Invalid)),
            (
                vec![b"sk_live_ABCDEF123456", b"sk_live_ABCDEF123456"],
                Err(MissingKey::Invalid),
            ),
            (vec![b"0123456789abcde"], Err(MissingKey::TooShort)),
            (vec![b"0123456789abcdef==="], Err(MissingKey::BadCharacter)),
            (vec![b"0123456=789abcdef"], Err(MissingKey::BadCharacter)),
            (vec![b"0123456789 abcdef"], Err(MissingKey::BadCharacter)),
            (vec![b"0123456789:abcdef"], Err(MissingKey::BadCharacter)),
            (vec![b"0123456789abcdef\xff"], Err(MissingKey::BadCharacter)),
            (vec![b"short!"], Err(MissingKey::BadCharacter)),
            (vec![max.as_bytes()], Ok(b"")),
            (vec![over.as_bytes()], Err(MissingKey::TooLong)),
        ];
        for (values, want) in cases {
            let got = extract(&ex, "x-api-key", &values);
            match want {
                // The longest key: itself.
                Ok(b"") => assert_eq!(got, Ok(max.clone().into_bytes())),
                want => assert_eq!(got, want.map(<[u8]>::to_vec), "{values:?}"),
            }
        }
    }

    #[test]
    fn bearer_tokens() {
        let ex = ApiKey::bearer();
        let token: &[u8] = b"abcdefghijklmnop.qrs";
        type Want = Result<&'static [u8], MissingKey>;
        let cases: Vec<(Vec<&[u8]>, Want)> = vec![
            (vec![b"Bearer abcdefghijklmnop.qrs"], Ok(token)),
            (vec![b"bearer   abcdefghijklmnop.qrs "], Ok(token)),
            (vec![b"BEARER abcdefghijklmnop.qrs"], Ok(token)),
            (vec![], Err(MissingKey::Absent)),
            (vec![b"Basic dXNlcjpwYXNzd29yZA=="], Err(MissingKey::Absent)),
            (vec![b"Bearerabcdefghijklmnop"], Err(MissingKey::Absent)),
            (vec![b"Bearer"], Err(MissingKey::Invalid)),
            (vec![b"Bearer "], Err(MissingKey::Invalid)),
            (
                vec![b"Bearer abc def ghi jkl mno"],
                Err(MissingKey::BadCharacter),
            ),
            (vec![b"Bearer abc"], Err(MissingKey::TooShort)),
            (
                vec![
                    b"Bearer abcdefghijklmnop.qrs",
                    b"Bearer abcdefghijklmnop.qrs",
                ],
                Err(MissingKey::Invalid),
            ),
        ];
        for (values, want) in cases {
            let got = extract(&ex, "authorization", &values);
            assert_eq!(got, want.map(<[u8]>::to_vec), "{values:?}");
        }
    }

    #[test]
    fn length_bounds() {
        let ex = ApiKey::header("x-api-key").len_range(4, 6).unwrap();
        assert_eq!(
            extract(&ex, "x-api-key", &[b"abc"]),
            Err(MissingKey::TooShort)
        );
        assert_eq!(extract(&ex, "x-api-key", &[b"abcd"]), Ok(b"abcd".to_vec()));
        assert_eq!(
            extract(&ex, "x-api-key", &[b"abcdef"]),
            Ok(b"abcdef".to_vec())
        );
        assert_eq!(
            extract(&ex, "x-api-key", &[b"abcdefg"]),
            Err(MissingKey::TooLong)
        );
        let any = ApiKey::bearer().len_range(1, MAX_KEY_LEN).unwrap();
        assert_eq!(
            extract(&any, "authorization", &[b"Bearer x"]),
            Ok(b"x".to_vec())
        );
        for (min, max, len, cap) in [
            (0, 10, 0, 10),
            (11, 10, 11, 10),
            (1, 0, 0, MAX_KEY_LEN),
            (1, 513, 513, MAX_KEY_LEN),
        ] {
            assert_eq!(
                ApiKey::bearer().len_range(min, max).unwrap_err(),
                ConfigError::InvalidKeyLength { len, max: cap },
                "{min}..={max}"
            );
        }
    }

    #[test]
    fn key_of_validates_as_requests_do() {
        let ex = ApiKey::header("x-api-key");
        let key = ex.key_of(&Identity::from("sk_live_ABCDEF123456")).unwrap();
        assert_eq!(key.as_bytes(), b"sk_live_ABCDEF123456");
        assert_eq!(
            ex.key_of(&Identity::from("sk live")),
            Err(MissingKey::BadCharacter)
        );
        assert_eq!(ex.key_of(&Identity::from("abc")), Err(MissingKey::TooShort));
    }

    #[test]
    fn fingerprints_show_a_prefix_and_a_tail_or_a_digest() {
        let digest = |key: &[u8]| {
            let mut s = String::new();
            text::push_digest(&mut s, key, 8);
            s
        };
        let cases: Vec<(&[u8], String)> = vec![
            (
                b"sk_live_0123456789abcdefghija1b2",
                "sk_live_…a1b2".to_owned(),
            ),
            (b"ghp_0123456789abcdefghijXYZW", "ghp_…XYZW".to_owned()),
            // No prefix: a random key that happens to hold `_`, or an upper-case start.
            (b"Ab_0123456789abcdefghijWXYZ", "…WXYZ".to_owned()),
            (b"q83vEjRWeJq83vEjRW+/==", "…+/==".to_owned()),
            // Too short to show a tail: 16 bytes would not stay hidden.
            (
                b"sk_live_0123456789a1b2",
                format!("sk_live_…#{}", digest(b"sk_live_0123456789a1b2")),
            ),
            (b"abcdefgh", format!("…#{}", digest(b"abcdefgh"))),
            (&[0xff, 0xfe], format!("…#{}", digest(&[0xff, 0xfe]))),
        ];
        let ex = ApiKey::bearer();
        for (key, want) in cases {
            assert_eq!(ex.identity_of(key), want, "{key:?}");
        }
        assert_eq!(digest(b"abcdefgh").len(), 8);
        assert_ne!(digest(b"abcdefgh"), digest(b"abcdefgi"));
    }

    #[test]
    fn debug_names_the_source_and_bounds() {
        assert_eq!(
            format!("{:?}", ApiKey::header("X-Api-Key")),
            r#"ApiKey { header: "x-api-key", min_len: 16, max_len: 256 }"#
        );
        assert_eq!(
            format!("{:?}", ApiKey::bearer()),
            "ApiKey { bearer: true, min_len: 16, max_len: 256 }"
        );
        assert_eq!(ApiKey::bearer().describe(), "bearer token");
        assert_eq!(ApiKey::header("X-Api-Key").describe(), "header x-api-key");
    }

    #[test]
    #[should_panic(expected = "ApiKey::header: \"x key\" is not a valid HTTP header name")]
    fn invalid_header_name_panics_at_construction() {
        let _ = ApiKey::header("x key");
    }
}
