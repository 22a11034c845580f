//! `tat.lua`: a GCRA value as the scripts write it, read back in Rust.
//!
//! `<tat>:<interval>:<until>:<since>` (tollgate_engine's
//! [`GcraState`](tollgate_engine::algorithm::GcraState), and when the key's sanctions end, 0 for
//! none); a value of an earlier version, `<tat>:<interval>[:<until>]`, reads with `since` 0,
//! as the scripts read it.

use tollgate_engine::algorithm::GcraState;

/// The state a GCRA value holds, and when the key's sanctions end (0: none); `None` for a
/// value that is not one.
pub(crate) fn parse(value: &str) -> Option<(GcraState, u64)> {
    let mut parts = value.split(':');
    let (tat, interval) = (parts.next()?, parts.next()?);
    let until = parts.next().unwrap_or("");
    let since = parts.next().unwrap_or("");
    if parts.next().is_some() {
        return None;
    }
    // Digits only (`u64::from_str` would take a sign); an empty optional field is 0.
    let digits = |s: &str| -> Option<u64> {
        if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        s.parse().ok()
    };
    let optional = |s: &str| if s.is_empty() { Some(0) } else { digits(s) };
    let state = GcraState::new(digits(tat)?, digits(interval)?, optional(since)?);
    Some((state, optional(until)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_form_the_scripts_write_or_once_wrote_reads() {
        let state = |tat, interval, since| GcraState::new(tat, interval, since);
        assert_eq!(parse("30:6:0:12"), Some((state(30, 6, 12), 0)));
        assert_eq!(parse("30:6:90:12"), Some((state(30, 6, 12), 90)));
        assert_eq!(parse("30:6:90"), Some((state(30, 6, 0), 90)));
        assert_eq!(parse("30:6"), Some((state(30, 6, 0), 0)));
        for bad in ["", "30", "30:x", "30:6:1:2:3", "-1:6", "+1:6", "30:6:+1"] {
            assert_eq!(parse(bad), None, "{bad}");
        }
    }
}
