//! Tenant keys: a shop, an organisation, an API account named by the request.

use std::fmt;

use http::header::HeaderName;
use http::Extensions;
use tollgate_engine::ConfigError;

use super::{Key, KeyExtractor, MissingKey, RequestView, MAX_KEY_LEN};

const DEFAULT_MAX_LEN: usize = 255;

/// Keys requests by tenant (a shop, an organisation), read from a header, a query parameter or
/// a request extension.
///
/// Values are normalised — surrounding ASCII whitespace trimmed, ASCII letters lowercased — so
/// `Shop-1` and `shop-1` count against one bucket. Then they are validated: 1 to
/// [`max_len`](Self::max_len) bytes (default 255) of `[a-z0-9._:-]`. Anything else never becomes
/// a key: a missing value is [`MissingKey::Absent`], a value that is too long
/// [`MissingKey::TooLong`], and an empty, non-UTF-8, repeated or otherwise odd value
/// [`MissingKey::Invalid`]. Percent-encoded query values are not decoded; they are invalid too,
/// so one tenant cannot be spelled two ways.
///
/// A header or query parameter is chosen by the client: limit by tenant to share a quota
/// between a tenant's users, and pair it with a per-IP or per-principal limit when clients are
/// not trusted to name the right tenant. An extension set by an authentication layer is not
/// chosen by the client.
///
/// # Examples
///
/// ```
/// use tollgate::key::{KeyExtractor, MissingKey, RequestView, Tenant};
///
/// let by_shop = Tenant::header("X-Shop");
///
/// let upper = http::Request::get("/").header("x-shop", " Acme.Store ").body(()).unwrap();
/// let lower = http::Request::get("/").header("x-shop", "acme.store").body(()).unwrap();
/// assert_eq!(
///     by_shop.extract(&RequestView::new(&upper)).unwrap(),
///     by_shop.extract(&RequestView::new(&lower)).unwrap(),
/// );
///
/// let bad = http::Request::get("/").header("x-shop", "acme store").body(()).unwrap();
/// assert_eq!(by_shop.extract(&RequestView::new(&bad)), Err(MissingKey::Invalid));
///
/// let by_query = Tenant::query("shop").max_len(32)?;
/// let req = http::Request::get("/orders?page=2&shop=ACME").body(()).unwrap();
/// assert_eq!(by_query.extract(&RequestView::new(&req)).unwrap().as_bytes(), b"acme");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone)]
pub struct Tenant {
    source: Source,
    max_len: usize,
    reveal: bool,
}

#[derive(Clone)]
enum Source {
    Header(HeaderName),
    Query(&'static str),
    Extension {
        get: fn(&Extensions) -> Option<&str>,
        type_name: &'static str,
    },
}

impl Tenant {
    /// The tenant named by the header `name` (any case); the header must appear once.
    ///
    /// # Panics
    ///
    /// If `name` is not a valid header name. It is a constant of the program, so this shows at
    /// the first start; for a name read from configuration use
    /// [`header_name`](Self::header_name).
    pub fn header(name: &'static str) -> Self {
        match HeaderName::from_bytes(name.as_bytes()) {
            Ok(name) => Self::header_name(name),
            Err(_) => panic!("Tenant::header: {name:?} is not a valid HTTP header name"),
        }
    }

    /// The tenant named by the header `name`; the header must appear once.
    pub fn header_name(name: HeaderName) -> Self {
        Self::with_source(Source::Header(name))
    }

    /// The tenant named by the query parameter `param` (compared byte for byte, not decoded);
    /// the parameter must appear once.
    pub fn query(param: &'static str) -> Self {
        Self::with_source(Source::Query(param))
    }

    /// The tenant in the request extension of type `T`, inserted by an earlier layer (typically
    /// authentication).
    ///
    /// The value is normalised and validated like any other source.
    pub fn extension<T>() -> Self
    where
        T: AsRef<str> + Clone + Send + Sync + 'static,
    {
        Self::with_source(Source::Extension {
            get: extension_str::<T>,
            type_name: std::any::type_name::<T>(),
        })
    }

    fn with_source(source: Source) -> Self {
        Self {
            source,
            max_len: DEFAULT_MAX_LEN,
            reveal: false,
        }
    }

    /// Reports of refused clients name tenants as they are (`acme.store`) instead of by a
    /// [`fingerprint`](super::fingerprint): the names then reach the backend (Redis keeps
    /// reports for two minutes) and whoever reads it.
    pub fn reveal_identities(mut self) -> Self {
        self.reveal = true;
        self
    }

