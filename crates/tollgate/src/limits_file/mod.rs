//! The declarative limits file: named limits in TOML.
//!
//! The format is described in `docs/limits-file.md`.

use std::collections::BTreeMap;
use std::fmt;
use std::num::NonZeroU32;
use std::ops::Range;
use std::path::Path;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use http::HeaderName;
use tollgate_engine::{
    Algorithm, ConfigError, Limit, MissingKeyPolicy, Quota, DEFAULT_SLOT_TTL, MAX_CHECKS,
};
use toml::Spanned;

use crate::allowlist::Allowlist;
use crate::denylist::Denylist;
use crate::key::{
    ApiKey, Cidr, ClientIp, ForwardedHeader, Global, Identity, KeyExtractor, Principal,
    PrincipalId, Tenant, TrustedProxies,
};
use crate::layer::limits::Limits;

pub(crate) mod error;
mod overflow;
mod spec;

use crate::rules::Rules;
use error::LimitsFileError;
use error::{said, Mistake};
use spec::{
    parse_period, FailureSpec, FileSpec, IpSpec, KeySpec, LimitSpec, ListSpec, QuotaField,
    QuotaSpec, Trusted,
};

type MakeKey = Arc<dyn Fn() -> Box<dyn KeyExtractor> + Send + Sync>;

/// Which list a table fills: `[[allowlist]]` or `[[denylist]]`, read alike.
#[derive(Clone, Copy)]
enum List {
    Allow,
    Deny,
}

impl List {
    fn word(self) -> &'static str {
        match self {
            Self::Allow => "allowlist",
            Self::Deny => "denylist",
        }
    }

    fn a(self) -> &'static str {
        match self {
            Self::Allow => "an allowlist",
            Self::Deny => "a denylist",
        }
    }

    /// The error of an entry that no request could have.
    fn entry_error(self, entry: String) -> ConfigError {
        match self {
            Self::Allow => ConfigError::InvalidAllowlistEntry(entry),
            Self::Deny => ConfigError::InvalidDenylistEntry(entry),
        }
    }
}

/// Reads limits from TOML: the loader, with the Rust types the file's principals are bound to.
///
/// ```
/// use tollgate::{LimitsFile, RateLimitLayer};
///
/// # fn main() -> Result<(), tollgate::LimitsFileError> {
/// let text = r#"
/// [[limit]]
/// name = "per-token"
/// algorithm = "fixed_window"
/// period = "1m"
/// key = "principal"
/// [limit.quota]
/// default = 5
/// pro = 50
/// "#;
/// let limits = LimitsFile::new().principal::<String>().parse(text)?;
/// let layer = RateLimitLayer::builder().limits(limits).build()?;
/// assert_eq!(layer.limits()[0].quota_of(Some("pro")).1.limit(), 50);
/// # Ok(()) }
/// ```
#[derive(Clone, Default)]
pub struct LimitsFile {
    principals: BTreeMap<String, MakeKey>,
    any_principal: bool,
}

