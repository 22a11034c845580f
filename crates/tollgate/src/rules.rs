//! Rules that match requests by client network or by key: what an [`Allowlist`] and a
//! [`Denylist`] are made of.
//!
//! [`Allowlist`]: crate::Allowlist
//! [`Denylist`]: crate::Denylist

use std::collections::HashSet;

use crate::key::{Cidr, ClientIp, Identity, KeyExtractor, RequestView};

/// Rules tried in order; a request that has no key for a rule (no address, no tenant header)
/// does not match it.
#[derive(Default)]
pub(crate) struct Rules {
    rules: Vec<Rule>,
}

enum Rule {
    Networks {
        ip: ClientIp,
        networks: Vec<Cidr>,
    },
    Keys {
        key: Box<dyn KeyExtractor>,
        keys: HashSet<Box<[u8]>>,
        names: Vec<String>,
    },
}

impl Rules {
    /// Adds a rule that matches requests whose client address, as `ip` finds it, is in one of
    /// `networks` (none: no rule).
    pub(crate) fn networks(&mut self, ip: ClientIp, networks: impl IntoIterator<Item = Cidr>) {
        let networks: Vec<Cidr> = networks.into_iter().collect();
        if !networks.is_empty() {
            self.rules.push(Rule::Networks { ip, networks });
        }
    }

    /// Adds a rule that matches requests whose key for `key` is the key of one of
    /// `identities` (none: no rule).
    ///
    /// # Errors
    ///
    /// The first identity that no request could have under `key`, in words.
    pub(crate) fn keys<K, I>(
        &mut self,
        key: K,
        identities: impl IntoIterator<Item = I>,
    ) -> Result<(), String>
    where
        K: KeyExtractor,
        I: Into<Identity>,
    {
        let mut keys = HashSet::new();
        let mut names = Vec::new();
        for identity in identities {
            let identity = identity.into();
            let bytes = key.key_of(&identity).map_err(|_| identity.to_string())?;
            keys.insert(Box::from(bytes.as_bytes()));
            names.push(identity.to_string());
        }
        if !keys.is_empty() {
            self.rules.push(Rule::Keys {
                key: Box::new(key),
                keys,
                names,
            });
        }
        Ok(())
    }

    /// Appends `other`'s rules.
    pub(crate) fn extend(&mut self, other: Rules) {
        self.rules.extend(other.rules);
    }

    /// Whether there is no rule.
    pub(crate) fn is_empty(&self) -> bool {
        self.rules.is_empty()
    }

    /// Whether `req` matches a rule.
    pub(crate) fn matches(&self, req: &RequestView<'_>) -> bool {
        self.rules.iter().any(|rule| match rule {
            Rule::Networks { ip, networks } => ip
                .client_ip(req)
                .is_ok_and(|addr| networks.iter().any(|n| n.contains(addr))),
            Rule::Keys { key, keys, .. } => {
                key.extract(req).is_ok_and(|k| keys.contains(k.as_bytes()))
            }
        })
    }

    /// The rules, for people: one line each (`networks 10.0.0.0/8, ...` or `keys ops-bot`).
    pub(crate) fn describe(&self) -> Vec<String> {
        self.rules
            .iter()
            .map(|rule| match rule {
                Rule::Networks { networks, .. } => {
                    let list: Vec<String> = networks.iter().map(ToString::to_string).collect();
                    format!("networks {}", list.join(", "))
                }
                Rule::Keys { names, .. } => format!("keys {}", names.join(", ")),
            })
            .collect()
    }
}