    /// Accepts tenants up to `n` bytes (default 255); longer ones are [`MissingKey::TooLong`].
    ///
    /// # Errors
    ///
    /// [`ConfigError::InvalidKeyLength`] when `n` is 0 or above [`MAX_KEY_LEN`].
    pub fn max_len(mut self, n: usize) -> Result<Self, ConfigError> {
        if n == 0 || n > MAX_KEY_LEN {
            return Err(ConfigError::InvalidKeyLength {
                len: n,
                max: MAX_KEY_LEN,
            });
        }
        self.max_len = n;
        Ok(self)
    }

    fn raw<'r>(&self, req: &RequestView<'r>) -> Result<&'r [u8], MissingKey> {
        match &self.source {
            Source::Header(name) => {
                let mut values = req.headers().get_all(name).into_iter();
                let value = values.next().ok_or(MissingKey::Absent)?;
                if values.next().is_some() {
                    return Err(MissingKey::Invalid);
                }
                Ok(value.as_bytes())
            }
            Source::Query(param) => query_value(req.uri().query().unwrap_or(""), param),
            Source::Extension { get, .. } => get(req.extensions())
                .map(str::as_bytes)
                .ok_or(MissingKey::Absent),
        }
    }
}

impl KeyExtractor for Tenant {
    fn extract<'r>(&self, req: &RequestView<'r>) -> Result<Key<'r>, MissingKey> {
        self.raw(req).and_then(|raw| normalise(raw, self.max_len))
    }

    /// The tenant's name, normalised as a request's is (trimmed, lowercase).
    fn key_of(&self, identity: &super::Identity) -> Result<Key<'static>, MissingKey> {
        let name = identity.to_string();
        normalise(name.as_bytes(), self.max_len).and_then(|key| Key::copied(key.as_bytes()))
    }

    /// `header <name>`, `query <parameter>` or `extension <type>`.
    fn describe(&self) -> String {
        match &self.source {
            Source::Header(name) => format!("header {name}"),
            Source::Query(param) => format!("query {param}"),
            Source::Extension { type_name, .. } => format!("extension {type_name}"),
        }
    }

    /// A [`fingerprint`](super::fingerprint); the tenant's name once asked to reveal
    /// identities ([`reveal_identities`](Self::reveal_identities)).
    fn identity_of(&self, key: &[u8]) -> String {
        if self.reveal {
            super::text::key_text(key)
        } else {
            super::fingerprint(key)
        }
    }
}

impl fmt::Debug for Tenant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut s = f.debug_struct("Tenant");
        match &self.source {
            Source::Header(name) => s.field("header", name),
            Source::Query(param) => s.field("query", param),
            Source::Extension { type_name, .. } => s.field("extension", type_name),
        };
        s.field("max_len", &self.max_len).finish()
    }
}

fn extension_str<T: AsRef<str> + Send + Sync + 'static>(extensions: &Extensions) -> Option<&str> {
    extensions.get::<T>().map(AsRef::as_ref)
}

/// The value of `param` in `query`. A repeated parameter is invalid: the application behind the
/// limiter may read the other occurrence, and the two must not disagree about the tenant.
/// Names are compared as the application's query parser reads them, decoded: `sh%6Fp` is
/// `shop`, or a client could send a decoy under the plain name and be served under the
/// encoded one. (Values are not decoded: a `%` or `+` in a value makes the tenant invalid.)
fn query_value<'q>(query: &'q str, param: &str) -> Result<&'q [u8], MissingKey> {
    let mut found = None;
    for pair in query.split('&') {
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        if decodes_to(name.as_bytes(), param.as_bytes()) {
            if found.is_some() {
                return Err(MissingKey::Invalid);
            }
            found = Some(value.as_bytes());
        }
    }
    found.ok_or(MissingKey::Absent)
}

/// Whether `raw`, decoded as `application/x-www-form-urlencoded` (`+` is a space, `%XX` a
/// byte, a `%` not followed by two hex digits itself), is `want`.
fn decodes_to(raw: &[u8], want: &[u8]) -> bool {
    let hex = |b: Option<&u8>| b.and_then(|&b| char::from(b).to_digit(16));
    let mut want = want.iter();
    let mut i = 0;
    while let Some(&b) = raw.get(i) {
        let decoded = match b {
            b'+' => b' ',
            b'%' => match (hex(raw.get(i + 1)), hex(raw.get(i + 2))) {
                (Some(hi), Some(lo)) => {
                    i += 2;
                    // Two hex digits: at most 0xff.
                    (hi * 16 + lo) as u8
                }
                _ => b'%',
            },
            b => b,
        };
        i += 1;
        if want.next() != Some(&decoded) {
            return false;
        }
    }
    want.next().is_none()
}

