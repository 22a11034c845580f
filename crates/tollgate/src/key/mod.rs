//! Key extraction: which bucket a request counts against.
//!
//! A [`KeyExtractor`] reads a request (through a [`RequestView`]) and returns a [`Key`] or
//! says why there is none ([`MissingKey`]); the limit's
//! [`MissingKeyPolicy`](tollgate_engine::MissingKeyPolicy) decides what happens then.
//!
//! Ready-made extractors:
//! - [`ClientIp`]: the client address, from the socket peer, or from `cf-connecting-ip` /
//!   `X-Forwarded-For` only when the peer is a trusted proxy. IPv6 grouped to /64.
//! - [`Tenant`]: a tenant such as a shop, from a header, a query parameter or an extension,
//!   normalised and validated.
//! - [`Principal`]: the authenticated principal from a request extension.
//! - [`ApiKey`]: an API key or bearer token, case-sensitive, a secret that is never shown.
//! - [`Global`]: one bucket for every request.
//! - [`key_fn`]: a closure, for anything else.
//!
//! Keys borrow from the request where they can and are at most [`MAX_KEY_LEN`] bytes: a longer
//! value is never a key.
//!
//! Reports of refused clients ([`KeyExtractor::identity_of`]) name keys by a [`fingerprint`]
//! unless told otherwise: a backend keeps them (Redis does, for two minutes), and a key is
//! often personal data or a secret. [`ClientIp`], [`Tenant`] and [`Principal`] name them as
//! they are once asked to (`reveal_identities`); an [`ApiKey`] never does.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use http::{Extensions, HeaderMap, Method, Uri};

mod api_key;
mod forwarded;
mod ip;
mod peer;
mod principal;
mod proxies;
mod tenant;
mod text;
mod wrappers;

pub use text::fingerprint;

pub use api_key::ApiKey;
pub use forwarded::ForwardedHeader;
pub use ip::ClientIp;
pub use principal::{Principal, PrincipalId};
pub use proxies::{Cidr, InvalidCidr, TrustedProxies};
pub use tenant::Tenant;

/// The longest key, in bytes.
pub const MAX_KEY_LEN: usize = 512;

const INLINE: usize = 24;

/// The identity a request is counted under, for one limit.
///
/// Only its bytes matter to backends, which hash them (keys never reach a store as they are).
/// Keys are equal when their bytes are, however they are stored.
#[derive(Clone)]
pub struct Key<'r>(Repr<'r>);

#[derive(Clone)]
enum Repr<'r> {
    Borrowed(&'r [u8]),
    Inline { len: u8, buf: [u8; INLINE] },
    Owned(Box<[u8]>),
}

impl<'r> Key<'r> {
    /// A key that borrows its bytes.
    ///
    /// # Errors
    ///
    /// [`MissingKey::TooLong`] past [`MAX_KEY_LEN`] bytes.
    pub fn borrowed(bytes: &'r [u8]) -> Result<Self, MissingKey> {
        check_len(bytes.len())?;
        Ok(Self(Repr::Borrowed(bytes)))
    }

    /// A key that owns its bytes (copied inline when short, without allocating).
    ///
    /// # Errors
    ///
    /// [`MissingKey::TooLong`] past [`MAX_KEY_LEN`] bytes.
    pub fn copied(bytes: &[u8]) -> Result<Key<'static>, MissingKey> {
        check_len(bytes.len())?;
        Ok(copy(bytes))
    }

    /// A key that owns `bytes`.
    ///
    /// # Errors
    ///
    /// [`MissingKey::TooLong`] past [`MAX_KEY_LEN`] bytes.
    pub fn owned(bytes: impl Into<Vec<u8>>) -> Result<Key<'static>, MissingKey> {
        let bytes = bytes.into();
        check_len(bytes.len())?;
        Ok(Key(Repr::Owned(bytes.into_boxed_slice())))
    }

    /// This key, owning its bytes: moved when it owns them already, else copied (inline
    /// when short, without allocating).
    pub(crate) fn into_owned(self) -> Key<'static> {
        match self.0 {
            Repr::Borrowed(bytes) => copy(bytes),
            Repr::Inline { len, buf } => Key(Repr::Inline { len, buf }),
            Repr::Owned(bytes) => Key(Repr::Owned(bytes)),
        }
    }

    /// The key's bytes.
    pub fn as_bytes(&self) -> &[u8] {
        match &self.0 {
            Repr::Borrowed(b) => b,
            Repr::Inline { len, buf } => &buf[..usize::from(*len)],
            Repr::Owned(b) => b,
        }
    }
}

