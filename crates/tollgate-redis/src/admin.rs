//! Operators' calls: one key's state read without consuming (`peek`), and forgotten
//! (`reset`).
//!
//! Both are one `EVAL` of a small script on the key's node (in a cluster, routed by its one
//! declared key), with the server's `TIME`, so that the figures are the ones the next `CHECK`
//! would compute. They are rare: the script is sent whole each time, and neither the breaker
//! nor the merged calls are involved; each has the backend's deadline.

use std::sync::Arc;

use redis::Value;
use tollgate_engine::{Algorithm, BackendError, BackendErrorKind, Check, KeyState, Limit, Quota};

use crate::failure::map_error;
use crate::keys::{BaseKey, Keyer, Suffix};
use crate::scripts::admin;
use crate::transport::{Transport, WINDOW_ERROR};

/// Peeks and resets of one backend's keys, on its transport.
pub(crate) struct Admin {
    transport: Arc<Transport>,
    prefix: String,
    keyer: Keyer,
}

/// A check's parts, owned, for a call that outlives its caller's borrow.
pub(crate) struct OwnedCheck {
    pub(crate) limit: Limit,
    pub(crate) key: Vec<u8>,
    pub(crate) quota: Quota,
}

impl OwnedCheck {
    pub(crate) fn of(check: &Check<'_>) -> Self {
        Self {
            limit: check.limit.clone(),
            key: check.key.to_vec(),
            quota: check.quota,
        }
    }
}

impl Admin {
    pub(crate) fn new(transport: Arc<Transport>, prefix: String, keyer: Keyer) -> Self {
        Self {
            transport,
            prefix,
            keyer,
        }
    }

    /// What a check of one unit of `check` would find now.
    pub(crate) async fn peek(&self, check: &OwnedCheck) -> Result<KeyState, BackendError> {
        let reply = self.call("peek", check).await?;
        admin::key_state(&check.limit, &check.key, &check.quota, &reply)
    }

    /// Deletes `check`'s key in Redis (a fixed window's current and next window) and lifts
    /// its block (a deny stays), in one call: no moment, and no failure between two calls,
    /// leaves a denied GCRA key without the deny's end in its value.
    pub(crate) async fn reset(&self, check: &OwnedCheck) -> Result<(), BackendError> {
        let digest = self.keyer.digest(check.limit.name(), &check.key);
        let base = BaseKey::new(&self.prefix, check.limit.name(), &digest);
        let algorithm = check.limit.algorithm();
        self.call_for("reset", |now| {
            admin::reset_command(&base, algorithm, &check.quota, now)
        })
        .await
        .map(|_| ())
    }

    /// One `EVAL` of `pause.lua` on `check`'s GCRA key (other algorithms: nothing).
    pub(crate) async fn pause(&self, check: &OwnedCheck, micros: u64) -> Result<(), BackendError> {
        if check.limit.algorithm() != Algorithm::Gcra {
            return Ok(());
        }
        let digest = self.keyer.digest(check.limit.name(), &check.key);
        let key = BaseKey::new(&self.prefix, check.limit.name(), &digest).with(Suffix::Tat);
        let mut cmd = redis::cmd("EVAL");
        cmd.arg(admin::PAUSE)
            .arg(1)
            .arg(key.as_bytes())
            .arg(micros)
            .arg(check.quota.emission_interval())
            .arg(check.quota.burst());
        self.transport
            .within_deadline(
                async { Ok(self.transport.query_raw(&cmd).await) },
                "to pause",
            )
            .await?
            .map(|_| ())
            .map_err(map_error)
    }

    /// One `EVAL` of `sanction.lua`: `op` (`lift`, `deny` for `micros`, `undeny`) on
    /// `check`'s key's sanctions.
    pub(crate) async fn sanction(
        &self,
        check: &OwnedCheck,
        op: &str,
        micros: u64,
    ) -> Result<(), BackendError> {
        let digest = self.keyer.digest(check.limit.name(), &check.key);
        let base = BaseKey::new(&self.prefix, check.limit.name(), &digest);
        let mut cmd = redis::cmd("EVAL");
        cmd.arg(admin::SANCTION);
        // A GCRA key's value says until when its sanctions last: the lean check reads them
        // only then.
        if check.limit.algorithm() == Algorithm::Gcra {
            cmd.arg(2)
                .arg(base.clone().with(Suffix::Sanction).as_bytes())
                .arg(base.with(Suffix::Tat).as_bytes());
        } else {
            cmd.arg(1).arg(base.with(Suffix::Sanction).as_bytes());
        }
        cmd.arg(op).arg(micros);
        self.transport
            .within_deadline(
                async { Ok(self.transport.query_raw(&cmd).await) },
                &format!("to {op}"),
            )
            .await?
            .map(|_| ())
            .map_err(map_error)
    }

    /// One `EVAL` of `op`, made once more for the server's time if its fixed window was not
    /// the one declared.
    async fn call(&self, op: &str, check: &OwnedCheck) -> Result<Value, BackendError> {
        let digest = self.keyer.digest(check.limit.name(), &check.key);
        let base = BaseKey::new(&self.prefix, check.limit.name(), &digest);
        self.call_for(op, |now| {
            admin::command(op, &base, check.limit.algorithm(), &check.quota, now)
        })
        .await
    }

    /// One `EVAL` of what `command` makes for the server's time (the client's estimate), made
    /// once more for the server's time if its fixed window was not the one declared.
    async fn call_for(
        &self,
        op: &str,
        command: impl Fn(u64) -> Result<redis::Cmd, BackendError>,
    ) -> Result<Value, BackendError> {
        let mut server_now = self.transport.server_time();
        for _ in 0..2 {
            let cmd = command(server_now)?;
            let answer = self
                .transport
                .within_deadline(
                    async { Ok(self.transport.query_raw(&cmd).await) },
                    &format!("to {op}"),
                )
                .await?;
            match answer {
                Ok(value) => return Ok(value),
                Err(e) if e.code() == Some(WINDOW_ERROR) => {
                    match e.detail().and_then(|d| d.trim().parse().ok()) {
                        Some(now) => server_now = now,
                        None => return Err(map_error(e)),
                    }
                }
                Err(e) => return Err(map_error(e)),
            }
        }
        Err(BackendError::new(
            BackendErrorKind::Protocol,
            "cannot read the server's window moved twice in a row from Redis",
        ))
    }
}