/// Trims, lowercases and validates; borrows when the value is already in normal form.
fn normalise(raw: &[u8], max_len: usize) -> Result<Key<'_>, MissingKey> {
    let value = raw.trim_ascii();
    if value.is_empty() {
        return Err(MissingKey::Invalid);
    }
    if value.len() > max_len {
        return Err(MissingKey::TooLong);
    }
    let mut has_upper = false;
    for &b in value {
        match b {
            b'a'..=b'z' | b'0'..=b'9' | b'.' | b'_' | b':' | b'-' => {}
            b'A'..=b'Z' => has_upper = true,
            _ => return Err(MissingKey::Invalid),
        }
    }
    if !has_upper {
        return Key::borrowed(value);
    }
    // `max_len` is at most MAX_KEY_LEN, so the value fits; `copied` keeps short keys inline.
    let mut buf = [0; MAX_KEY_LEN];
    let lower = buf.get_mut(..value.len()).ok_or(MissingKey::TooLong)?;
    lower.copy_from_slice(value);
    lower.make_ascii_lowercase();
    Key::copied(lower)
}

#[cfg(test)]
mod tests {
    use http::HeaderValue;

    use super::super::Repr;
    use super::*;

    fn shop() -> Tenant {
        Tenant::header("X-Shop")
    }

    fn with_headers(values: &[HeaderValue]) -> http::Request<()> {
        let mut req = http::Request::get("/").body(()).unwrap();
        for value in values {
            req.headers_mut().append("x-shop", value.clone());
        }
        req
    }

    fn extract(ex: &Tenant, req: &http::Request<()>) -> Result<Vec<u8>, MissingKey> {
        ex.extract(&RequestView::new(req))
            .map(|key| key.as_bytes().to_vec())
    }

    fn h(value: &str) -> HeaderValue {
        HeaderValue::from_str(value).unwrap()
    }

    #[test]
    fn header_values() {
        let long = "a".repeat(256);
        let at_limit = "a".repeat(255);
        type Want = Result<Vec<u8>, MissingKey>;
        let cases: Vec<(Vec<HeaderValue>, Want)> = vec![
            (vec![h("acme")], Ok(b"acme".to_vec())),
            (vec![h("ACME")], Ok(b"acme".to_vec())),
            (
                vec![h("Acme-Shop_1.eu:main")],
                Ok(b"acme-shop_1.eu:main".to_vec()),
            ),
            (vec![h(" \tacme ")], Ok(b"acme".to_vec())),
            (vec![h(&at_limit)], Ok(at_limit.clone().into_bytes())),
            (vec![], Err(MissingKey::Absent)),
            (vec![h("")], Err(MissingKey::Invalid)),
            (vec![h("   ")], Err(MissingKey::Invalid)),
            (vec![h(&long)], Err(MissingKey::TooLong)),
            (vec![h("acme shop")], Err(MissingKey::Invalid)),
            (vec![h("acme/shop")], Err(MissingKey::Invalid)),
            (vec![h("acme%20")], Err(MissingKey::Invalid)),
            (vec![h("acme"), h("acme")], Err(MissingKey::Invalid)),
            (
                vec![HeaderValue::from_bytes(&[b'a', 0xff, 0xfe]).unwrap()],
                Err(MissingKey::Invalid),
            ),
            (
                vec![HeaderValue::from_bytes("ac\u{e9}me".as_bytes()).unwrap()],
                Err(MissingKey::Invalid),
            ),
        ];
        for (values, want) in cases {
            let req = with_headers(&values);
            assert_eq!(extract(&shop(), &req), want, "{values:?}");
        }
    }

    #[test]
    fn uppercase_and_lowercase_share_a_key() {
        let upper_req = with_headers(&[h("ACME")]);
        let upper = shop().extract(&RequestView::new(&upper_req)).unwrap();
        let lower_req = with_headers(&[h("acme")]);
        let lower = shop().extract(&RequestView::new(&lower_req)).unwrap();
        assert_eq!(upper, lower);
        assert!(matches!(lower.0, Repr::Borrowed(_)));
        assert!(matches!(upper.0, Repr::Inline { .. }));
    }

    #[test]
    fn long_uppercase_value_is_lowercased() {
        let value = "A".repeat(100);
        let req = with_headers(&[h(&value)]);
        assert_eq!(extract(&shop(), &req), Ok(vec![b'a'; 100]));
    }

