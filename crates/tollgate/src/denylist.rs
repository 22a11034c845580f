//! Clients that a layer refuses outright: networks, principals, tenants.

use std::fmt;

use tollgate_engine::ConfigError;

use crate::key::{Cidr, ClientIp, Identity, KeyExtractor, RequestView};
use crate::rules::Rules;

/// Requests that a layer refuses whatever its limits say: from a network (by client address),
/// or whose key for an extractor is one of a set (a principal, a tenant).
///
/// A denylisted request is refused at once with `403 Forbidden` (a gRPC call with
/// `PERMISSION_DENIED`), a problem+json body and no `Retry-After` (a static deny has no end):
/// the backend is not asked, nothing is consumed, and the response carries no `RateLimit`
/// fields. Its [`Decision`](crate::Decision) says
/// [`Outcome::Denylisted`](crate::Outcome::Denylisted) for every limit (the denylist belongs
/// to the layer, not to one limit, so every limit refused the request, shadow limits too),
/// and `tollgate_decisions_total` counts `outcome="denylisted"` once per limit. A custom
/// responder ([`on_rejection`](crate::RateLimitLayerBuilder::on_rejection)) sees
/// [`RejectionKind::Denylisted`](crate::RejectionKind::Denylisted).
///
/// The [`Allowlist`](crate::Allowlist) wins: a request that matches both is admitted as
/// allowlisted. Rules are tried in order; a request that has no key for a rule (no address,
/// no tenant header) does not match it.
///
/// The denylist belongs to the layer's limits, as the allowlist does:
/// [`Limits::with_denylist`](crate::Limits::with_denylist) or
/// [`RateLimitLayerBuilder::denylist`](crate::RateLimitLayerBuilder::denylist), the
/// `[[denylist]]` tables of a [limits file](crate::LimitsFile), and a reload replaces it with
/// the new limits' own.
///
/// # Examples
///
/// ```
/// use tollgate::key::{ClientIp, Tenant};
/// use tollgate::{Denylist, Limit, Quota, RateLimitLayer};
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let deny = Denylist::new()
///     .networks(ClientIp::peer(), ["198.51.100.0/24".parse()?, "2001:db8:bad::/48".parse()?])
///     .keys(Tenant::header("x-shop-domain"), ["spam.example"])?;
/// let layer = RateLimitLayer::builder()
///     .limit(Limit::gcra("per-ip", Quota::per_minute(60)?)?, ClientIp::peer())
///     .denylist(deny)
///     .build()?;
/// # Ok(()) }
/// ```
#[derive(Default)]
pub struct Denylist {
    rules: Rules,
}

impl Denylist {
    /// An empty denylist: matches nothing.
    pub fn new() -> Self {
        Self::default()
    }

    /// Refuses requests whose client address, as `ip` finds it (the socket peer, or a trusted
    /// proxy's header), is in one of `networks`.
    pub fn networks(mut self, ip: ClientIp, networks: impl IntoIterator<Item = Cidr>) -> Self {
        self.rules.networks(ip, networks);
        self
    }

    /// Refuses requests whose key for `key` is the key of one of `identities` (see
    /// [`KeyExtractor::key_of`]): principals with [`Principal`](crate::key::Principal),
    /// tenants with [`Tenant`](crate::key::Tenant), any key with a custom extractor.
    ///
    /// # Errors
    ///
    /// [`ConfigError::InvalidDenylistEntry`] for an identity that no request could have
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
            .map_err(ConfigError::InvalidDenylistEntry)?;
        Ok(self)
    }

    /// The list of `rules` (read from a limits file).
    pub(crate) fn from_rules(rules: Rules) -> Self {
        Self { rules }
    }

    /// Appends `other`'s rules to this one's.
    pub(crate) fn extend(mut self, other: Denylist) -> Self {
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

    /// The rules, for people: one line each (`networks 198.51.100.0/24, ...` or
    /// `keys spam.example`).
    pub fn describe(&self) -> Vec<String> {
        self.rules.describe()
    }
}

impl fmt::Debug for Denylist {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.describe()).finish()
    }
}