/// A key that owns a copy of `bytes`, inline when short (`bytes` is at most `MAX_KEY_LEN`
/// long, checked by the caller).
fn copy(bytes: &[u8]) -> Key<'static> {
    if bytes.len() <= INLINE {
        let mut buf = [0; INLINE];
        buf[..bytes.len()].copy_from_slice(bytes);
        Key(Repr::Inline {
            len: bytes.len() as u8,
            buf,
        })
    } else {
        Key(Repr::Owned(bytes.into()))
    }
}

fn check_len(len: usize) -> Result<(), MissingKey> {
    if len > MAX_KEY_LEN {
        Err(MissingKey::TooLong)
    } else {
        Ok(())
    }
}

// By bytes: a borrowed key and an inline copy of the same bytes are the same identity.
impl PartialEq for Key<'_> {
    fn eq(&self, other: &Self) -> bool {
        self.as_bytes() == other.as_bytes()
    }
}

impl Eq for Key<'_> {}

impl fmt::Debug for Key<'_> {
    /// Shows the length only: keys can be personal data (addresses, e-mails).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Key({} bytes)", self.as_bytes().len())
    }
}

/// Why a request has no key for a limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum MissingKey {
    /// The header, parameter or extension the key comes from is not there.
    Absent,
    /// It is there but not a valid key (unparseable, bad characters, not UTF-8, empty).
    Invalid,
    /// Longer than [`MAX_KEY_LEN`] (or than the extractor allows).
    TooLong,
    /// Shorter than the extractor allows ([`ApiKey`]).
    TooShort,
    /// A character outside the extractor's alphabet ([`ApiKey`]).
    BadCharacter,
    /// No socket peer address: the server was not started with connect info.
    NoPeerAddress,
    /// An operator's [`Identity`] that is not an IP address, for a key of client addresses
    /// ([`ClientIp`]'s [`key_of`](KeyExtractor::key_of)). Requests never have it: a
    /// forwarded header that names no address is [`Invalid`](Self::Invalid).
    NotAnAddress,
}

impl MissingKey {
    /// A fixed label: `absent`, `invalid`, `too_long`, `too_short`, `bad_character`,
    /// `no_peer_address` or `not_an_address`.
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Absent => "absent",
            Self::Invalid => "invalid",
            Self::TooLong => "too_long",
            Self::TooShort => "too_short",
            Self::BadCharacter => "bad_character",
            Self::NoPeerAddress => "no_peer_address",
            Self::NotAnAddress => "not_an_address",
        }
    }
}

impl MissingKey {
    /// Whether the key is not there at all ([`Absent`](Self::Absent),
    /// [`NoPeerAddress`](Self::NoPeerAddress)): the limit's
    /// [`MissingKeyPolicy`](tollgate_engine::MissingKeyPolicy) applies. Any other is a key
    /// the request carries but that cannot be one, refused with 400 whatever the policy.
    pub fn is_absent(&self) -> bool {
        matches!(self, Self::Absent | Self::NoPeerAddress)
    }

    /// What went wrong, in a short sentence for people.
    pub fn message(&self) -> &'static str {
        match self {
            Self::Absent => "the rate-limit key is missing",
            Self::Invalid => "the rate-limit key is invalid",
            Self::TooLong => "the rate-limit key is too long",
            Self::TooShort => "the rate-limit key is too short",
            Self::BadCharacter => "the rate-limit key has a character outside its alphabet",
            Self::NoPeerAddress => "the client address is unknown",
            Self::NotAnAddress => "expected an IP address",
        }
    }
}

