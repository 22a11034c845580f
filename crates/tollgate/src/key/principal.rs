//! Principal keys: the authenticated user or API client, from a request extension.

use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;

use super::{Key, KeyExtractor, MissingKey, RequestView};

/// A value that identifies an authenticated principal, as stored in request extensions.
///
/// Implemented for `String`, `Box<str>`, `Arc<str>` (the key borrows the string; an empty
/// string is [`MissingKey::Invalid`]) and for `u64`, `u128`, `i64` (the key is the number's
/// little-endian bytes, stored inline). Implement it for your own identity type, usually by
/// delegating to one of these.
pub trait PrincipalId: Send + Sync + 'static {
    /// The key bytes of this principal.
    ///
    /// # Errors
    ///
    /// A [`MissingKey`] when this value identifies no one (for example an empty string) or is
    /// longer than [`MAX_KEY_LEN`](super::MAX_KEY_LEN).
    fn principal_id(&self) -> Result<Key<'_>, MissingKey>;

    /// The key bytes of the principal named `identity`, as an operator writes it (for
    /// [`KeyExtractor::key_of`]): the same bytes [`principal_id`](Self::principal_id) gives
    /// the value that `identity` names. The default takes the text's bytes, which is right for
    /// string ids; the integers parse the text as a decimal number. A type whose key is not
    /// its text (a wrapper around an integer, say) implements this too.
    ///
    /// # Errors
    ///
    /// [`MissingKey::Invalid`] when the text names no principal of this type.
    fn identity_key(identity: &str) -> Result<Key<'static>, MissingKey>
    where
        Self: Sized,
    {
        str_id(identity).and_then(|key| Key::copied(key.as_bytes()))
    }

    /// How an operator writes the principal whose key bytes are `key` (the reports of refused
    /// clients, once the [`Principal`] reveals identities): the inverse of
    /// [`identity_key`](Self::identity_key). The default shows UTF-8
    /// as its text (string ids), other bytes in hex; the integers read their number.
    fn identity_text(key: &[u8]) -> String
    where
        Self: Sized,
    {
        super::text::key_text(key)
    }
}

/// An empty identifier is what a half-configured authentication layer produces; counting every
/// such request in one shared bucket would hide the bug and throttle unrelated users together.
fn str_id(s: &str) -> Result<Key<'_>, MissingKey> {
    if s.is_empty() {
        return Err(MissingKey::Invalid);
    }
    Key::borrowed(s.as_bytes())
}

impl PrincipalId for String {
    fn principal_id(&self) -> Result<Key<'_>, MissingKey> {
        str_id(self)
    }
}

impl PrincipalId for Box<str> {
    fn principal_id(&self) -> Result<Key<'_>, MissingKey> {
        str_id(self)
    }
}

impl PrincipalId for Arc<str> {
    fn principal_id(&self) -> Result<Key<'_>, MissingKey> {
        str_id(self)
    }
}

impl PrincipalId for u64 {
    fn principal_id(&self) -> Result<Key<'_>, MissingKey> {
        Key::copied(&self.to_le_bytes())
    }

    fn identity_text(key: &[u8]) -> String {
        match <[u8; std::mem::size_of::<Self>()]>::try_from(key) {
            Ok(bytes) => Self::from_le_bytes(bytes).to_string(),
            Err(_) => super::text::hex(key),
        }
    }

    fn identity_key(identity: &str) -> Result<Key<'static>, MissingKey> {
        let id: Self = identity.trim().parse().map_err(|_| MissingKey::Invalid)?;
        Key::copied(&id.to_le_bytes())
    }
}

impl PrincipalId for u128 {
    fn principal_id(&self) -> Result<Key<'_>, MissingKey> {
        Key::copied(&self.to_le_bytes())
    }

    fn identity_text(key: &[u8]) -> String {
        match <[u8; std::mem::size_of::<Self>()]>::try_from(key) {
            Ok(bytes) => Self::from_le_bytes(bytes).to_string(),
            Err(_) => super::text::hex(key),
        }
    }

    fn identity_key(identity: &str) -> Result<Key<'static>, MissingKey> {
        let id: Self = identity.trim().parse().map_err(|_| MissingKey::Invalid)?;
        Key::copied(&id.to_le_bytes())
    }
}

impl PrincipalId for i64 {
    fn principal_id(&self) -> Result<Key<'_>, MissingKey> {
        Key::copied(&self.to_le_bytes())
    }

    fn identity_text(key: &[u8]) -> String {
        match <[u8; std::mem::size_of::<Self>()]>::try_from(key) {
            Ok(bytes) => Self::from_le_bytes(bytes).to_string(),
            Err(_) => super::text::hex(key),
        }
    }

    fn identity_key(identity: &str) -> Result<Key<'static>, MissingKey> {
        let id: Self = identity.trim().parse().map_err(|_| MissingKey::Invalid)?;
        Key::copied(&id.to_le_bytes())
    }
}

/// Keys requests by the authenticated principal: the `T` an authentication layer inserted into
/// the request extensions.
///
/// The rate-limit layer must run after (inside) the authentication layer, or every request is
/// [`MissingKey::Absent`]; the limit's missing-key policy then decides what anonymous requests
/// get.
///
/// # Examples
///
/// ```
/// use tollgate::key::{Key, KeyExtractor, MissingKey, Principal, PrincipalId, RequestView};
///
/// // What the authentication layer inserts.
/// #[derive(Clone)]
/// struct UserId(u64);
///
/// impl PrincipalId for UserId {
///     fn principal_id(&self) -> Result<Key<'_>, MissingKey> {
///         self.0.principal_id()
///     }
/// }
///
/// let by_user = Principal::<UserId>::new();
///
/// let mut req = http::Request::get("/").body(()).unwrap();
/// assert_eq!(by_user.extract(&RequestView::new(&req)), Err(MissingKey::Absent));
///
/// req.extensions_mut().insert(UserId(42));
/// let key = by_user.extract(&RequestView::new(&req)).unwrap();
/// assert_eq!(key.as_bytes(), 42u64.to_le_bytes());
/// ```
pub struct Principal<T> {
    // `fn() -> T`: the extractor holds no `T`, so it is `Send + Sync` whatever `T` is.
    _id: PhantomData<fn() -> T>,
    reveal: bool,
}

