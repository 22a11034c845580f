//! The `CHECK` reply: one string of figures, read into each check's answer.

use tollgate_engine::algorithm::{self, WindowState};
use tollgate_engine::{
    Algorithm, BackendError, BackendErrorKind, Micros, Status, Verdict, MAX_DENY,
};

use crate::few::Few;
use crate::scripts::check::EncodedCheck;

/// The verdict of a check that was not checked.
pub(crate) const NOT_CHECKED: Verdict = Verdict::new(Status::NotChecked, 0, 0);

/// The answer of a check that Redis did not evaluate.
pub(crate) const UNANSWERED: Answer = Answer {
    verdict: NOT_CHECKED,
    extra: 0,
    at: 0,
};

/// What `CHECK` answered for one check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Answer {
    pub(crate) verdict: Verdict,
    /// What the algorithm read or wrote besides the verdict: a GCRA key's TAT as the check
    /// read it (0: none), a fixed window's index, a sliding log's last sequence number.
    pub(crate) extra: u64,
    /// The server's time of the call that answered.
    pub(crate) at: Micros,
}

/// A whole `CHECK` reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Reply {
    pub(crate) committed: bool,
    pub(crate) now: Micros,
    pub(crate) answers: Answers,
}

/// What a request's batch came to, before its verdicts are finished: whether it was
/// committed, and each check's answer (from one `CHECK` reply, or from a cluster's several).
pub(crate) struct Answered {
    pub(crate) committed: bool,
    pub(crate) answers: Answers,
}

/// The answers of one request's checks, in order: inline when there is one (the commonest
/// batch), so that such a reply allocates nothing, else in a vector. Not an array of
/// [`MAX_CHECKS`](tollgate_engine::MAX_CHECKS): a reply travels from the task that reads it
/// to the request, and every move of it would copy the whole array.
pub(crate) type Answers = Few<Answer>;

impl Few<Answer> {
    /// `len` answers, each [`UNANSWERED`].
    pub(crate) fn unanswered(len: usize) -> Self {
        match len {
            1 => Self::One(UNANSWERED),
            _ => Self::Many(vec![UNANSWERED; len]),
        }
    }
}

impl From<Reply> for Answered {
    fn from(reply: Reply) -> Self {
        Self {
            committed: reply.committed,
            answers: reply.answers,
        }
    }
}

fn protocol(msg: impl Into<String>) -> BackendError {
    BackendError::new(BackendErrorKind::Protocol, msg)
}

/// Decodes a `CHECK` reply for one request.
///
/// # Errors
///
/// [`BackendErrorKind::Protocol`] for anything but the expected figures.
#[cfg(test)]
pub(crate) fn parse_reply(
    value: &redis::Value,
    batch: &[EncodedCheck],
) -> Result<Reply, BackendError> {
    let redis::Value::BulkString(bytes) = value else {
        return Err(protocol(format!("unexpected script reply {value:?}")));
    };
    let mut replies = Vec::new();
    parse_replies(bytes, &[batch], &mut replies)?;
    replies
        .pop()
        .flatten()
        .ok_or_else(|| protocol("empty script reply"))
}

/// The figures of one check's answer in a `CHECK` reply.
fn answer_len(p: &EncodedCheck) -> usize {
    match p.algorithm {
        Algorithm::Gcra | Algorithm::FixedWindow | Algorithm::Concurrency => 2,
        _ => 5,
    }
}

