//! Replacing a layer's limits at run time.

use std::fmt;
use std::path::Path;
use std::sync::{Arc, PoisonError};

use tollgate_engine::{Backend, ConfigError};

use super::limits::Limits;
use super::state::Shared;
use crate::limits_file::error::LimitsFileError;
use crate::limits_file::LimitsFile;

/// Replaces the limits of a [`RateLimitLayer`](crate::RateLimitLayer) (and of every clone of
/// it and of its services) while it serves.
///
/// - The swap is atomic and takes no lock on the request path: a request loads the limits once
///   and keeps them until its decision, so requests in flight finish under the limits they
///   started with.
/// - A new set is checked whole before anything changes; a set that could not be built is
///   refused with the reason and the old limits stay.
/// - State is the backend's, keyed by limit name and key: a limit whose name and algorithm
///   (and, for a fixed window, period) stay keeps what every key has used, under its new
///   quotas. Other limits start empty; the state of removed limits expires.
/// - A limit whose quotas changed is seen at once: a cached denial (the Redis backend's deny
///   cache) stands only under the quota it was made under.
/// - Each attempt counts in `tollgate_config_reloads_total{result}` (`ok` or `error`).
/// - An adaptive concurrency limit ([`crate::adaptive`]) learns its baseline latency again
///   after a reload, as at start (its limit is pinned to its floor meanwhile).
///
/// # Examples
///
/// ```
/// use tollgate::key::Global;
/// use tollgate::{Limit, Limits, Quota, RateLimitLayer};
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let layer = RateLimitLayer::builder()
///     .limit(Limit::fixed_window("all", Quota::per_minute(5)?)?, Global)
///     .build()?;
/// let reloader = layer.reloader();
/// reloader.reload(Limits::new().limit(Limit::fixed_window("all", Quota::per_minute(10)?)?, Global))?;
/// assert_eq!(layer.limits()[0].quota().limit(), 10);
/// // A set that cannot be built is refused whole.
/// assert!(reloader.reload(Limits::new()).is_err());
/// assert_eq!(layer.limits()[0].quota().limit(), 10);
/// # Ok(()) }
/// ```
pub struct Reloader<B> {
    shared: Arc<Shared<B>>,
}

impl<B> Clone for Reloader<B> {
    fn clone(&self) -> Self {
        Self {
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<B> fmt::Debug for Reloader<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Reloader").finish_non_exhaustive()
    }
}

impl<B> Reloader<B> {
    pub(super) fn new(shared: Arc<Shared<B>>) -> Self {
        Self { shared }
    }
}

impl<B: Backend> Reloader<B> {
    /// Replaces the layer's limits with `limits`, or refuses them whole.
    ///
    /// # Errors
    ///
    /// [`ReloadError::Config`] when the set could not build a layer (see
    /// [`RateLimitLayerBuilder::build`](crate::RateLimitLayerBuilder::build)); the old limits
    /// stay.
    pub fn reload(&self, limits: Limits) -> Result<(), ReloadError> {
        let ticket = self.ticket();
        let result = self.swap(limits, ticket);
        crate::metrics::record_reload(result.is_ok());
        result
    }

    /// Parses `text` with `file` and replaces the limits with it, or refuses it whole.
    ///
    /// Deprecated: [`reload`](Self::reload) takes what [`LimitsFile::parse`] reads.
    ///
    /// # Errors
    ///
    /// [`ReloadError::File`] for a file that does not parse (with its line and column) or
    /// describes limits that cannot be built; the old limits stay.
    #[deprecated(note = "use `reloader.reload(file.parse(text)?)`")]
    pub fn reload_toml_str(&self, file: &LimitsFile, text: &str) -> Result<(), ReloadError> {
        let ticket = self.ticket();
        let result = file
            .parse(text)
            .map_err(ReloadError::File)
            .and_then(|limits| self.swap(limits, ticket));
        crate::metrics::record_reload(result.is_ok());
        result
    }

    /// Reads the file at `path` with `file` and replaces the limits with it, or refuses it
    /// whole.
    ///
    /// Deprecated: [`reload`](Self::reload) takes what [`LimitsFile::read`] reads.
    ///
    /// # Errors
    ///
    /// As [`Reloader::reload_toml_str`], and [`ReloadError::File`] for a file that cannot be
    /// read.
    #[deprecated(note = "use `reloader.reload(file.read(path)?)`")]
    pub fn reload_toml_file(
        &self,
        file: &LimitsFile,
        path: impl AsRef<Path>,
    ) -> Result<(), ReloadError> {
        let ticket = self.ticket();
        let result = file
            .read(path)
            .map_err(ReloadError::File)
            .and_then(|limits| self.swap(limits, ticket));
        crate::metrics::record_reload(result.is_ok());
        result
    }

    /// The number of a reload that starts now: of two reloads at once, the one that started
    /// last is the one that stays, whichever finishes reading and building first.
    fn ticket(&self) -> u64 {
        self.shared
            .reload_tickets
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst)
    }

    fn swap(&self, limits: Limits, ticket: u64) -> Result<(), ReloadError> {
        let new = Arc::new(
            limits
                .compile(
                    self.shared.refused.enabled(),
                    self.shared.adaptive.is_some(),
                )
                .map_err(ReloadError::Config)?,
        );
        // Two reloads at once must each compare against the set they replace.
        let mut applied = self
            .shared
            .reloads
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if *applied > ticket {
            // A reload that started later has been applied: it stays.
            return Ok(());
        }
        *applied = ticket;
        self.shared.set.store(new);
        // A reload often comes with a deploy: the adaptive limit learns its baseline again.
        if let Some(adaptive) = &self.shared.adaptive {
            crate::adaptive::AdaptiveLimit::new(Arc::clone(&adaptive.gate)).restart();
        }
        Ok(())
    }
}

/// Why a [`Reloader`] refused a new set of limits. The old limits stay.
#[non_exhaustive]
pub enum ReloadError {
    /// The limits could not build a layer.
    Config(ConfigError),
    /// The limits file could not be read, parsed, or built.
    File(LimitsFileError),
}

/// The words of `Display`: `main() -> Result<(), Box<dyn Error>>` prints an error with
/// `Debug`, and a person reading it needs what is wrong and how to fix it.
impl fmt::Debug for ReloadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl fmt::Display for ReloadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Config(e) => write!(f, "limits refused, the old ones stay: {e}"),
            Self::File(e) => write!(f, "limits refused, the old ones stay: {e}"),
        }
    }
}

impl std::error::Error for ReloadError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Config(e) => Some(e),
            Self::File(e) => Some(e),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use crate::key::Global;
    use crate::{Limit, Limits, Quota, RateLimitLayer};

    fn limits(n: u32) -> Limits {
        Limits::new().limit(
            Limit::gcra("api", Quota::per_minute(n).unwrap()).unwrap(),
            Global,
        )
    }

    /// Of two reloads at once, the one that started last stays, even when the one that started
    /// first finishes last.
    #[test]
    fn the_reload_that_started_last_wins() {
        let layer = RateLimitLayer::builder()
            .limits(limits(10))
            .build()
            .unwrap();
        let reloader = layer.reloader();
        let first = reloader.ticket();
        let second = reloader.ticket();
        reloader.swap(limits(30), second).unwrap();
        reloader.swap(limits(20), first).unwrap();
        assert_eq!(layer.limits()[0].quota().limit(), 30);
    }
}