impl<T: PrincipalId> Principal<T> {
    /// Reads the principal from the request extension of type `T`.
    pub fn new() -> Self {
        Self {
            _id: PhantomData,
            reveal: false,
        }
    }

    /// Reports of refused clients name principals as [`PrincipalId::identity_text`] reads
    /// them instead of by a [`fingerprint`](super::fingerprint): the ids then reach the
    /// backend (Redis keeps reports for two minutes) and whoever reads it.
    pub fn reveal_identities(mut self) -> Self {
        self.reveal = true;
        self
    }
}

impl<T: PrincipalId> Default for Principal<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T> Clone for Principal<T> {
    fn clone(&self) -> Self {
        Self {
            _id: PhantomData,
            reveal: self.reveal,
        }
    }
}

impl<T> fmt::Debug for Principal<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Principal<{}>", std::any::type_name::<T>())
    }
}

impl<T: PrincipalId> KeyExtractor for Principal<T> {
    fn extract<'r>(&self, req: &RequestView<'r>) -> Result<Key<'r>, MissingKey> {
        req.extensions()
            .get::<T>()
            .ok_or(MissingKey::Absent)?
            .principal_id()
    }

    /// What [`PrincipalId::identity_key`] makes of the identity's text.
    fn key_of(&self, identity: &super::Identity) -> Result<Key<'static>, MissingKey> {
        T::identity_key(&identity.to_string())
    }

    /// A [`fingerprint`](super::fingerprint); what [`PrincipalId::identity_text`] reads once
    /// asked to reveal identities ([`reveal_identities`](Self::reveal_identities)).
    fn identity_of(&self, key: &[u8]) -> String {
        if self.reveal {
            T::identity_text(key)
        } else {
            super::fingerprint(key)
        }
    }

    fn describe(&self) -> String {
        let name = std::any::type_name::<T>();
        format!("principal {}", name.rsplit("::").next().unwrap_or(name))
    }
}

#[cfg(test)]
mod tests {
    use super::super::{Repr, MAX_KEY_LEN};
    use super::*;

    fn extract<T: PrincipalId + Clone>(id: Option<T>) -> Result<Vec<u8>, MissingKey> {
        let mut req = http::Request::get("/").body(()).unwrap();
        if let Some(id) = id {
            req.extensions_mut().insert(id);
        }
        Principal::<T>::new()
            .extract(&RequestView::new(&req))
            .map(|key| key.as_bytes().to_vec())
    }

    #[test]
    fn present() {
        assert_eq!(extract(Some(String::from("alice"))), Ok(b"alice".to_vec()));
        assert_eq!(extract(Some(Box::<str>::from("bob"))), Ok(b"bob".to_vec()));
        assert_eq!(
            extract(Some(Arc::<str>::from("carol"))),
            Ok(b"carol".to_vec())
        );
        assert_eq!(
            extract(Some(0x0102_0304_0506_0708_u64)),
            Ok(vec![8, 7, 6, 5, 4, 3, 2, 1])
        );
        assert_eq!(
            extract(Some(1_u128)),
            Ok({
                let mut v = vec![0; 16];
                v[0] = 1;
                v
            })
        );
        assert_eq!(extract(Some(-1_i64)), Ok(vec![0xff; 8]));
    }

    #[test]
    fn absent() {
        assert_eq!(extract::<String>(None), Err(MissingKey::Absent));
        assert_eq!(extract::<u64>(None), Err(MissingKey::Absent));
        // Another type in the extensions is not the principal.
        let mut req = http::Request::get("/").body(()).unwrap();
        req.extensions_mut().insert(7_u64);
        assert_eq!(
            Principal::<String>::new().extract(&RequestView::new(&req)),
            Err(MissingKey::Absent)
        );
    }

    #[test]
    fn invalid_ids() {
        assert_eq!(extract(Some(String::new())), Err(MissingKey::Invalid));
        assert_eq!(
            extract(Some("x".repeat(MAX_KEY_LEN + 1))),
            Err(MissingKey::TooLong)
        );
    }

    #[test]
    fn keys_borrow_strings_and_inline_numbers() {
        let mut req = http::Request::get("/").body(()).unwrap();
        req.extensions_mut().insert(String::from("alice"));
        req.extensions_mut().insert(9_u128);
        let view = RequestView::new(&req);
        let key = Principal::<String>::new().extract(&view).unwrap();
        assert!(matches!(key.0, Repr::Borrowed(_)));
        let key = Principal::<u128>::default().extract(&view).unwrap();
        assert!(matches!(key.0, Repr::Inline { .. }));
    }

    #[test]
    fn debug_and_clone_need_nothing_from_t() {
        struct Opaque;
        impl PrincipalId for Opaque {
            fn principal_id(&self) -> Result<Key<'_>, MissingKey> {
                Err(MissingKey::Invalid)
            }
        }
        let p = Principal::<Opaque>::new();
        let cloned = p.clone();
        assert!(format!("{cloned:?}").starts_with("Principal<"));
        assert!(format!("{cloned:?}").ends_with("Opaque>"));
    }
}