    #[test]
    fn max_len() {
        let ex = shop().max_len(4).unwrap();
        assert_eq!(
            extract(&ex, &with_headers(&[h("ACME")])),
            Ok(b"acme".to_vec())
        );
        assert_eq!(
            extract(&ex, &with_headers(&[h("acmes")])),
            Err(MissingKey::TooLong)
        );
        let ex = shop().max_len(MAX_KEY_LEN).unwrap();
        let value = "A".repeat(MAX_KEY_LEN);
        assert_eq!(
            extract(&ex, &with_headers(&[h(&value)])),
            Ok(vec![b'a'; MAX_KEY_LEN])
        );
        assert_eq!(
            shop().max_len(0).unwrap_err(),
            ConfigError::InvalidKeyLength { len: 0, max: 512 }
        );
        assert_eq!(
            shop().max_len(513).unwrap_err(),
            ConfigError::InvalidKeyLength { len: 513, max: 512 }
        );
    }

    #[test]
    fn query_parameter() {
        let cases: Vec<(&str, Result<&[u8], MissingKey>)> = vec![
            ("/?shop=acme", Ok(b"acme")),
            ("/?shop=ACME", Ok(b"acme")),
            ("/orders?page=2&shop=acme&sort=asc", Ok(b"acme")),
            ("/?shopx=acme&xshop=acme&shop=acme", Ok(b"acme")),
            ("/", Err(MissingKey::Absent)),
            ("/?", Err(MissingKey::Absent)),
            ("/?page=2", Err(MissingKey::Absent)),
            ("/?shop", Err(MissingKey::Invalid)),
            ("/?shop=", Err(MissingKey::Invalid)),
            ("/?shop=a&shop=a", Err(MissingKey::Invalid)),
            ("/?shop=acme%20x", Err(MissingKey::Invalid)),
            ("/?shop=%41cme", Err(MissingKey::Invalid)),
            ("/?shop=acme+x", Err(MissingKey::Invalid)),
            ("/?shop=a=b", Err(MissingKey::Invalid)),
            // Names are decoded, as the application's query parser decodes them: an encoded
            // name is the same parameter, and a second occurrence of it is one too many.
            ("/?sh%6Fp=acme", Ok(b"acme")),
            ("/?%73%68%6f%70=acme", Ok(b"acme")),
            ("/?shop=decoy&sh%6Fp=victim", Err(MissingKey::Invalid)),
            ("/?sh%6=acme", Err(MissingKey::Absent)),
            ("/?shop%=acme", Err(MissingKey::Absent)),
            ("/?sho+=acme", Err(MissingKey::Absent)),
        ];
        let ex = Tenant::query("shop");
        for (uri, want) in cases {
            let req = http::Request::get(uri).body(()).unwrap();
            assert_eq!(extract(&ex, &req), want.map(<[u8]>::to_vec), "{uri}");
        }
        let req = http::Request::get("/?shop=acme").body(()).unwrap();
        let key = ex.extract(&RequestView::new(&req)).unwrap();
        assert!(
            matches!(key.0, Repr::Borrowed(_)),
            "no copy when already normal"
        );
    }

    #[derive(Clone)]
    struct ShopId(String);

    impl AsRef<str> for ShopId {
        fn as_ref(&self) -> &str {
            &self.0
        }
    }

    #[test]
    fn extension_source() {
        let ex = Tenant::extension::<ShopId>();
        let mut req = http::Request::get("/").body(()).unwrap();
        assert_eq!(extract(&ex, &req), Err(MissingKey::Absent));
        req.extensions_mut().insert(ShopId("Acme".into()));
        assert_eq!(extract(&ex, &req), Ok(b"acme".to_vec()));
        req.extensions_mut().insert(ShopId("ac me".into()));
        assert_eq!(extract(&ex, &req), Err(MissingKey::Invalid));
        req.extensions_mut().insert(ShopId(String::new()));
        assert_eq!(extract(&ex, &req), Err(MissingKey::Invalid));
    }

    #[test]
    fn header_names() {
        let req = with_headers(&[h("acme")]);
        let by_name = Tenant::header_name(HeaderName::from_static("x-shop"));
        assert_eq!(extract(&by_name, &req), Ok(b"acme".to_vec()));
        assert_eq!(
            extract(&Tenant::header("x-shop"), &req),
            Ok(b"acme".to_vec())
        );
    }

    #[test]
    #[should_panic(expected = "Tenant::header: \"x shop\" is not a valid HTTP header name")]
    fn invalid_header_name_panics_at_construction() {
        let _ = Tenant::header("x shop");
    }

    #[test]
    fn debug_names_the_source() {
        assert_eq!(
            format!("{:?}", shop()),
            r#"Tenant { header: "x-shop", max_len: 255 }"#
        );
        assert_eq!(
            format!("{:?}", Tenant::query("shop")),
            r#"Tenant { query: "shop", max_len: 255 }"#
        );
        assert!(format!("{:?}", Tenant::extension::<ShopId>()).contains("ShopId"));
    }
}