/// Decodes a `CHECK` reply, the bytes of its string, for the requests of `batches`, in order,
/// into `replies` (emptied first): `None` for a request the lean script did not run (status
/// 5), because the node does not serve its key.
///
/// A GCRA or fixed-window check's verdict is computed here, by `tollgate_engine::algorithm`,
/// from the state the script read for it; the script's status must agree with it.
///
/// # Errors
///
/// [`BackendErrorKind::Protocol`] for anything but the expected figures.
pub(crate) fn parse_replies<B: AsRef<[EncodedCheck]>>(
    bytes: &[u8],
    batches: &[B],
    replies: &mut Vec<Option<Reply>>,
) -> Result<(), BackendError> {
    replies.clear();
    let expected = 1 + batches
        .iter()
        .map(|b| 1 + b.as_ref().iter().map(answer_len).sum::<usize>())
        .sum::<usize>();
    if bytes.len() != 8 * expected {
        return Err(protocol(format!(
            "script reply of {} bytes where {} figures were expected",
            bytes.len(),
            expected
        )));
    }
    let mut figures = bytes.chunks_exact(8).map(|c| {
        let mut raw = [0u8; 8];
        raw.copy_from_slice(c);
        f64::from_le_bytes(raw)
    });
    // The next figure; a sanction's time left (`left`) is read as at most `MAX_DENY`.
    let mut next = |left: bool| match figures.next() {
        None => Err(protocol("script reply too short")),
        Some(x) if left => time_left(x),
        Some(x) => figure(x),
    };
    let now = next(false)?;
    replies.reserve(batches.len());
    'requests: for batch in batches {
        let batch = batch.as_ref();
        let committed = next(false)? == 1;
        let mut answers = Answers::with_capacity(batch.len());
        for p in batch.iter() {
            let status = next(false)?;
            if status == NOT_RUN && batch.len() == 1 && p.algorithm == Algorithm::Gcra {
                next(false)?;
                replies.push(None);
                continue 'requests;
            }
            if let Some(answer) = sanctioned(status, p.algorithm, &mut next, now)? {
                answers.push(answer);
                continue;
            }
            let answer = match p.algorithm {
                Algorithm::Gcra => {
                    let read = next(false)?;
                    let tat = Some(read).filter(|&t| t != 0);
                    let (verdict, _) = algorithm::gcra_delayed(&p.quota, tat, now, p.cost, p.delay);
                    Answer {
                        verdict,
                        extra: read,
                        at: now,
                    }
                }
                Algorithm::FixedWindow => {
                    let state =
                        WindowState::new(algorithm::window_end(&p.quota, now), next(false)?);
                    let (verdict, _) = algorithm::fixed_window(&p.quota, Some(state), now, p.cost);
                    let extra = algorithm::window_index(&p.quota, now);
                    Answer {
                        verdict,
                        extra,
                        at: now,
                    }
                }
                Algorithm::Concurrency => {
                    let held = u32::try_from(next(false)?).unwrap_or(u32::MAX);
                    let (verdict, _) =
                        algorithm::concurrency(&p.quota, held, p.cost, p.busy_retry_after);
                    Answer {
                        verdict,
                        extra: 0,
                        at: now,
                    }
                }
                _ => {
                    let [remaining, reset, retry_after, extra] =
                        [next(false)?, next(false)?, next(false)?, next(false)?];
                    let status = match status {
                        0 => Status::Allowed,
                        1 => Status::Denied { retry_after },
                        2 => Status::CostTooHigh,
                        other => return Err(protocol(format!("unknown status {other} in reply"))),
                    };
                    let verdict = Verdict::new(status, remaining, reset);
                    Answer {
                        verdict,
                        extra,
                        at: now,
                    }
                }
            };
            if status_code(answer.verdict.status) != status {
                return Err(protocol(format!(
                    "the script answered status {status} where {:?} was expected",
                    answer.verdict.status
                )));
            }
            answers.push(answer);
        }
        replies.push(Some(Reply {
            committed,
            now,
            answers,
        }));
    }
    Ok(())
}

/// The status of a request the lean script did not run: the node does not serve its key.
const NOT_RUN: u64 = 5;

/// A block's or a deny's answer (statuses 3 and 4), whose figures say only the time to its
/// end; `None` for any other status, whose figures are not yet read.
fn sanctioned(
    status: u64,
    algorithm: Algorithm,
    next: &mut impl FnMut(bool) -> Result<u64, BackendError>,
    now: Micros,
) -> Result<Option<Answer>, BackendError> {
    if status != 3 && status != 4 {
        return Ok(None);
    }
    let left = match algorithm {
        Algorithm::Gcra | Algorithm::FixedWindow | Algorithm::Concurrency => next(true)?,
        _ => {
            let [_, _, retry_after, _] = [next(false)?, next(true)?, next(true)?, next(false)?];
            retry_after
        }
    };
    let status = if status == 3 {
        Status::Blocked { retry_after: left }
    } else {
        Status::Denylisted { retry_after: left }
    };
    Ok(Some(Answer {
        verdict: Verdict::new(status, 0, left),
        extra: 0,
        at: now,
    }))
}

/// A status as the script writes it.
fn status_code(status: Status) -> u64 {
    match status {
        Status::Allowed => 0,
        Status::Denied { .. } => 1,
        Status::CostTooHigh => 2,
        // No status the script writes.
        _ => u64::MAX,
    }
}

/// A figure of a reply: a whole number of at most 2^53, the range in which Lua is exact.
fn figure(x: f64) -> Result<u64, BackendError> {
    const EXACT: f64 = 9_007_199_254_740_992.0; // 2^53
    if (0.0..=EXACT).contains(&x) && x.fract() == 0.0 {
        // In range and whole: the conversion is exact.
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        Ok(x as u64)
    } else {
        Err(protocol(format!(
            "figure {x} in reply is not a whole number"
        )))
    }
}

