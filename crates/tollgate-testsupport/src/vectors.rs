//! The shared test vectors of `tests/vectors.txt` (the format is described in the file's header).
//!
//! The engine's tests and the Redis backend's tests each turn a [`Vector`] into their own calls,
//! and must both reproduce [`Vector::expected`].

use std::fmt;
use std::time::Duration;

use tollgate_engine::{Limit, Quota, Status, Verdict};

/// The path of the vector file.
pub const PATH: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/vectors.txt");

/// Which algorithm a vector exercises.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Algo {
    /// GCRA.
    Gcra,
    /// Fixed window.
    Fixed,
    /// Exact sliding log.
    Sliding,
}

/// The stored state of the key before the check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum State {
    /// A key never seen.
    None,
    /// GCRA's theoretical arrival time.
    Tat(u64),
    /// GCRA's theoretical arrival time, written under another emission interval (another
    /// quota): `<tat>@<interval>`.
    TatUnder {
        /// The stored TAT.
        tat: u64,
        /// The emission interval it was written under.
        interval: u64,
    },
    /// A fixed window: its end and its count.
    Window {
        /// When the window ends.
        end: u64,
        /// Units counted in it.
        count: u64,
    },
    /// A sliding log's ascending entries.
    Log(Vec<u64>),
}

/// The expected status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expected {
    /// Admitted.
    Allowed,
    /// Denied, retry after this many microseconds.
    Denied(u64),
    /// The cost exceeds the quota.
    CostTooHigh,
}

/// One line of the vector file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Vector {
    /// The line number (1-based), for messages.
    pub line: usize,
    /// The algorithm.
    pub algo: Algo,
    /// Requests per period.
    pub limit: u32,
    /// The period in microseconds.
    pub period_us: u64,
    /// GCRA's burst (`None` for the other algorithms).
    pub burst: Option<u32>,
    /// A GCRA check's delay in microseconds (`Check::delay`; 0 when the line gives none).
    pub delay: u64,
    /// The state before the check.
    pub state: State,
    /// The time of the check.
    pub now: u64,
    /// The request's cost.
    pub cost: u32,
    /// The expected status.
    pub status: Expected,
    /// The expected remaining units.
    pub remaining: u64,
    /// The expected reset, in microseconds.
    pub reset: u64,
}

impl Vector {
    /// The vector's quota (with its burst for GCRA).
    ///
    /// # Panics
    ///
    /// When the line describes an invalid quota.
    pub fn quota(&self) -> Quota {
        let quota = Quota::new(self.limit, Duration::from_micros(self.period_us))
            .unwrap_or_else(|e| panic!("{self}: {e}"));
        match self.burst {
            Some(b) => quota
                .with_burst(b)
                .unwrap_or_else(|e| panic!("{self}: {e}")),
            None => quota,
        }
    }

    /// A limit of the vector's algorithm and quota, named `v<line>`.
    ///
    /// # Panics
    ///
    /// When the line describes an invalid limit.
    pub fn limit(&self) -> Limit {
        let name = format!("v{}", self.line);
        let limit = match self.algo {
            Algo::Gcra => Limit::gcra(&name, self.quota()),
            Algo::Fixed => Limit::fixed_window(&name, self.quota()),
            Algo::Sliding => Limit::sliding_log(&name, self.quota()),
        };
        limit.unwrap_or_else(|e| panic!("{self}: {e}"))
    }

    /// The verdict every backend must give.
    pub fn expected(&self) -> Verdict {
        let status = match self.status {
            Expected::Allowed => Status::Allowed,
            Expected::Denied(retry_after) => Status::Denied { retry_after },
            Expected::CostTooHigh => Status::CostTooHigh,
        };
        Verdict::new(status, self.remaining, self.reset)
    }
}

impl fmt::Display for Vector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "tests/vectors.txt:{}", self.line)
    }
}

/// Reads and parses the vector file.
///
/// # Panics
///
/// When the file cannot be read or a line is malformed (naming the line).
pub fn load() -> Vec<Vector> {
    let text = std::fs::read_to_string(PATH).unwrap_or_else(|e| panic!("read {PATH}: {e}"));
    parse(&text)
}