impl fmt::Debug for LimitsFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LimitsFile")
            .field("principals", &self.principals.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl LimitsFile {
    /// A loader with no principal bound: the file may use IP, header and global keys.
    pub fn new() -> Self {
        Self::default()
    }

    /// Binds `key = "principal"` to the request extension `T` (see [`Principal`]).
    pub fn principal<T: PrincipalId>(self) -> Self {
        self.principal_named::<T>("principal")
    }

    /// Binds `key = { principal = "name" }` to the request extension `T`, for files with
    /// several kinds of principal.
    pub fn principal_named<T: PrincipalId>(mut self, name: &str) -> Self {
        let make: MakeKey = Arc::new(|| Box::new(Principal::<T>::new()));
        self.principals.insert(name.to_owned(), make);
        self
    }

    /// Binds every principal name that no other call bound to string ids (`String`): for tools
    /// that check a file without the application's types, such as `tollgate check`.
    pub fn any_principal(mut self) -> Self {
        self.any_principal = true;
        self
    }

    /// Parses `text` into limits.
    ///
    /// # Errors
    ///
    /// A [`LimitsFileError`] with the line and column of the mistake: TOML that does not
    /// parse, a field this format does not have, or a limit that cannot be built.
    pub fn parse(&self, text: &str) -> Result<Limits, LimitsFileError> {
        let file: FileSpec = toml::from_str(text).map_err(|e| {
            // A field of the wrong shape or that this format does not have, with the name of
            // the limit it is in, as other mistakes are said.
            let mut message = said(e.message());
            let field = e
                .span()
                .and_then(|span| spec::field_among_plans(text, span.start));
            if let (Some(field), true) = (field, message.starts_with("a quota is")) {
                message.push_str(&format!(
                    " (`{field}` is a field of the limit: write it above `[limit.quota]`, \
                     whose lines are plans)"
                ));
            }
            // A key given twice: which, as the parser does not say.
            if message == "duplicate key" {
                if let Some(key) = e.span().and_then(|span| spec::key_at(text, span.start)) {
                    message = format!("`{key}` is given twice (duplicate key)");
                }
            }
            let limit = e.span().and_then(|span| {
                spec::limit_holding(text, span.start)
                    .or_else(|| spec::limit_around(text, span.start))
            });
            let message = match limit {
                Some(name) => format!("limit {name:?}: {message}"),
                None => message,
            };
            LimitsFileError::at(text, e.span(), &message)
        })?;
        let mut limits = Limits::new();
        // What only the whole set can say, where it is said: a name given twice (at its
        // second `name`), more limits than a layer takes (at the first too many `[[limit]]`).
        for (i, spec) in file.limit.iter().enumerate() {
            let name = &spec.get_ref().name;
            let earlier = file.limit[..i].iter().map(|s| &s.get_ref().name);
            if let Some(first) = earlier.into_iter().find(|n| n.get_ref() == name.get_ref()) {
                let (line, _) = LimitsFileError::position(text, first.span().start);
                return Err(LimitsFileError::at(
                    text,
                    Some(name.span()),
                    &format!(
                        "two limits are named {:?} (the first at line {line})",
                        name.get_ref()
                    ),
                ));
            }
            if i == MAX_CHECKS {
                return Err(LimitsFileError::at(
                    text,
                    Some(spec.span()),
                    &format!("a layer holds at most {MAX_CHECKS} limits"),
                ));
            }
        }
        for spec in &file.limit {
            let (limit, key) = self.build(spec).map_err(|m| m.in_text(text))?;
            limits.push(limit, key);
        }
        if limits.is_empty() {
            return Err(LimitsFileError::at(text, None, "the file has no [[limit]]"));
        }
        for spec in &file.allowlist {
            let rules = self.rules(spec, List::Allow).map_err(|m| m.in_text(text))?;
            limits.add_allowlist(Allowlist::from_rules(rules));
        }
        for spec in &file.denylist {
            let rules = self.rules(spec, List::Deny).map_err(|m| m.in_text(text))?;
            limits.add_denylist(Denylist::from_rules(rules));
        }
        // What only the whole set can say (duplicate names, too many limits).
        limits
            .check()
            .map_err(|e| LimitsFileError::at(text, None, &e.to_string()))?;
        Ok(limits)
    }

    /// Reads and parses the file at `path`.
    ///
    /// # Errors
    ///
    /// As [`LimitsFile::parse`], or a file that cannot be read.
    pub fn read(&self, path: impl AsRef<Path>) -> Result<Limits, LimitsFileError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path)
            .map_err(|e| LimitsFileError::whole(format!("cannot read {}: {e}", path.display())))?;
        self.parse(&text)
    }

    fn build(&self, table: &Spanned<LimitSpec>) -> Result<(Limit, Box<dyn KeyExtractor>), Mistake> {
        let spec = table.get_ref();
        let name = spec.name.get_ref();
        // Each mistake is said at the value that makes it, with the limit's name.
        let at = |span: Range<usize>| move |e: &dyn fmt::Display| Mistake::in_limit(name, span, e);
        let algorithm = match &spec.algorithm {
            None => Algorithm::Gcra,
            Some(a) => match a.get_ref().as_str() {
                "gcra" => Algorithm::Gcra,
                "fixed_window" => Algorithm::FixedWindow,
                "sliding_log" => Algorithm::SlidingLog,
                "concurrency" => Algorithm::Concurrency,
                other => {
                    return Err(at(a.span())(&format_args!(
                        "unknown algorithm {other:?} (gcra, fixed_window, sliding_log, concurrency)"
                    )))
                }
            },
        };
        // A concurrency limit's quotas are requests in flight: their period is how long a
        // slot lives unless renewed (`slot_ttl`), not a period the file says.
        let concurrent = algorithm == Algorithm::Concurrency;
        let period = match (&spec.period, &spec.slot_ttl) {
            (Some(p), _) if concurrent => {
                return Err(at(p.span())(
                    &"a concurrency limit has no period: its quota is requests in flight \
                      (`slot_ttl` says how long a slot lives unless renewed)",
                ))
            }
            (_, Some(ttl)) if !concurrent => {
                return Err(at(ttl.span())(&"only a concurrency limit has a `slot_ttl`"))
            }
            (None, Some(ttl)) => {
                let period =
                    parse_period("slot_ttl", ttl.get_ref()).map_err(|e| at(ttl.span())(&e))?;
                if period < Duration::from_secs(1) {
                    return Err(at(ttl.span())(
                        &"a slot_ttl must be 1s or longer (a slot is renewed every third of it)",
                    ));
                }
                period
            }
            (None, None) if concurrent => DEFAULT_SLOT_TTL,
            (None, _) => {
                return Err(at(table.span())(
                    &"a limit needs a `period` (\"1m\", \"1h\", ...)",
                ))
            }
            (Some(p), _) => parse_period("period", p.get_ref()).map_err(|e| at(p.span())(&e))?,
        };
        let quota = |q: &Spanned<QuotaSpec>| -> Result<Quota, Mistake> {
            let (limit, burst) = match *q.get_ref() {
                QuotaSpec::Limit(limit) => (limit, None),
                QuotaSpec::Burst { limit, burst } => (limit, burst),
            };
            let quota = Quota::new(limit, period).and_then(|quota| match burst {
                Some(b) => quota.with_burst(b),
                None => Ok(quota),
            });
            quota.map_err(|e| at(q.span())(&e))
        };
        // `quota = 5`, or `[limit.quota]` with a `default` and a line per plan.
        let no_plans = BTreeMap::new();
        let (default, plans) = match spec.quota.get_ref() {
            QuotaField::Default(n) => (
                Spanned::new(spec.quota.span(), QuotaSpec::Limit(*n)),
                &no_plans,
            ),
            QuotaField::Plans(plans) => match plans.get("default") {
                Some(default) => (default.clone(), plans),
                None => {
                    return Err(at(spec.quota.span())(
                        &"the quota needs a `default` (the quota of requests without a plan)",
                    ))
                }
            },
        };
        let default_quota = quota(&default)?;
        let mut limit = Limit::new(name, algorithm, default_quota).map_err(|e| match e {
            ConfigError::InvalidName(_) | ConfigError::ReservedName(_) => at(spec.name.span())(&e),
            _ => at(default.span())(&e),
        })?;
        if let (true, Some(ttl)) = (concurrent, &spec.slot_ttl) {
            // Before the plans: it sets the default quota's period only.
            limit = limit
                .with_slot_ttl(period)
                .map_err(|e| at(ttl.span())(&e))?;
        }
        for (plan, q) in plans.iter().filter(|(p, _)| p.get_ref() != "default") {
            if let Some(mistake) = spec::plan_mistake(plan.get_ref()) {
                return Err(at(plan.span())(&mistake));
            }
            limit = limit
                .plan(plan.get_ref(), quota(q)?)
                .map_err(|e| at(q.span())(&e))?;
        }
        if let Some(cost) = &spec.cost {
            limit = limit
                .with_cost(*cost.get_ref())
                .map_err(|e| at(cost.span())(&e))?;
        }
        limit = match &spec.failure {
            None => limit,
            Some(failure) => match failure.get_ref() {
                FailureSpec::Word(w) if w == "open" => limit.fail_open(),
                FailureSpec::Word(w) if w == "closed" => limit.fail_closed(),
                FailureSpec::Fallback { fallback } => match NonZeroU32::new(*fallback) {
                    Some(replicas) => limit.fallback(replicas),
                    None => return Err(at(failure.span())(&"fallback needs 1 replica or more")),
                },
                FailureSpec::Word(w) => {
                    return Err(at(failure.span())(&format_args!(
                        "unknown failure policy {w:?} (open, closed, {{ fallback = N }})"
                    )))
                }
            },
        };
        limit = match &spec.missing_key {
            None => limit.on_missing_key(MissingKeyPolicy::Reject),
            Some(policy) => match policy.get_ref().as_str() {
                "reject" => limit.on_missing_key(MissingKeyPolicy::Reject),
                "skip" => limit.on_missing_key(MissingKeyPolicy::Skip),
                "shared_bucket" => limit.on_missing_key(MissingKeyPolicy::SharedBucket),
                other => {
                    return Err(at(policy.span())(&format_args!(
                        "unknown missing_key {other:?} (reject, skip, shared_bucket)"
                    )))
                }
            },
        };
        if spec.shadow {
            limit = limit.shadow();
        }
        if let Some(percent) = &spec.enforce_percent {
            if spec.shadow {
                return Err(at(percent.span())(
                    &"`shadow = true` is `enforce_percent = 0`: give one of them",
                ));
            }
            limit = limit
                .enforce_percent(*percent.get_ref())
                .map_err(|e| at(percent.span())(&e))?;
        }
        let limit = overflow::apply(limit, spec)?;
        let key = self
            .key(spec.key.get_ref())
            .map_err(|e| at(spec.key.span())(&e))?;
        Ok((limit, key))
    }

    /// One `[[allowlist]]` or `[[denylist]]` table (`list` says which): a key and the
    /// networks (for an `ip` key) or the names it matches.
    fn rules(&self, table: &Spanned<ListSpec>, list: List) -> Result<Rules, Mistake> {
        let spec = table.get_ref();
        let word = list.word();
        let at = |span: Range<usize>, message: String| Mistake { span, message };
        let mut rules = Rules::default();
        if spec.networks.is_none() && spec.values.is_none() {
            return Err(at(
                table.span(),
                format!("{} needs `networks` (for an ip key) or `values`", list.a()),
            ));
        }
        if let Some(networks) = &spec.networks {
            let ip = match spec.key.get_ref() {
                KeySpec::Word(w) if w == "ip" => ClientIp::peer(),
                KeySpec::Ip { ip } => ip_key(ip).map_err(|e| at(spec.key.span(), e))?,
                _ => {
                    return Err(at(
                        spec.key.span(),
                        format!("{word} `networks` need an ip key"),
                    ))
                }
            };
            let cidrs = networks
                .iter()
                .map(|n| {
                    n.get_ref()
                        .parse::<Cidr>()
                        .map_err(|e| at(n.span(), format!("{word}: {e}")))
                })
                .collect::<Result<Vec<_>, _>>()?;
            rules.networks(ip, cidrs);
        }
        if let Some(values) = &spec.values {
            let key = self
                .key(spec.key.get_ref())
                .map_err(|e| at(spec.key.span(), format!("{word}: {e}")))?;
            rules
                .keys(key, values.iter().map(Spanned::get_ref))
                .map_err(|entry| {
                    // At the value refused, which the error names as an identity.
                    let refused = values
                        .iter()
                        .find(|v| Identity::from(v.get_ref()).to_string() == entry);
                    let span = refused.map_or(table.span(), Spanned::span);
                    at(span, format!("{word}: {}", list.entry_error(entry)))
                })?;
        }
        Ok(rules)
    }

    fn key(&self, spec: &KeySpec) -> Result<Box<dyn KeyExtractor>, String> {
        match spec {
            KeySpec::Word(w) if w == "global" => Ok(Box::new(Global)),
            KeySpec::Word(w) if w == "ip" => Ok(Box::new(ClientIp::peer())),
            KeySpec::Word(w) if w == "principal" => self.principal_key("principal"),
            KeySpec::Word(w) if w == "bearer" => Ok(Box::new(ApiKey::bearer())),
            KeySpec::Word(w) => Err(format!(
                "unknown key {w:?} (global, ip, principal, bearer, {{ ip = ... }}, \
                 {{ header = ... }}, {{ api_key = ... }}, {{ principal = ... }})"
            )),
            KeySpec::Principal { principal } => self.principal_key(principal),
            KeySpec::Header { header, max_len } => {
                let name = HeaderName::from_str(header)
                    .map_err(|_| format!("{header:?} is not a header name"))?;
                let tenant = Tenant::header_name(name);
                match max_len {
                    Some(n) => Ok(Box::new(tenant.max_len(*n).map_err(|e| e.to_string())?)),
                    None => Ok(Box::new(tenant)),
                }
            }
            KeySpec::Ip { ip } => Ok(Box::new(ip_key(ip)?)),
            KeySpec::ApiKey {
                api_key,
                min_len,
                max_len,
            } => {
                let key = if api_key == "bearer" {
                    ApiKey::bearer()
                } else {
                    let name = HeaderName::from_str(api_key)
                        .map_err(|_| format!("{api_key:?} is not a header name"))?;
                    ApiKey::header_name(name)
                };
                match (min_len, max_len) {
                    (None, None) => Ok(Box::new(key)),
                    (min, max) => {
                        let min = min.unwrap_or(ApiKey::DEFAULT_MIN_LEN);
                        let max = max.unwrap_or(ApiKey::DEFAULT_MAX_LEN);
                        Ok(Box::new(
                            key.len_range(min, max).map_err(|e| e.to_string())?,
                        ))
                    }
                }
            }
        }
    }

    fn principal_key(&self, name: &str) -> Result<Box<dyn KeyExtractor>, String> {
        match self.principals.get(name) {
            Some(make) => Ok(make()),
            None if self.any_principal => Ok(Box::new(Principal::<String>::new())),
            None => Err(format!(
                "principal {name:?} is bound to no type: load the file with \
                 LimitsFile::new().principal::<T>()"
            )),
        }
    }
}