/// An extractor's [`describe`](KeyExtractor::describe) in words for a refusal: `header
/// "x-shop-domain"`, `query parameter "shop"`, `client address`.
pub(crate) fn source_for_people(describe: &str) -> String {
    if let Some(name) = describe.strip_prefix("header ") {
        format!("header \"{name}\"")
    } else if let Some(name) = describe.strip_prefix("query ") {
        format!("query parameter \"{name}\"")
    } else if describe == "ip" || describe.starts_with("ip (") {
        "client address".to_owned()
    } else if describe == "custom" {
        "key".to_owned()
    } else {
        describe.to_owned()
    }
}

impl MissingKey {
    /// What went wrong with the key from `source` (see [`Rejection::source`]), in words:
    /// `missing header "x-shop-domain"`; [`message`](Self::message) without a source.
    ///
    /// [`Rejection::source`]: crate::Rejection::source
    pub(crate) fn message_about(&self, source: Option<&str>) -> String {
        match (self, source) {
            (Self::Absent, Some(source)) => format!("missing {source}"),
            (Self::Invalid, Some(source)) => format!("invalid {source}"),
            (Self::TooLong, Some(source)) => format!("{source} too long"),
            (Self::TooShort, Some(source)) => format!("{source} too short"),
            (Self::BadCharacter, Some(source)) => {
                format!("{source} has a character outside the key alphabet")
            }
            _ => self.message().to_owned(),
        }
    }
}

impl fmt::Display for MissingKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.message())
    }
}

impl std::error::Error for MissingKey {}

/// An identity that cannot be a key of a limit: whom an operator named, under which limit,
/// and why ([`RateLimitLayer::peek`](crate::RateLimitLayer::peek) and
/// [`reset`](crate::RateLimitLayer::reset) answer it as
/// [`AdminError::Identity`](crate::AdminError::Identity)).
///
/// ```
/// use tollgate::key::{ClientIp, Identity, IdentityError, KeyExtractor};
///
/// let identity = Identity::from("abc");
/// let missing = ClientIp::peer().key_of(&identity).unwrap_err();
/// let e = IdentityError::new("per-ip", identity, missing);
/// assert_eq!(
///     e.to_string(),
///     r#""abc" is not an IP address: expected an IP address for rate limit "per-ip""#
/// );
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct IdentityError {
    limit: String,
    identity: Identity,
    missing: MissingKey,
}

impl IdentityError {
    /// `identity` is no key of the limit named `limit`, because of `missing` (what the
    /// limit's [`KeyExtractor::key_of`] answered).
    pub fn new(limit: &str, identity: Identity, missing: MissingKey) -> Self {
        Self {
            limit: limit.to_owned(),
            identity,
            missing,
        }
    }

    /// The limit's name.
    pub fn limit(&self) -> &str {
        &self.limit
    }

    /// Whom the operator named.
    pub fn identity(&self) -> &Identity {
        &self.identity
    }

    /// Why it is no key: [`MissingKey::NotAnAddress`] for a name under a limit of client
    /// addresses, [`MissingKey::Invalid`] or [`MissingKey::TooLong`] for a name no request
    /// could have.
    pub fn missing(&self) -> MissingKey {
        self.missing
    }
}

/// The words of `Display`: `main() -> Result<(), Box<dyn Error>>` prints an error with
/// `Debug`, and a person reading it needs what is wrong and how to fix it.
impl fmt::Debug for IdentityError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl fmt::Display for IdentityError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (identity, limit) = (self.identity.to_string(), &self.limit);
        match self.missing {
            MissingKey::NotAnAddress => write!(
                f,
                "{identity:?} is not an IP address: expected an IP address for rate limit {limit:?}"
            ),
            missing => write!(
                f,
                "{identity:?} is not a key of rate limit {limit:?}: {missing}"
            ),
        }
    }
}

