use std::sync::Arc;

use super::*;
use crate::key::text::key_text;

/// A shared or boxed extractor names identities as the extractor it holds does: the
/// default `key_of` (the identity's text) would be another key than requests have.
#[test]
fn wrappers_forward_key_of_and_describe() {
    let ip: IpAddr = "203.0.113.7".parse().unwrap();
    let want = ClientIp::peer().key_of(&ip.into()).unwrap();
    let wrapped: [Box<dyn KeyExtractor>; 2] = [
        Box::new(Arc::new(ClientIp::peer())),
        Box::new(ClientIp::peer()),
    ];
    for ex in wrapped {
        assert_eq!(ex.key_of(&ip.into()).unwrap(), want);
        assert_eq!(
            ex.key_of(&Identity::from("abc")),
            Err(MissingKey::NotAnAddress)
        );
        assert_eq!(ex.describe(), "ip");
    }
}

/// Once asked to reveal identities, a report names a key as requests carry it: an address or
/// network for client addresses, the text of a name, and bytes that are no text in hex.
#[test]
fn identities_of_keys_read_as_requests_carry_them() {
    let ex = ClientIp::peer().reveal_identities();
    let v4 = ex.key_of(&Identity::from("203.0.113.7")).unwrap();
    assert_eq!(ex.identity_of(v4.as_bytes()), "203.0.113.7");
    let v6 = ex.key_of(&Identity::from("2001:db8:1:2:3:4:5:6")).unwrap();
    assert_eq!(ex.identity_of(v6.as_bytes()), "2001:db8:1:2::/64");
    let v4_24 = ClientIp::peer()
        .ipv4_prefix(24)
        .unwrap()
        .reveal_identities();
    let net = v4_24.key_of(&Identity::from("198.51.100.9")).unwrap();
    assert_eq!(v4_24.identity_of(net.as_bytes()), "198.51.100.0/24");
    let boxed: Box<dyn KeyExtractor> = Box::new(Arc::new(ClientIp::peer().reveal_identities()));
    assert_eq!(boxed.identity_of(v4.as_bytes()), "203.0.113.7");
    assert_eq!(Global.identity_of(b"global"), "global");
    assert_eq!(key_text(b"shop-1"), "shop-1");
    assert_eq!(key_text(&[0xff, 0x01]), "0xff01");
    let p = Principal::<u64>::new().reveal_identities();
    let id = p.key_of(&Identity::from("42")).unwrap();
    assert_eq!(p.identity_of(id.as_bytes()), "42");
    let t = Tenant::header("x-shop").reveal_identities();
    assert_eq!(t.identity_of(b"acme"), "acme");
}

/// Unless asked, reports name every key by its fingerprint: `#` and 12 hex digits, the same
/// for every extractor, never the key's text.
#[test]
fn identities_are_fingerprints_by_default() {
    let ip = ClientIp::peer()
        .key_of(&Identity::from("203.0.113.7"))
        .unwrap();
    let f = fingerprint(ip.as_bytes());
    assert_eq!(ClientIp::peer().identity_of(ip.as_bytes()), f);
    assert_eq!(f.len(), 13);
    assert!(f.starts_with('#') && f[1..].bytes().all(|b| b.is_ascii_hexdigit()));
    assert_ne!(fingerprint(b"acme"), fingerprint(b"acmf"));
    assert_eq!(
        Tenant::header("x-shop").identity_of(b"acme"),
        fingerprint(b"acme")
    );
    let p = Principal::<u64>::new();
    assert_eq!(
        p.identity_of(&42u64.to_le_bytes()),
        fingerprint(&42u64.to_le_bytes())
    );
    let custom = key_fn(|_: &RequestView<'_>| None);
    assert_eq!(
        custom.identity_of(b"tok_secret"),
        fingerprint(b"tok_secret")
    );
    let boxed: Box<dyn KeyExtractor> = Box::new(Arc::new(Tenant::header("x-shop")));
    assert_eq!(boxed.identity_of(b"acme"), fingerprint(b"acme"));
    assert_eq!(Global.identity_of(b"global"), "global");
}
