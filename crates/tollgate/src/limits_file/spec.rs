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

/// The name of the `[[limit]]` that byte `at` of `text` is in, read from the lines alone: for
/// a file TOML cannot read (a key given twice), where [`limit_holding`] finds nothing.
pub(super) fn limit_around(text: &str, at: usize) -> Option<String> {
    let before = text.get(..at)?;
    let header = before.rfind("[[")?;
    let table = &text[header..];
    let mut lines = table.lines();
    if lines.next()?.trim() != "[[limit]]" {
        return None;
    }
    lines
        .take_while(|l| !l.trim_start().starts_with("[["))
        .filter_map(|l| l.split_once('='))
        .find(|(k, _)| k.trim() == "name")
        .map(|(_, v)| v.trim().trim_matches('"').chars().take(64).collect())
}

/// The key a line of `text` starts with at byte `at`: what is before its `=` (a table's
/// header when the line has none), cut to 64 characters.
pub(super) fn key_at(text: &str, at: usize) -> Option<String> {
    let line = text.get(at..)?.lines().next()?;
    let key = line.split('=').next()?.trim();
    (!key.is_empty()).then(|| key.chars().take(64).collect())
}

/// A limit's field written below its `[limit.quota]` header, where TOML reads it as a plan:
/// the field's name, when the line that byte `at` of `text` is on starts with one.
pub(super) fn field_among_plans(text: &str, at: usize) -> Option<&'static str> {
    let start = text.get(..at)?.rfind('\n').map_or(0, |n| n + 1);
    let word = text[start..].split('=').next()?.trim();
    FIELDS.into_iter().find(|f| *f == word)
}

/// A limit's fields other than `quota`: below `[limit.quota]`, TOML reads each as a plan.
const FIELDS: [&str; 14] = [
    "name",
    "algorithm",
    "period",
    "key",
    "cost",
    "failure",
    "missing_key",
    "shadow",
    "enforce_percent",
    "delay",
    "max_waiting",
    "queue",
    "slot_ttl",
    "penalty",
];

/// The words of the quota's own format, which no plan may be named either.
const QUOTA_WORDS: [&str; 3] = ["quota", "limit", "burst"];

/// What is wrong with the name of a plan, the key of a line below `[limit.quota]`: a field of
/// the limit written there (it would silently be a plan), a word of the quota's format, or a
/// name one edit from either or from `default` (a typo that would silently be a plan too).
pub(super) fn plan_mistake(plan: &str) -> Option<String> {
    if FIELDS.contains(&plan) {
        return Some(format!(
            "`{plan}` is a field of the limit, read here as a plan: write it above \
             `[limit.quota]`, whose lines are plans"
        ));
    }
    if QUOTA_WORDS.contains(&plan) {
        return Some(format!(
            "a plan cannot be named `{plan}`: below `[limit.quota]` each line is a plan, as \
             `default = 100` or `pro = {{ limit = 1000, burst = 50 }}`"
        ));
    }
    let lower = plan.to_ascii_lowercase();
    let near = FIELDS
        .into_iter()
        .chain(QUOTA_WORDS)
        .chain(["default"])
        .find(|f| one_edit_apart(&lower, f))?;
    Some(format!(
        "plan {plan:?} is one edit from `{near}`: did you mean `{near}`? A plan cannot be named \
         like a field of the limit (below `[limit.quota]` each line is a plan)"
    ))
}

/// Whether `a` and `b` differ by at most one edit: a letter changed, added, removed, or two
/// neighbours swapped.
fn one_edit_apart(a: &str, b: &str) -> bool {
    let (a, b): (Vec<char>, Vec<char>) = (a.chars().collect(), b.chars().collect());
    let (short, long) = if a.len() <= b.len() {
        (&a, &b)
    } else {
        (&b, &a)
    };
    let common = short
        .iter()
        .zip(long.iter())
        .take_while(|(x, y)| x == y)
        .count();
    match long.len() - short.len() {
        0 => {
            let rest = |from: usize| short[from..] == long[from..];
            common == short.len()
                || rest(common + 1)
                || (common + 1 < short.len()
                    && short[common] == long[common + 1]
                    && short[common + 1] == long[common]
                    && rest(common + 2))
        }
        1 => short[common..] == long[common + 1..],
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_edit_is_a_change_an_insertion_a_deletion_or_a_swap() {
        for (a, b) in [
            ("quota", "quota"),
            ("qota", "quota"),
            ("quotas", "quota"),
            ("qupta", "quota"),
            ("qouta", "quota"),
            ("quoat", "quota"),
            ("uota", "quota"),
        ] {
            assert!(one_edit_apart(a, b), "{a} {b}");
            assert!(one_edit_apart(b, a), "{b} {a}");
        }
        for (a, b) in [
            ("qta", "quota"),
            ("oqtua", "quota"),
            ("pro", "key"),
            ("free", "name"),
        ] {
            assert!(!one_edit_apart(a, b), "{a} {b}");
        }
    }

    #[test]
    fn plans_named_like_fields_are_refused() {
        assert!(plan_mistake("qota")
            .unwrap()
            .contains("did you mean `quota`?"));
        assert!(plan_mistake("Perod")
            .unwrap()
            .contains("did you mean `period`?"));
        assert!(plan_mistake("defualt")
            .unwrap()
            .contains("did you mean `default`?"));
        assert!(plan_mistake("period")
            .unwrap()
            .contains("is a field of the limit"));
        assert!(plan_mistake("burst")
            .unwrap()
            .contains("cannot be named `burst`"));
        for fine in ["free", "pro", "team", "enterprise", "basic", "partner"] {
            assert_eq!(plan_mistake(fine), None, "{fine}");
        }
    }
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
    /// The share of keys enforced, in percent (`Limit::enforce_percent`).
    pub(super) enforce_percent: Option<Spanned<u32>>,
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
    ApiKey {
        api_key: String,
        min_len: Option<usize>,
        max_len: Option<usize>,
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
