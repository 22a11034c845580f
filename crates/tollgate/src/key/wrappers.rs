//! Boxed and shared extractors: each method forwards to the extractor held, so that a
//! wrapped extractor names identities and describes its keys as the one it holds does.

use super::{Identity, Key, KeyExtractor, MissingKey, RequestView};

impl<K: KeyExtractor + ?Sized> KeyExtractor for Box<K> {
    fn extract<'r>(&self, req: &RequestView<'r>) -> Result<Key<'r>, MissingKey> {
        (**self).extract(req)
    }

    fn key_of(&self, identity: &Identity) -> Result<Key<'static>, MissingKey> {
        (**self).key_of(identity)
    }

    fn describe(&self) -> String {
        (**self).describe()
    }

    fn identity_of(&self, key: &[u8]) -> String {
        (**self).identity_of(key)
    }
}

impl<K: KeyExtractor + ?Sized> KeyExtractor for std::sync::Arc<K> {
    fn extract<'r>(&self, req: &RequestView<'r>) -> Result<Key<'r>, MissingKey> {
        (**self).extract(req)
    }

    fn key_of(&self, identity: &Identity) -> Result<Key<'static>, MissingKey> {
        (**self).key_of(identity)
    }

    fn describe(&self) -> String {
        (**self).describe()
    }

    fn identity_of(&self, key: &[u8]) -> String {
        (**self).identity_of(key)
    }
}