impl std::error::Error for IdentityError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.missing)
    }
}

/// The parts of a request an extractor may read.
#[derive(Debug, Clone, Copy)]
pub struct RequestView<'r> {
    method: &'r Method,
    uri: &'r Uri,
    headers: &'r HeaderMap,
    extensions: &'r Extensions,
}

impl<'r> RequestView<'r> {
    /// A view of `req`.
    pub fn new<B>(req: &'r http::Request<B>) -> Self {
        Self {
            method: req.method(),
            uri: req.uri(),
            headers: req.headers(),
            extensions: req.extensions(),
        }
    }

    /// The method.
    pub fn method(&self) -> &'r Method {
        self.method
    }

    /// The URI.
    pub fn uri(&self) -> &'r Uri {
        self.uri
    }

    /// The headers.
    pub fn headers(&self) -> &'r HeaderMap {
        self.headers
    }

    /// The extensions (where authentication layers and `ConnectInfo` put their data).
    pub fn extensions(&self) -> &'r Extensions {
        self.extensions
    }
}

/// Finds the key a request counts under for one limit.
///
/// Implemented by the ready-made extractors and by [`key_fn`] closures.
pub trait KeyExtractor: Send + Sync + 'static {
    /// The key of `req`, or why it has none.
    ///
    /// # Errors
    ///
    /// [`MissingKey`] when the request has no valid key; the limit's missing-key policy applies.
    fn extract<'r>(&self, req: &RequestView<'r>) -> Result<Key<'r>, MissingKey>;

    /// The key of a request whose client is `identity`, as [`extract`](Self::extract) would
    /// find it: what operators' tools ([`RateLimitLayer::peek`](crate::RateLimitLayer::peek),
    /// [`reset`](crate::RateLimitLayer::reset), allowlists) use, so that nobody handles key
    /// bytes. [`ClientIp`] groups an address as it does a request's, [`Tenant`] normalises the
    /// name, [`Principal`] asks its [`PrincipalId`] type, [`Global`] has its one key.
    ///
    /// The default, for [`key_fn`] closures and other extractors, takes the identity's text
    /// (an address as written) as the key's bytes.
    ///
    /// # Errors
    ///
    /// [`MissingKey::Invalid`] (or `TooLong`) when no request could have this identity's key;
    /// [`MissingKey::NotAnAddress`] when the keys are client addresses and the identity is a
    /// name.
    fn key_of(&self, identity: &Identity) -> Result<Key<'static>, MissingKey> {
        Key::owned(identity.to_string())
    }

    /// What the keys are, in a few words for people (`ip`, `header x-shop-domain`, ...):
    /// what a limits file check prints. The default is `custom`.
    fn describe(&self) -> String {
        "custom".to_owned()
    }

    /// How the reports of refused clients name `key`, for operators. Reports are kept by the
    /// backend (Redis holds them for two minutes) and shown by `tollgate top`, so this is
    /// what reaches the store: the default is a [`fingerprint`] (`#` and 12 hex digits), never
    /// the key. [`ApiKey`] shows a fingerprint a person recognises (`sk_live_…a1b2`);
    /// [`ClientIp`], [`Tenant`] and [`Principal`] show a fingerprint unless asked to reveal
    /// identities (an address or a network such as `2001:db8::/64`, a tenant's name, what the
    /// [`PrincipalId`] type reads). Implement it to show your own keys' text.
    fn identity_of(&self, key: &[u8]) -> String {
        fingerprint(key)
    }
}

/// Whom an operator means: a client address, or a name (a tenant, a principal's id), as it
/// appears in requests. See [`KeyExtractor::key_of`].
///
/// ```
/// use tollgate::key::{ClientIp, Identity, KeyExtractor};
///
/// let ip: std::net::IpAddr = "2001:db8::1".parse().unwrap();
/// // One /64 is one client: any address in it has the same key.
/// let same: Identity = "2001:db8::ffff".parse().unwrap();
/// let ex = ClientIp::peer();
/// assert_eq!(ex.key_of(&ip.into()).unwrap(), ex.key_of(&same).unwrap());
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Identity {
    /// A client address.
    Ip(IpAddr),
    /// A name: a tenant, a principal's id, or any other key's text.
    Name(String),
}

