//! The backend below the quota leases: the components a call goes through, put together, and
//! the [`Backend`] they make. Each call is handed to the component it is for.
//!
//! [`Inner`] holds the transport (connections, breaker, merged calls) and over it the checks
//! (with the deny cache, the digests and the cluster's split), the concurrency slots, the
//! settles and operators' calls. `RedisBackend` runs the quota leases over it
//! (`tollgate_engine::leased::Leased`).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tollgate_engine::{
    AdminFuture, Backend, BackendError, Check, FakeClock, KeyState, Lifecycle, Settlement,
};

use crate::admin::{Admin, OwnedCheck};
use crate::checks::Checks;
use crate::deny_cache::RefusedKeys;
use crate::future::InnerFuture;
use crate::keys::Keyer;
use crate::settle::Settles;
use crate::slots::SlotKeeper;
use crate::time::Time;
use crate::transport::breaker::BreakerConfig;
use crate::transport::conn::Target;
use crate::transport::{Transport, TransportConfig, BACKEND};

/// The components of one backend, shared by its clones.
pub(crate) struct Inner {
    prefix: String,
    transport: Arc<Transport>,
    checks: Arc<Checks>,
    settles: Arc<Settles>,
    admin: Arc<Admin>,
    time: Time,
}

/// What a backend is made of, checked by the builder.
pub(crate) struct Config {
    pub(crate) prefix: String,
    pub(crate) deadline: Duration,
    pub(crate) target: Target,
    pub(crate) connect_timeout: Duration,
    pub(crate) breaker_threshold: u32,
    pub(crate) breaker_open_for: Duration,
    pub(crate) breaker_max_open_for: Duration,
    pub(crate) deny_cache_capacity: usize,
    pub(crate) deny_cache_ttl: Duration,
    /// A test's clock, for every call's time (`None`: the server's).
    pub(crate) clock: Option<FakeClock>,
    /// Whether calls that fit it use the lean `CHECK` script.
    pub(crate) lean: bool,
    /// How keys are digested: under the key secret, if one was given.
    pub(crate) keyer: Keyer,
}

impl Inner {
    /// The components `config` describes. No connection is made here.
    pub(crate) fn new(config: Config) -> Self {
        let transport = Arc::new(Transport::new(TransportConfig {
            prefix: config.prefix.clone(),
            deadline: config.deadline,
            target: config.target,
            connect_timeout: config.connect_timeout,
            lean: config.lean,
            breaker: BreakerConfig {
                threshold: config.breaker_threshold,
                open_for: config.breaker_open_for,
                max_open_for: config.breaker_max_open_for.max(config.breaker_open_for),
                // A probe whose caller gave up frees its place once its deadline has surely
                // passed.
                probe_timeout: config.deadline * 2,
            },
        }));
        let deny = Arc::new(RefusedKeys::new(
            config.deny_cache_capacity,
            config.deadline,
            config.deny_cache_ttl,
        ));
        let slots = Arc::new(SlotKeeper::new(
            Arc::clone(&transport),
            config.prefix.clone(),
        ));
        let time = match config.clock {
            Some(clock) => Time::Test(clock),
            None => Time::Server(Arc::clone(&transport)),
        };
        Self {
            checks: Arc::new(Checks::new(
                Arc::clone(&transport),
                Arc::clone(&deny),
                slots,
                config.keyer.clone(),
            )),
            settles: Arc::new(Settles::new(
                Arc::clone(&transport),
                deny,
                config.keyer.clone(),
            )),
            admin: Arc::new(Admin::new(
                Arc::clone(&transport),
                config.prefix.clone(),
                config.keyer,
            )),
            prefix: config.prefix,
            transport,
            time,
        }
    }

    /// The keys' prefix.
    pub(crate) fn prefix(&self) -> &str {
        &self.prefix
    }

    pub(crate) fn transport(&self) -> &Arc<Transport> {
        &self.transport
    }

    pub(crate) fn checks(&self) -> &Arc<Checks> {
        &self.checks
    }

    #[cfg(any(feature = "testing", doc))]
    pub(crate) fn settles(&self) -> &Arc<Settles> {
        &self.settles
    }

    /// Where this backend's time comes from.
    pub(crate) fn time(&self) -> &Time {
        &self.time
    }
}

impl Backend for Inner {
    type Future = InnerFuture;

