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
use serde::Deserialize;
use tollgate_core::{Algorithm, ConfigError, Limit, MissingKeyPolicy, Quota, MAX_CHECKS};

use crate::allowlist::Allowlist;
use crate::key::{
    Cidr, ClientIp, ForwardedHeader, Global, KeyExtractor, Principal, PrincipalId, Tenant,
    TrustedProxies,
};
use crate::layer::{Limits, RateLimitLayer};

type MakeKey = Arc<dyn Fn() -> Box<dyn KeyExtractor> + Send + Sync>;

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
        let file: FileSpec = toml::from_str(text)
            .map_err(|e| LimitsFileError::at(text, e.span(), &said(e.message())))?;
        let mut limits = Limits::new();
        // What only the whole set can say, where it is said: a name given twice (at its
        // second `[[limit]]`), more limits than a layer takes (at the first too many).
        for (i, spec) in file.limit.iter().enumerate() {
            let name = &spec.get_ref().name;
            if let Some(first) = file.limit[..i].iter().find(|s| &s.get_ref().name == name) {
                let (line, _) = LimitsFileError::position(text, first.span().start);
                return Err(LimitsFileError::at(
                    text,
                    Some(spec.span()),
                    &format!("two limits are named {name:?} (the first at line {line})"),
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
            let span = spec.span();
            let (limit, key) = self
                .build(spec.get_ref())
                .map_err(|message| LimitsFileError::at(text, Some(span.clone()), &message))?;
            limits.push(limit, key);
        }
        if limits.is_empty() {
            return Err(LimitsFileError::at(text, None, "the file has no [[limit]]"));
        }
        for spec in &file.allowlist {
            let allow = self
                .allowlist(spec.get_ref())
                .map_err(|message| LimitsFileError::at(text, Some(spec.span()), &message))?;
            limits.add_allowlist(allow);
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
        let text = std::fs::read_to_string(path).map_err(|e| LimitsFileError {
            message: format!("cannot read {}: {e}", path.display()),
            line: 0,
            column: 0,
        })?;
        self.parse(&text)
    }

    fn build(&self, spec: &LimitSpec) -> Result<(Limit, Box<dyn KeyExtractor>), String> {
        let named = |e: ConfigError| format!("limit {:?}: {e}", spec.name);
        let period =
            parse_period(&spec.period).map_err(|e| format!("limit {:?}: {e}", spec.name))?;
        let algorithm = match spec.algorithm.as_deref().unwrap_or("gcra") {
            "gcra" => Algorithm::Gcra,
            "fixed_window" => Algorithm::FixedWindow,
            "sliding_log" => Algorithm::SlidingLog,
            other => {
                return Err(format!(
                    "limit {:?}: unknown algorithm {other:?} (gcra, fixed_window, sliding_log)",
                    spec.name
                ))
            }
        };
        let quota = |q: &QuotaSpec| -> Result<Quota, String> {
            let (limit, burst) = match *q {
                QuotaSpec::Limit(limit) => (limit, None),
                QuotaSpec::Burst { limit, burst } => (limit, burst),
            };
            let quota = Quota::new(limit, period).map_err(named)?;
            match burst {
                Some(b) => quota.with_burst(b).map_err(named),
                None => Ok(quota),
            }
        };
        let Some(default) = spec.quota.get("default") else {
            return Err(format!(
                "limit {:?}: the quota needs a `default` (the quota of requests without a plan)",
                spec.name
            ));
        };
        let mut limit = Limit::new(&spec.name, algorithm, quota(default)?).map_err(named)?;
        for (plan, q) in spec.quota.iter().filter(|(p, _)| p.as_str() != "default") {
            limit = limit.plan(plan, quota(q)?).map_err(named)?;
        }
        if let Some(cost) = spec.cost {
            limit = limit.with_cost(cost).map_err(named)?;
        }
        limit = match spec.failure.as_ref() {
            None => limit,
            Some(FailureSpec::Word(w)) if w == "open" => limit.fail_open(),
            Some(FailureSpec::Word(w)) if w == "closed" => limit.fail_closed(),
            Some(FailureSpec::Fallback { fallback }) => match NonZeroU32::new(*fallback) {
                Some(replicas) => limit.fallback(replicas),
                None => {
                    return Err(format!(
                        "limit {:?}: fallback needs 1 replica or more",
                        spec.name
                    ))
                }
            },
            Some(FailureSpec::Word(w)) => {
                return Err(format!(
                    "limit {:?}: unknown failure policy {w:?} (open, closed, {{ fallback = N }})",
                    spec.name
                ))
            }
        };
        limit = match spec.missing_key.as_deref() {
            None | Some("reject") => limit.on_missing_key(MissingKeyPolicy::Reject),
            Some("skip") => limit.on_missing_key(MissingKeyPolicy::Skip),
            Some("shared_bucket") => limit.on_missing_key(MissingKeyPolicy::SharedBucket),
            Some(other) => {
                return Err(format!(
                    "limit {:?}: unknown missing_key {other:?} (reject, skip, shared_bucket)",
                    spec.name
                ))
            }
        };
        if spec.shadow {
            limit = limit.shadow();
        }
        let key = self
            .key(&spec.key)
            .map_err(|e| format!("limit {:?}: {e}", spec.name))?;
        Ok((limit, key))
    }

    /// One `[[allowlist]]` table: a key and the networks (for an `ip` key) or the names it
    /// admits.
    fn allowlist(&self, spec: &AllowSpec) -> Result<Allowlist, String> {
        let mut allow = Allowlist::new();
        if spec.networks.is_none() && spec.values.is_none() {
            return Err("an allowlist needs `networks` (for an ip key) or `values`".into());
        }
        if let Some(networks) = &spec.networks {
            let ip = match &spec.key {
                KeySpec::Word(w) if w == "ip" => ClientIp::peer(),
                KeySpec::Ip { ip } => ip_key(ip)?,
                _ => return Err("allowlist `networks` need an ip key".into()),
            };
            let cidrs = networks
                .iter()
                .map(|n| n.parse::<Cidr>().map_err(|e| format!("allowlist: {e}")))
                .collect::<Result<Vec<_>, _>>()?;
            allow = allow.networks(ip, cidrs);
        }
        if let Some(values) = &spec.values {
            let key = self.key(&spec.key).map_err(|e| format!("allowlist: {e}"))?;
            allow = allow
                .keys(key, values.iter())
                .map_err(|e| format!("allowlist: {e}"))?;
        }
        Ok(allow)
    }

    fn key(&self, spec: &KeySpec) -> Result<Box<dyn KeyExtractor>, String> {
        match spec {
            KeySpec::Word(w) if w == "global" => Ok(Box::new(Global)),
            KeySpec::Word(w) if w == "ip" => Ok(Box::new(ClientIp::peer())),
            KeySpec::Word(w) if w == "principal" => self.principal_key("principal"),
            KeySpec::Word(w) => Err(format!(
                "unknown key {w:?} (global, ip, principal, {{ ip = ... }}, {{ header = ... }}, \
                 {{ principal = ... }})"
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

impl RateLimitLayer {
    /// A layer counting in memory with the limits of a TOML text (no principal bound; use
    /// [`LimitsFile`] and [`RateLimitLayerBuilder::limits`](crate::RateLimitLayerBuilder::limits)
    /// for principals or another backend).
    ///
    /// # Errors
    ///
    /// As [`LimitsFile::parse`].
    pub fn from_toml_str(text: &str) -> Result<Self, LimitsFileError> {
        let limits = LimitsFile::new().parse(text)?;
        Ok(RateLimitLayer::builder().limits(limits).build()?)
    }

    /// As [`RateLimitLayer::from_toml_str`], reading the file at `path`.
    ///
    /// # Errors
    ///
    /// As [`LimitsFile::read`].
    pub fn from_toml_file(path: impl AsRef<Path>) -> Result<Self, LimitsFileError> {
        let limits = LimitsFile::new().read(path)?;
        Ok(RateLimitLayer::builder().limits(limits).build()?)
    }
}

/// A limits file that could not be read, parsed or built, with where.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LimitsFileError {
    message: String,
    line: usize,
    column: usize,
}

impl LimitsFileError {
    /// The line and column (from 1) of byte `at` of `text`.
    fn position(text: &str, at: usize) -> (usize, usize) {
        let mut at = at.min(text.len());
        while !text.is_char_boundary(at) {
            at -= 1;
        }
        let before = &text[..at];
        let line = before.matches('\n').count() + 1;
        let column = before
            .rfind('\n')
            .map_or(before.len(), |n| before.len() - n - 1)
            + 1;
        (line, column)
    }

    fn at(text: &str, span: Option<Range<usize>>, message: &str) -> Self {
        let (line, column) = match span {
            Some(span) => Self::position(text, span.start),
            None => (0, 0),
        };
        Self {
            message: message.trim_end().to_owned(),
            line,
            column,
        }
    }

    /// The line of the mistake, counted from 1 (0 when it concerns the whole file).
    pub fn line(&self) -> usize {
        self.line
    }

    /// The column of the mistake, counted from 1 (0 when it concerns the whole file).
    pub fn column(&self) -> usize {
        self.column
    }

    /// What is wrong.
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl From<ConfigError> for LimitsFileError {
    fn from(e: ConfigError) -> Self {
        Self {
            message: e.to_string(),
            line: 0,
            column: 0,
        }
    }
}

impl fmt::Display for LimitsFileError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.line == 0 {
            write!(f, "limits file: {}", self.message)
        } else {
            write!(
                f,
                "limits file, line {} column {}: {}",
                self.line, self.column, self.message
            )
        }
    }
}

impl std::error::Error for LimitsFileError {}

/// The parser's message, or what the field may be when it names one of this file's types.
fn said(message: &str) -> String {
    let expected = [
        ("QuotaSpec", "a quota is a number, or { limit = N, burst = M }"),
        ("KeySpec", "a key is \"global\", \"ip\", \"principal\", { ip = { ... } }, { header = \"...\" } or { principal = \"...\" }"),
        ("FailureSpec", "a failure policy is \"open\", \"closed\" or { fallback = N }"),
        ("Trusted", "trusted proxies are \"cloudflare\" or a list of CIDRs"),
    ];
    for (name, what) in expected {
        if message.contains(&format!("untagged enum {name}")) {
            return what.to_owned();
        }
    }
    message.to_owned()
}

/// `1s`, `30s`, `1m`, `1h`, `1d`, `500ms`.
fn parse_period(text: &str) -> Result<Duration, String> {
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (n, unit) = text.split_at(split);
    let n: u64 = n
        .parse()
        .map_err(|_| format!("period {text:?} must be a number and a unit (ms, s, m, h, d)"))?;
    let unit_ms: u64 = match unit {
        "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        _ => {
            return Err(format!(
                "period {text:?} must be a number and a unit (ms, s, m, h, d)"
            ))
        }
    };
    n.checked_mul(unit_ms)
        .map(Duration::from_millis)
        .ok_or_else(|| format!("period {text:?} is too long"))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FileSpec {
    #[serde(default)]
    limit: Vec<toml::Spanned<LimitSpec>>,
    #[serde(default)]
    allowlist: Vec<toml::Spanned<AllowSpec>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AllowSpec {
    key: KeySpec,
    networks: Option<Vec<String>>,
    values: Option<Vec<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct LimitSpec {
    name: String,
    algorithm: Option<String>,
    period: String,
    quota: BTreeMap<String, QuotaSpec>,
    key: KeySpec,
    cost: Option<u32>,
    failure: Option<FailureSpec>,
    missing_key: Option<String>,
    #[serde(default)]
    shadow: bool,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum QuotaSpec {
    Limit(u32),
    Burst { limit: u32, burst: Option<u32> },
}

#[derive(Deserialize)]
#[serde(untagged)]
enum FailureSpec {
    Word(String),
    Fallback { fallback: u32 },
}

#[derive(Deserialize)]
#[serde(untagged)]
enum KeySpec {
    Word(String),
    Principal {
        principal: String,
    },
    Header {
        header: String,
        max_len: Option<usize>,
    },
    Ip {
        ip: IpSpec,
    },
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct IpSpec {
    header: Option<String>,
    trusted: Option<Trusted>,
    ipv4_prefix: Option<u8>,
    ipv6_prefix: Option<u8>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Trusted {
    Word(String),
    Cidrs(Vec<String>),
}
