//! Priority classes: a request's [`Priority`], and how much of the limit each level may fill.

use std::fmt;

use http::HeaderValue;

/// How important a request is to the service: a level from 0 to 99, higher is more important.
///
/// The application sets it as a request extension
/// (`req.extensions_mut().insert(Priority::Critical)`), or lets the adaptive limit read it
/// from a header it names ([`Adaptive::priority_header`](super::Adaptive::priority_header)).
/// A request with neither is [`Priority::Default`].
///
/// Under load the lowest levels are shed first: a request of level `L` is admitted only while
/// the requests in flight (all levels together) stay below its level's share of the current
/// limit:
///
/// | level | share of the limit |
/// |---|---|
/// | 99 ([`Critical`](Priority::Critical)) | all of it |
/// | 50 ([`Default`](Priority::Default)) to 98 | all but critical's reserve (default 20%) |
/// | 0 ([`Batch`](Priority::Batch)) to 49 | from half of that (level 0) up, linearly |
///
/// Nothing is set aside for a level: a level uses whatever is free up to its share, and what
/// it uses comes back as each of its requests ends. Levels above 50 also go first out of the
/// queue.
///
/// # Examples
///
/// ```
/// use tollgate::Priority;
///
/// assert!(Priority::Critical > Priority::Default && Priority::Default > Priority::Batch);
/// assert_eq!(Priority::level(70).get(), 70);
/// // Above 99 is 99: more important than anything is critical.
/// assert_eq!(Priority::level(200), Priority::Critical);
/// ```
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Priority(u8);

#[allow(non_upper_case_globals)]
impl Priority {
    /// Level 99: the traffic the service exists for (checkout, health of the business); keeps
    /// a reserve of the limit that no other level can take.
    pub const Critical: Priority = Priority(99);
    /// Level 50: a request that says nothing of itself.
    pub const Default: Priority = Priority(50);
    /// Level 0: work that can wait (exports, prefetches, retries of background jobs); shed
    /// first.
    pub const Batch: Priority = Priority(0);

    /// The highest level.
    pub const MAX: u8 = 99;

    /// The priority of `level` (0 to 99; a larger level is 99).
    pub const fn level(level: u8) -> Priority {
        if level > Self::MAX {
            Priority(Self::MAX)
        } else {
            Priority(level)
        }
    }

    /// The level, 0 to 99.
    pub const fn get(self) -> u8 {
        self.0
    }

    /// A fixed label: `critical`, `default` or `batch` for those three levels, `level_<n>` for
    /// the others.
    pub fn label(self) -> String {
        match self.name() {
            Some(name) => name.to_owned(),
            None => format!("level_{}", self.0),
        }
    }

    /// The name of the three named levels.
    pub(crate) fn name(self) -> Option<&'static str> {
        match self {
            Self::Critical => Some("critical"),
            Self::Default => Some("default"),
            Self::Batch => Some("batch"),
            _ => None,
        }
    }

    /// The priority a header's value names: `critical`, `default` or `batch` (any case), or a
    /// level `0` to `99`. Anything else names none (the request is then `Default`).
    pub fn from_header(value: &HeaderValue) -> Option<Priority> {
        let text = value.to_str().ok()?.trim();
        if text.eq_ignore_ascii_case("critical") {
            return Some(Self::Critical);
        }
        if text.eq_ignore_ascii_case("default") {
            return Some(Self::Default);
        }
        if text.eq_ignore_ascii_case("batch") {
            return Some(Self::Batch);
        }
        if text.is_empty() || text.len() > 2 || !text.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        text.parse().ok().map(Priority)
    }
}

impl Default for Priority {
    fn default() -> Self {
        Self::Default
    }
}

impl fmt::Debug for Priority {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            Some(name) => write!(f, "Priority::{}{}", name[..1].to_uppercase(), &name[1..]),
            None => write!(f, "Priority::level({})", self.0),
        }
    }
}

/// How many requests, of all levels together, may be in flight when one of `level` is
/// admitted, under `limit` with `reserve_percent` of it kept for [`Priority::Critical`].
///
/// The reserve is rounded up but leaves the other levels at least one request while the
/// limit is 2 or more (at a limit of 1 nothing is reserved); every level may run one request
/// when nothing else runs.
pub(crate) fn share(limit: u32, reserve_percent: u8, level: Priority) -> u32 {
    if level == Priority::Critical {
        return limit;
    }
    let reserved = (u64::from(limit) * u64::from(reserve_percent)).div_ceil(100);
    let reserved = u32::try_from(reserved)
        .unwrap_or(u32::MAX)
        .min(limit.saturating_sub(1));
    let rest = limit - reserved;
    if level.0 >= Priority::Default.0 {
        return rest;
    }
    // Level 0 gets half of the rest, level 49 just under all of it.
    let share = u64::from(rest) * (50 + u64::from(level.0)) / 100;
    u32::try_from(share).unwrap_or(u32::MAX).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_by_level() {
        assert_eq!(share(10, 20, Priority::Critical), 10);
        assert_eq!(share(10, 20, Priority::level(98)), 8);
        assert_eq!(share(10, 20, Priority::Default), 8);
        assert_eq!(share(10, 20, Priority::level(25)), 6);
        assert_eq!(share(10, 20, Priority::Batch), 4);
        // The reserve rounds up...
        assert_eq!(share(4, 20, Priority::Default), 3);
        // ...but leaves one to the others, and nothing at a limit of 1.
        assert_eq!(share(2, 90, Priority::Default), 1);
        assert_eq!(share(1, 20, Priority::Default), 1);
        assert_eq!(share(1, 20, Priority::Batch), 1);
        assert_eq!(share(100, 0, Priority::Default), 100);
    }

    #[test]
    fn header_values() {
        let p = |s: &'static str| Priority::from_header(&HeaderValue::from_static(s));
        assert_eq!(p("critical"), Some(Priority::Critical));
        assert_eq!(p(" Batch "), Some(Priority::Batch));
        assert_eq!(p("DEFAULT"), Some(Priority::Default));
        assert_eq!(p("7"), Some(Priority::level(7)));
        assert_eq!(p("99"), Some(Priority::Critical));
        for bad in ["", "100", "-1", "high", "1e2", "０"] {
            let Ok(value) = HeaderValue::from_str(bad) else {
                continue;
            };
            assert_eq!(Priority::from_header(&value), None, "{bad}");
        }
        assert_eq!(format!("{:?}", Priority::Critical), "Priority::Critical");
        assert_eq!(format!("{:?}", Priority::level(7)), "Priority::level(7)");
        assert_eq!(Priority::level(7).label(), "level_7");
    }
}
