//! Clients that a layer admits without counting them: trusted networks, principals, tenants.

use std::fmt;

use tollgate_engine::ConfigError;

use crate::key::{Cidr, ClientIp, Identity, KeyExtractor, RequestView};
use crate::rules::Rules;

/// Requests that no limit of a layer counts: from a network (by client address), or whose key
/// for an extractor is one of a set (a principal, a tenant).
///
/// An allowlisted request is admitted at once: the backend is not asked, nothing is consumed,
/// the [`Decision`](crate::Decision) says [`Outcome::Allowlisted`](crate::Outcome::Allowlisted)
/// for every limit (and `tollgate_decisions_total` counts `outcome="allowlisted"`), and the
/// response carries no `RateLimit` fields. Rules are tried in order; a request that has no
/// key for a rule (no address, no tenant header) simply does not match it. The allowlist wins
/// over the [`Denylist`](crate::Denylist): a request that both match is admitted.
///
/// The allowlist belongs to the layer's limits: [`Limits::allowlist`](crate::Limits::allowlist)
/// or [`RateLimitLayerBuilder::allowlist`](crate::RateLimitLayerBuilder::allowlist), the
/// `[[allowlist]]` tables of a [limits file](crate::LimitsFile), and a reload replaces it with
/// the new limits' own.
///
/// # Examples
///
/// ```
/// use tollgate::key::{ClientIp, Principal, Tenant};
/// use tollgate::{Allowlist, Limit, Quota, RateLimitLayer};
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let allow = Allowlist::new()
///     .networks(ClientIp::peer(), ["10.0.0.0/8".parse()?, "2001:db8:1::/48".parse()?])
///     .keys(Principal::<String>::new(), ["ops-bot"])?
///     .keys(Tenant::header("x-shop-domain"), ["internal.example"])?;
/// let layer = RateLimitLayer::builder()
///     .limit(Limit::gcra("per-ip", Quota::per_minute(60)?)?, ClientIp::peer())
///     .allowlist(allow)
///     .build()?;
/// # Ok(()) }
/// ```
#[derive(Default)]
pub struct Allowlist {
    rules: Rules,
}

impl Allowlist {
    /// An empty allowlist: matches nothing.
    pub fn new() -> Self {
        Self::default()
    }

    /// Admits requests whose client address, as `ip` finds it (the socket peer, or a trusted
    /// proxy's header), is in one of `networks`.
    pub fn networks(mut self, ip: ClientIp, networks: impl IntoIterator<Item = Cidr>) -> Self {
        self.rules.networks(ip, networks);
        self
    }

    /// Admits requests whose key for `key` is the key of one of `identities` (see
    /// [`KeyExtractor::key_of`]): principals with [`Principal`](crate::key::Principal),
    /// tenants with [`Tenant`](crate::key::Tenant), any key with a custom extractor.
    ///
    /// # Errors
    ///
    /// [`ConfigError::InvalidAllowlistEntry`] for an identity that no request could have
    /// under `key` (an empty name, a tenant with characters tenants cannot have).
    pub fn keys<K, I>(
        mut self,
        key: K,
        identities: impl IntoIterator<Item = I>,
    ) -> Result<Self, ConfigError>
    where
        K: KeyExtractor,
        I: Into<Identity>,
    {
        self.rules
            .keys(key, identities)
            .map_err(ConfigError::InvalidAllowlistEntry)?;
        Ok(self)
    }

    /// The list of `rules` (read from a limits file).
    pub(crate) fn from_rules(rules: Rules) -> Self {
        Self { rules }
    }

    /// Appends `other`'s rules to this one's.
    pub(crate) fn extend(mut self, other: Allowlist) -> Self {
        self.rules.extend(other.rules);
        self
    }

    /// Whether there is no rule.
    pub fn is_empty(&self) -> bool {
        self.rules.is_empty()
    }

    /// Whether `req` matches a rule.
    pub(crate) fn matches(&self, req: &RequestView<'_>) -> bool {
        self.rules.matches(req)
    }

    /// The rules, for people: one line each (`networks 10.0.0.0/8, ...` or `keys ops-bot`).
    pub fn describe(&self) -> Vec<String> {
        self.rules.describe()
    }
}

impl fmt::Debug for Allowlist {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.describe()).finish()
    }
}