impl Identity {
    /// The address this identity is, or names (text that parses as an address).
    pub fn ip(&self) -> Option<IpAddr> {
        match self {
            Self::Ip(ip) => Some(*ip),
            Self::Name(name) => name.trim().parse().ok(),
        }
    }
}

impl fmt::Display for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Ip(ip) => ip.fmt(f),
            Self::Name(name) => f.write_str(name),
        }
    }
}

impl std::str::FromStr for Identity {
    type Err = std::convert::Infallible;

    /// An address when the text is one, else a name.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(Self::from(s))
    }
}

impl From<IpAddr> for Identity {
    fn from(ip: IpAddr) -> Self {
        Self::Ip(ip)
    }
}

impl From<Ipv4Addr> for Identity {
    fn from(ip: Ipv4Addr) -> Self {
        Self::Ip(ip.into())
    }
}

impl From<Ipv6Addr> for Identity {
    fn from(ip: Ipv6Addr) -> Self {
        Self::Ip(ip.into())
    }
}

impl From<&str> for Identity {
    /// An address when the text is one, else a name.
    fn from(s: &str) -> Self {
        match s.trim().parse::<IpAddr>() {
            Ok(ip) => Self::Ip(ip),
            Err(_) => Self::Name(s.to_owned()),
        }
    }
}

impl From<String> for Identity {
    /// An address when the text is one, else a name.
    fn from(s: String) -> Self {
        match s.trim().parse::<IpAddr>() {
            Ok(ip) => Self::Ip(ip),
            Err(_) => Self::Name(s),
        }
    }
}

impl From<&String> for Identity {
    fn from(s: &String) -> Self {
        Self::from(s.as_str())
    }
}

/// One bucket for every request.
#[derive(Debug, Clone, Copy, Default)]
pub struct Global;

impl KeyExtractor for Global {
    fn extract<'r>(&self, _: &RequestView<'r>) -> Result<Key<'r>, MissingKey> {
        Ok(Key(Repr::Borrowed(b"global")))
    }

    /// The one key, whoever is named.
    fn key_of(&self, _: &Identity) -> Result<Key<'static>, MissingKey> {
        Ok(Key(Repr::Borrowed(b"global")))
    }

    fn describe(&self) -> String {
        "global".to_owned()
    }

    /// `global`: the one key names no one.
    fn identity_of(&self, _: &[u8]) -> String {
        "global".to_owned()
    }
}

/// A key extractor from a closure. See [`key_fn`].
#[derive(Clone, Copy)]
pub struct FnKey<F>(F);

impl<F> fmt::Debug for FnKey<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("FnKey")
    }
}

/// Extracts keys with a closure that returns the key's bytes, or `None` when the request has no
/// key.
///
/// # Examples
///
/// ```
/// use tollgate::key::{key_fn, KeyExtractor, RequestView};
///
/// let by_path = key_fn(|req: &RequestView<'_>| Some(req.uri().path().as_bytes().to_vec()));
/// let req = http::Request::get("/search").body(()).unwrap();
/// assert_eq!(by_path.extract(&RequestView::new(&req)).unwrap().as_bytes(), b"/search");
/// ```
pub fn key_fn<F>(f: F) -> FnKey<F>
where
    F: Fn(&RequestView<'_>) -> Option<Vec<u8>> + Send + Sync + 'static,
{
    FnKey(f)
}

impl<F> KeyExtractor for FnKey<F>
where
    F: Fn(&RequestView<'_>) -> Option<Vec<u8>> + Send + Sync + 'static,
{
    fn extract<'r>(&self, req: &RequestView<'r>) -> Result<Key<'r>, MissingKey> {
        (self.0)(req).ok_or(MissingKey::Absent).and_then(Key::owned)
    }
}

#[cfg(test)]
mod tests;
