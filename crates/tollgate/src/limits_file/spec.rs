//! The file's TOML, as serde reads it, and its periods.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use serde::Deserialize;
use toml::Spanned;

/// `1s`, `30s`, `1m`, `1h`, `1d`, `500ms`: a period, or any other length of time the file
/// gives (`what` names it in the error: `period`, `delay`, ...).
pub(super) fn parse_period(what: &str, text: &str) -> Result<Duration, String> {
    let wrong = || format!("{what} {text:?} must be a number and a unit (ms, s, m, h, d)");
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (n, unit) = text.split_at(split);
    let n: u64 = n.parse().map_err(|_| wrong())?;
    let unit_ms: u64 = match unit {
        "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        _ => return Err(wrong()),
    };
    n.checked_mul(unit_ms)
        .map(Duration::from_millis)
        .ok_or_else(|| format!("{what} {text:?} is too long"))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct FileSpec {
    #[serde(default)]
    pub(super) limit: Vec<Spanned<LimitSpec>>,
    #[serde(default)]
    pub(super) allowlist: Vec<Spanned<ListSpec>>,
    #[serde(default)]
    pub(super) denylist: Vec<Spanned<ListSpec>>,
}

/// Only the limits' names and where each table of the file starts: what a file that does not
/// read whole still says of the limit a mistake is in.
#[derive(Deserialize)]
struct Names {
    #[serde(default)]
    limit: Vec<Spanned<Named>>,
    #[serde(default)]
    allowlist: Vec<Spanned<serde::de::IgnoredAny>>,
    #[serde(default)]
    denylist: Vec<Spanned<serde::de::IgnoredAny>>,
}

#[derive(Deserialize)]
struct Named {
    name: Option<String>,
}

/// The name of the `[[limit]]` that byte `at` of `text` is in, if it has one: the last table
/// that starts before it (a table's place is its header's, which its fields and its
/// `[limit.quota]` follow).
pub(super) fn limit_holding(text: &str, at: usize) -> Option<String> {
    let names: Names = toml::from_str(text).ok()?;
    let limits = names
        .limit
        .into_iter()
        .map(|l| (l.span().start, l.into_inner().name));
    let lists = names
        .allowlist
        .iter()
        .chain(&names.denylist)
        .map(|l| (l.span().start, None));
    limits
        .chain(lists)
        .filter(|(start, _)| *start <= at)
        .max_by_key(|(start, _)| *start)
        .and_then(|(_, name)| name)
}

/// A limit's field written below its `[limit.quota]` header, where TOML reads it as a plan:
/// the field's name, when the line that byte `at` of `text` is on starts with one.
pub(super) fn field_among_plans(text: &str, at: usize) -> Option<&'static str> {
    const FIELDS: [&str; 13] = [
        "name",
        "algorithm",
        "period",
        "key",
        "cost",
        "failure",
        "missing_key",
        "shadow",
        "delay",
        "max_waiting",
        "queue",
        "slot_ttl",
        "penalty",
    ];
    let start = text.get(..at)?.rfind('\n').map_or(0, |n| n + 1);
    let word = text[start..].split('=').next()?.trim();
    FIELDS.into_iter().find(|f| *f == word)
}

/// One `[[allowlist]]` or `[[denylist]]` table.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ListSpec {
    pub(super) key: Spanned<KeySpec>,
    pub(super) networks: Option<Vec<Spanned<String>>>,
    pub(super) values: Option<Vec<Spanned<String>>>,
}

// Every field that a mistake can be in is `Spanned`, so that the error points at it.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct LimitSpec {
    pub(super) name: Spanned<String>,
    pub(super) algorithm: Option<Spanned<String>>,
    /// Required, except for a concurrency limit, which has none.
    pub(super) period: Option<Spanned<String>>,
    pub(super) quota: Spanned<QuotaField>,
    pub(super) key: Spanned<KeySpec>,
    pub(super) cost: Option<Spanned<u32>>,
    pub(super) failure: Option<Spanned<FailureSpec>>,
    pub(super) missing_key: Option<Spanned<String>>,
    #[serde(default)]
    pub(super) shadow: bool,
    /// A GCRA limit's delay (`Limit::delay_up_to`), and the most of a key's requests that wait.
    pub(super) delay: Option<Spanned<String>>,
    pub(super) max_waiting: Option<Spanned<u32>>,
    /// A concurrency limit's queue (`Limit::queue_up_to`), and how long its slots live.
    pub(super) queue: Option<Spanned<QueueSpec>>,
    pub(super) slot_ttl: Option<Spanned<String>>,
    pub(super) penalty: Option<Spanned<PenaltySpec>>,
}

/// `queue = { wait = "5s", max_waiting = 50 }`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct QueueSpec {
    pub(super) wait: Spanned<String>,
    pub(super) max_waiting: Option<Spanned<u32>>,
}

/// `penalty = { after = 3, within = "1m", block = "10m", max = "1h" }`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct PenaltySpec {
    pub(super) after: Spanned<u32>,
    pub(super) within: Spanned<String>,
    pub(super) block: Spanned<String>,
    pub(super) max: Option<Spanned<String>>,
}

/// `quota = 5` (the default quota, no plans), or a table of plans with a `default`.
pub(super) enum QuotaField {
    Default(u32),
    Plans(BTreeMap<Spanned<String>, Spanned<QuotaSpec>>),
}

impl<'de> Deserialize<'de> for QuotaField {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visit;

        impl<'de> serde::de::Visitor<'de> for Visit {
            type Value = QuotaField;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a quota: a number, or a [limit.quota] table with a `default`")
            }

            fn visit_i64<E: serde::de::Error>(self, n: i64) -> Result<QuotaField, E> {
                u32::try_from(n)
                    .map(QuotaField::Default)
                    .map_err(|_| E::invalid_value(serde::de::Unexpected::Signed(n), &self))
            }

            fn visit_u64<E: serde::de::Error>(self, n: u64) -> Result<QuotaField, E> {
                u32::try_from(n)
                    .map(QuotaField::Default)
                    .map_err(|_| E::invalid_value(serde::de::Unexpected::Unsigned(n), &self))
            }

            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                map: A,
            ) -> Result<QuotaField, A::Error> {
                BTreeMap::deserialize(serde::de::value::MapAccessDeserializer::new(map))
                    .map(QuotaField::Plans)
            }
        }

        d.deserialize_any(Visit)
    }
}

#[derive(Clone, Deserialize)]
#[serde(untagged)]
pub(super) enum QuotaSpec {
    Limit(u32),
    Burst { limit: u32, burst: Option<u32> },
}

#[derive(Deserialize)]
#[serde(untagged)]
pub(super) enum FailureSpec {
    Word(String),
    Fallback { fallback: u32 },
}

#[derive(Deserialize)]
#[serde(untagged)]
pub(super) enum KeySpec {
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
pub(super) struct IpSpec {
    pub(super) header: Option<String>,
    pub(super) trusted: Option<Trusted>,
    pub(super) ipv4_prefix: Option<u8>,
    pub(super) ipv6_prefix: Option<u8>,
}

#[derive(Deserialize)]
#[serde(untagged)]
pub(super) enum Trusted {
    Word(String),
    Cidrs(Vec<String>),
}