/// A sanction's time left: a whole number of microseconds, at most [`MAX_DENY`]'s (the
/// scripts bound it so; an end stored further ahead by an older version still reads as a
/// deny, never as a protocol error that would fail every request of a merged call).
fn time_left(x: f64) -> Result<u64, BackendError> {
    // At most 100 years: a few 10^15, exact in a double.
    #[allow(clippy::cast_precision_loss)]
    let max = MAX_DENY.as_micros() as f64;
    if x > max {
        return figure(max);
    }
    figure(x)
}

#[cfg(test)]
mod tests {
    use super::*;
    use redis::Value;
    use tollgate_engine::{Check, Limit, Quota};

    fn packed(figures: &[f64]) -> Value {
        Value::BulkString(figures.iter().flat_map(|f| f.to_le_bytes()).collect())
    }

    const NOW: f64 = 1_000_000_000_000.;

    fn replies(
        value: &Value,
        batches: &[&[EncodedCheck]],
    ) -> Result<Vec<Option<Reply>>, BackendError> {
        let Value::BulkString(bytes) = value else {
            panic!("not a string: {value:?}");
        };
        let mut replies = vec![None];
        parse_replies(bytes, batches, &mut replies)?;
        Ok(replies)
    }

    fn prepared(algorithm: Algorithm, cost: u32) -> EncodedCheck {
        let limit = Limit::new("l", algorithm, Quota::per_minute(5).unwrap()).unwrap();
        let mut check = Check::new(&limit, b"k");
        check.cost = cost;
        EncodedCheck::new(&check, [0; 16]).unwrap()
    }

    #[test]
    fn computes_gcra_and_window_verdicts_from_the_state_the_script_read() {
        let batch = [
            prepared(Algorithm::Gcra, 1),
            prepared(Algorithm::FixedWindow, 1),
            prepared(Algorithm::SlidingLog, 6),
        ];
        // now; committed; GCRA allowed on a key never seen; the window refused with its 5
        // units used; the log: cost too high, 3 left.
        let figures = [NOW, 1., 0., 0., 1., 5., 2., 3., 0., 0., 0.];
        let r = parse_reply(&packed(&figures), &batch).unwrap();
        assert!(r.committed);
        assert_eq!(r.now, 1_000_000_000_000);
        let gcra = r.answers[0].verdict;
        assert_eq!(
            (gcra.status, gcra.remaining, gcra.reset),
            (Status::Allowed, 4, 12_000_000)
        );
        // The minute's window that holds now ends 20 s later.
        let window = r.answers[1];
        assert_eq!(
            (
                window.verdict.status,
                window.verdict.remaining,
                window.extra
            ),
            (
                Status::Denied {
                    retry_after: 20_000_000
                },
                0,
                16_666
            )
        );
        assert_eq!(r.answers[2].verdict.status, Status::CostTooHigh);
        assert_eq!(r.answers[2].verdict.remaining, 3);

        // A TAT 40 s ahead leaves 1 unit, then none.
        let ahead = [NOW, 1., 0., NOW + 40e6, 1., 5., 2., 3., 0., 0., 0.];
        let gcra = parse_reply(&packed(&ahead), &batch).unwrap().answers[0].verdict;
        assert_eq!((gcra.remaining, gcra.reset), (0, 52_000_000));
    }

    #[test]
    fn a_status_that_disagrees_with_the_state_is_a_protocol_error() {
        let batch = [prepared(Algorithm::Gcra, 1)];
        assert!(parse_reply(&packed(&[NOW, 1., 0., 0.]), &batch).is_ok());
        // Refused, on a key never seen.
        assert!(parse_reply(&packed(&[NOW, 1., 1., 0.]), &batch).is_err());
        // Allowed, with the bucket full for the next 60 s.
        assert!(parse_reply(&packed(&[NOW, 1., 0., NOW + 60e6]), &batch).is_err());
        let log = [prepared(Algorithm::SlidingLog, 1)];
        assert!(parse_reply(&packed(&[NOW, 1., 5., 0., 0., 0., 0.]), &log).is_err());
        // Blocked and denied by hand: the figure after the status is the time to the end.
        let blocked = parse_reply(&packed(&[NOW, 0., 3., 0., 0., 7e6, 0.]), &log).unwrap();
        assert_eq!(
            blocked.answers[0].verdict.status,
            Status::Blocked {
                retry_after: 7_000_000
            }
        );
        let denied = parse_reply(&packed(&[NOW, 0., 4., 9e6]), &batch).unwrap();
        assert_eq!(
            denied.answers[0].verdict.status,
            Status::Denylisted {
                retry_after: 9_000_000
            }
        );
    }

