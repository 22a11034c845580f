//! What is wrong with a limits file, and where.

use std::fmt;
use std::ops::Range;

use tollgate_engine::ConfigError;

/// A mistake in a file, where it is: what `parse` turns into a [`LimitsFileError`].
pub(super) struct Mistake {
    pub(super) span: Range<usize>,
    pub(super) message: String,
}

impl Mistake {
    /// A mistake in the limit named `name`, at `span`: the message says which limit.
    pub(super) fn in_limit(name: &str, span: Range<usize>, e: &dyn fmt::Display) -> Self {
        Self {
            span,
            message: format!("limit {name:?}: {e}"),
        }
    }

    pub(super) fn in_text(self, text: &str) -> LimitsFileError {
        LimitsFileError::at(text, Some(self.span), &self.message)
    }
}

/// A limits file that could not be read, parsed or built, with where.
#[derive(Clone, PartialEq, Eq)]
pub struct LimitsFileError {
    message: String,
    line: usize,
    column: usize,
}

impl LimitsFileError {
    /// The line and column (from 1) of byte `at` of `text`.
    pub(super) fn position(text: &str, at: usize) -> (usize, usize) {
        let mut at = at.min(text.len());
        while !text.is_char_boundary(at) {
            at -= 1;
        }
        let before = &text[..at];
        let line = before.matches('\n').count() + 1;
        // In characters, as editors count them.
        let column = before[before.rfind('\n').map_or(0, |n| n + 1)..]
            .chars()
            .count()
            + 1;
        (line, column)
    }

    pub(super) fn at(text: &str, span: Option<Range<usize>>, message: &str) -> Self {
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

impl LimitsFileError {
    /// A mistake about the whole file (line and column 0).
    pub(super) fn whole(message: String) -> Self {
        Self {
            message,
            line: 0,
            column: 0,
        }
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

/// The words of `Display`: `main() -> Result<(), Box<dyn Error>>` prints an error with
/// `Debug`, and a person reading it needs what is wrong and how to fix it.
impl fmt::Debug for LimitsFileError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
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
pub(super) fn said(message: &str) -> String {
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