/// A client address extractor from `{ ip = { ... } }`.
fn ip_key(ip: &IpSpec) -> Result<ClientIp, String> {
    let trusted = match &ip.trusted {
        None => TrustedProxies::none(),
        Some(Trusted::Word(w)) if w == "cloudflare" => TrustedProxies::cloudflare(),
        Some(Trusted::Word(w)) => {
            return Err(format!(
                "unknown trusted proxies {w:?} (cloudflare, or CIDRs)"
            ))
        }
        Some(Trusted::Cidrs(cidrs)) => {
            let cidrs: Vec<&str> = cidrs.iter().map(String::as_str).collect();
            TrustedProxies::parse(&cidrs).map_err(|e| e.to_string())?
        }
    };
    let mut key = match ip.header.as_deref() {
        None => ClientIp::peer(),
        Some("cf-connecting-ip") => ClientIp::forwarded(ForwardedHeader::CfConnectingIp, trusted),
        Some("x-forwarded-for") => ClientIp::forwarded(ForwardedHeader::XForwardedFor, trusted),
        Some(other) => {
            return Err(format!(
                "unknown client address header {other:?} (cf-connecting-ip, \
                             x-forwarded-for)"
            ))
        }
    };
    if let Some(bits) = ip.ipv4_prefix {
        key = key.ipv4_prefix(bits).map_err(|e| e.to_string())?;
    }
    if let Some(bits) = ip.ipv6_prefix {
        key = key.ipv6_prefix(bits).map_err(|e| e.to_string())?;
    }
    Ok(key)
}

#[cfg(test)]
mod tests;