    /// Checks and consumes a batch in one script call (one per hash slot in a cluster), at the
    /// server's time; at a test's, once the settles made before are answered.
    fn check(&self, checks: &[Check<'_>]) -> InnerFuture {
        let now = self.time.call_time();
        let call = self.checks.dispatch(checks, now);
        if now.is_none() {
            return call;
        }
        let settled = self.settles.answered();
        InnerFuture::call(async move {
            settled.await;
            call.await
        })
    }

    fn settle(&self, settlements: &[Settlement<'_>]) {
        self.settles.later(settlements, self.time.call_time());
    }

    /// One `EVAL` from a task, without waiting; a failure is logged at debug level (the
    /// key is then not held back). Outside a Tokio runtime nothing is sent.
    fn pause(&self, check: &Check<'_>, micros: tollgate_engine::Micros) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let admin = Arc::clone(&self.admin);
        let check = OwnedCheck::of(check);
        runtime.spawn(async move {
            if let Err(e) = admin.pause(&check, micros).await {
                tracing::debug!(limit = check.limit.name(), error = %e, "a pause was not kept");
            }
        });
    }

    fn kind(&self) -> &'static str {
        BACKEND
    }

    fn slots(&self) -> Option<&dyn tollgate_engine::Slots> {
        Some(self)
    }

    fn admin(&self) -> Option<&dyn tollgate_engine::Admin> {
        Some(self)
    }

    fn lifecycle(&self) -> Option<&dyn Lifecycle> {
        Some(self)
    }
}

impl tollgate_engine::Slots for Inner {
    fn release(&self, checks: &[Check<'_>]) {
        let held = self
            .checks
            .slots()
            .of_checks(checks, |n, k| self.checks.digest(n, k));
        let _ = self.checks.slots().release(held);
    }

    fn release_landing(&self, checks: &[Check<'_>]) -> Option<tollgate_engine::Landing> {
        let held = self
            .checks
            .slots()
            .of_checks(checks, |n, k| self.checks.digest(n, k));
        let landing = self.checks.slots().release(held)?;
        Some(Box::pin(async move {
            let _ = landing.await;
        }))
    }

    fn renew(&self, checks: &[Check<'_>]) {
        let held = self
            .checks
            .slots()
            .of_checks(checks, |n, k| self.checks.digest(n, k));
        self.checks.slots().renew(held);
    }

    fn expire(&self) -> bool {
        true
    }
}

impl tollgate_engine::Admin for Inner {
    fn peek(&self, check: &Check<'_>) -> AdminFuture<KeyState> {
        let admin = Arc::clone(&self.admin);
        let check = OwnedCheck::of(check);
        Box::pin(async move { admin.peek(&check).await })
    }

    /// Forgets the key in Redis, then this replica's cached denial of it.
    fn reset(&self, check: &Check<'_>) -> AdminFuture<()> {
        let (admin, checks) = (Arc::clone(&self.admin), Arc::clone(&self.checks));
        let check = OwnedCheck::of(check);
        Box::pin(async move {
            admin.reset(&check).await?;
            checks
                .deny()
                .forget(&checks.digest(check.limit.name(), &check.key));
            Ok::<(), BackendError>(())
        })
    }

    /// Denies the key in Redis; this replica's cache holds the deny from its next check.
    fn deny(&self, check: &Check<'_>, duration: std::time::Duration) -> AdminFuture<()> {
        let admin = Arc::clone(&self.admin);
        let check = OwnedCheck::of(check);
        let micros = match tollgate_engine::deny_micros(duration) {
            Ok(micros) => micros,
            Err(e) => return Box::pin(std::future::ready(Err(e))),
        };
        Box::pin(async move { admin.sanction(&check, "deny", micros).await })
    }

    /// Lifts the key's deny in Redis, then this replica's cached refusal of it.
    fn undeny(&self, check: &Check<'_>) -> AdminFuture<()> {
        let (admin, checks) = (Arc::clone(&self.admin), Arc::clone(&self.checks));
        let check = OwnedCheck::of(check);
        Box::pin(async move {
            admin.sanction(&check, "undeny", 0).await?;
            checks
                .deny()
                .forget(&checks.digest(check.limit.name(), &check.key));
            Ok::<(), BackendError>(())
        })
    }
}

impl Lifecycle for Inner {
    /// Resolves once the settles made before it (the leases' give-backs among them) are
    /// answered, or given up.
    fn shutdown(&self) -> Pin<Box<dyn Future<Output = ()> + Send + 'static>> {
        Box::pin(self.settles.answered())
    }
}