    #[test]
    fn only_whole_figures_of_the_expected_number_are_read() {
        let batch = [prepared(Algorithm::Gcra, 1)];
        assert!(parse_reply(&packed(&[NOW, 1., 0.]), &batch).is_err());
        assert!(parse_reply(&packed(&[NOW, 1., 0., 0., 0.]), &batch).is_err());
        assert!(parse_reply(&Value::Nil, &[]).is_err());
        assert!(parse_reply(&packed(&[-1., 0.]), &[]).is_err());
        assert!(parse_reply(&packed(&[0.5, 0.]), &[]).is_err());
        assert!(parse_reply(&packed(&[f64::NAN, 0.]), &[]).is_err());
        assert!(parse_reply(&packed(&[2f64.powi(54), 0.]), &[]).is_err());
        assert_eq!(
            parse_reply(&packed(&[2f64.powi(53), 0.]), &[]).unwrap().now,
            1 << 53
        );
        assert!(parse_reply(&Value::BulkString(vec![0; 15]), &[]).is_err());
    }

    /// A deny's time left past `MAX_DENY` (an end stored before denies were bounded) reads
    /// as `MAX_DENY`, for every algorithm; any other figure past 2^53 is still refused.
    #[test]
    fn a_time_left_past_the_deny_bound_reads_as_the_bound() {
        let max = u64::try_from(MAX_DENY.as_micros()).unwrap();
        let denied = Status::Denylisted { retry_after: max };
        for (algorithm, figures) in [
            (Algorithm::Gcra, vec![NOW, 0., 4., 1e17]),
            (Algorithm::FixedWindow, vec![NOW, 0., 4., 2f64.powi(60)]),
            (Algorithm::SlidingLog, vec![NOW, 0., 4., 0., 1e17, 1e17, 0.]),
        ] {
            let reply = parse_reply(&packed(&figures), &[prepared(algorithm, 1)]).unwrap();
            assert_eq!(reply.answers[0].verdict.status, denied, "{algorithm:?}");
        }
        let blocked = parse_reply(
            &packed(&[NOW, 0., 3., f64::INFINITY]),
            &[prepared(Algorithm::Gcra, 1)],
        );
        assert_eq!(
            blocked.unwrap().answers[0].verdict.status,
            Status::Blocked { retry_after: max }
        );
        let tat = parse_reply(
            &packed(&[NOW, 0., 1., 1e17]),
            &[prepared(Algorithm::Gcra, 1)],
        );
        assert!(tat.is_err());
    }

    #[test]
    fn parses_the_reply_of_several_requests() {
        let one = [prepared(Algorithm::Gcra, 1)];
        let two = [prepared(Algorithm::Gcra, 6), prepared(Algorithm::Gcra, 1)];
        // A committed request of one check, a refused one of two (the first costs too much).
        let v = packed(&[NOW, 1., 0., 0., 0., 2., 0., 0., 0.]);
        let r: Vec<Reply> = replies(&v, &[&one, &two])
            .unwrap()
            .into_iter()
            .flatten()
            .collect();
        assert_eq!(r.len(), 2);
        assert!(r[0].committed && !r[1].committed);
        assert_eq!((r[0].now, r[1].now), (1_000_000_000_000, 1_000_000_000_000));
        assert_eq!(r[0].answers[0].verdict.remaining, 4);
        assert_eq!(r[1].answers[0].verdict.status, Status::CostTooHigh);
        assert_eq!(r[1].answers[1].verdict.status, Status::Allowed);
        assert!(replies(&v, &[&two, &one]).is_err());
        assert!(replies(&v, &[&one]).is_err());
    }

    #[test]
    fn a_request_the_lean_script_did_not_run_has_no_reply() {
        let one = [prepared(Algorithm::Gcra, 1)];
        let two = [prepared(Algorithm::Gcra, 6), prepared(Algorithm::Gcra, 1)];
        // Run and admitted, then not run (status 5: the node does not serve its key).
        let v = packed(&[NOW, 1., 0., 0., 0., 5., 0.]);
        let r = replies(&v, &[&one, &one]).unwrap();
        assert_eq!(r[0].as_ref().unwrap().answers[0].verdict.remaining, 4);
        assert_eq!(r[1], None);
        // Only a request of one GCRA check can be left out.
        let v = packed(&[NOW, 0., 5., 0., 0., 0.]);
        assert!(replies(&v, &[&two]).is_err());
    }
}