/// Parses the text of a vector file.
///
/// # Panics
///
/// When a line is malformed (naming the line).
pub fn parse(text: &str) -> Vec<Vector> {
    text.lines()
        .enumerate()
        .filter_map(|(i, raw)| {
            let line = raw.split('#').next().unwrap_or("").trim();
            (!line.is_empty())
                .then(|| parse_line(i + 1, line).unwrap_or_else(|e| panic!("line {}: {e}", i + 1)))
        })
        .collect()
}

fn num<T: std::str::FromStr>(field: &str, what: &str) -> Result<T, String> {
    field
        .parse()
        .map_err(|_| format!("{what}: {field:?} is not a number"))
}

fn parse_line(line: usize, text: &str) -> Result<Vector, String> {
    let f: Vec<&str> = text.split_whitespace().collect();
    let [algo, limit, period, burst, state, now, cost, arrow, status, remaining, reset, retry] =
        f[..]
    else {
        return Err(format!("expected 12 fields, found {}", f.len()));
    };
    if arrow != "->" {
        return Err(format!("expected `->`, found {arrow:?}"));
    }
    let algo = match algo {
        "gcra" => Algo::Gcra,
        "fixed" => Algo::Fixed,
        "sliding" => Algo::Sliding,
        other => return Err(format!("unknown algorithm {other:?}")),
    };
    let (burst, delay) = match (algo, burst) {
        (Algo::Gcra, b) => match b.split_once('+') {
            Some((b, d)) => (Some(num(b, "burst")?), num(d, "delay")?),
            None => (Some(num(b, "burst")?), 0),
        },
        (_, "-") => (None, 0),
        (_, b) => return Err(format!("burst {b:?} on an algorithm without one")),
    };
    let state = match (algo, state) {
        (_, "none") => State::None,
        (Algo::Gcra, s) => match s.split_once('@') {
            Some((tat, interval)) => State::TatUnder {
                tat: num(tat, "tat")?,
                interval: num(interval, "interval")?,
            },
            None => State::Tat(num(s, "tat")?),
        },
        (Algo::Fixed, s) => {
            let (end, count) = s
                .split_once(':')
                .ok_or_else(|| format!("window state {s:?} is not <end>:<count>"))?;
            State::Window {
                end: num(end, "window end")?,
                count: num(count, "window count")?,
            }
        }
        (Algo::Sliding, s) => State::Log(
            s.split(',')
                .map(|t| num(t, "log entry"))
                .collect::<Result<_, _>>()?,
        ),
    };
    let status = match (status, retry) {
        ("allowed", "-") => Expected::Allowed,
        ("denied", r) => Expected::Denied(num(r, "retry_after")?),
        ("cost_too_high", "-") => Expected::CostTooHigh,
        (s, r) => return Err(format!("bad status {s:?} with retry_after {r:?}")),
    };
    Ok(Vector {
        line,
        algo,
        limit: num(limit, "limit")?,
        period_us: num(period, "period")?,
        burst,
        delay,
        state,
        now: num(now, "now")?,
        cost: num(cost, "cost")?,
        status,
        remaining: num(remaining, "remaining")?,
        reset: num(reset, "reset")?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_kind_of_line() {
        let v = parse(
            "# header\n\
             gcra 5 60000000 5 none 1000 1 -> allowed 4 12000000 -\n\
             \n\
             fixed 3 60 - 60:2 30 2 -> denied 1 30 30 # comment\n\
             sliding 2 10 - 1,1 2 3 -> cost_too_high 0 9 -\n",
        );
        assert_eq!(v.len(), 3);
        assert_eq!(
            (v[0].line, v[0].burst, v[0].state.clone()),
            (2, Some(5), State::None)
        );
        assert_eq!(v[1].state, State::Window { end: 60, count: 2 });
        assert_eq!(v[1].status, Expected::Denied(30));
        assert_eq!(v[2].state, State::Log(vec![1, 1]));
        assert_eq!(v[2].status, Expected::CostTooHigh);
    }

    #[test]
    fn the_shared_file_parses_and_covers_every_algorithm() {
        let v = load();
        for algo in [Algo::Gcra, Algo::Fixed, Algo::Sliding] {
            assert!(
                v.iter().filter(|x| x.algo == algo).count() >= 15,
                "{algo:?}"
            );
        }
    }
}
