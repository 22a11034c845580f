//! The Lua scripts, one `.lua` file each, and their Rust codecs: what each call sends and
//! how its reply is read.
//!
//! - `check.lua` ([`check`] encodes, [`reply`] decodes): checks and consumes the batches of
//!   one or more requests, all-or-nothing per request; with its keys declared
//!   (`keys_declared.lua`), or in the cross-slot form for a cluster node
//!   (`keys_cross_slot.lua`).
//! - `check_lean.lua` ([`lean`]): the same for the commonest calls (one GCRA check per
//!   request, each on a key of its own), at about half the cost to Redis.
//! - `refund.lua` ([`refund`]): undoes what a `CHECK` wrote (a Redis Cluster batch split over
//!   several hash slots, one of which refused).
//! - `settle.lua` ([`settle`]): gives back or charges what a metered check reserved.
//! - `renew.lua` ([`renew`]): moves a concurrency slot's deadline.
//! - `admin.lua` ([`admin`]): operators' `peek` of one key; `reset.lua` then `sanction.lua`,
//!   one script: its `reset` (values deleted, sanctions lifted, a deny kept); `sanction.lua`
//!   alone: a deny or an undeny.
//! - `top.lua` ([`top`]): the reports of refused identities, merged and read.
//!
//! Every script but `admin.lua` starts with `prelude.lua`: helpers, and `now` (the server's
//! `TIME`, or `ARGV[1]` when a test fixes it).
//!
//! Lua numbers are doubles: every figure here (microseconds since the epoch, about 2^51 today)
//! is an integer below 2^53 and exact. Lua's own `tostring` and `..` keep only 14 digits, and
//! Redis formats a number passed to `redis.call` as a double (`%.17g`, slow in the C library),
//! so numbers that become strings go through `fmt`, an integer format (`%d`, a C `long`).

pub(crate) mod admin;
pub(crate) mod args;
pub(crate) mod check;
pub(crate) mod lean;
pub(crate) mod refund;
pub(crate) mod renew;
pub(crate) mod reply;
pub(crate) mod settle;
pub(crate) mod slot_id;
pub(crate) mod tat;
pub(crate) mod top;

/// A GCRA value's codec, its carry to another quota and its refund's rule, with the helpers
/// they use: the one place the scripts read and write a GCRA value, prepended to every script
/// that does (the lean check, pause and sanction ones included).
pub(crate) const TAT: &str = include_str!("tat.lua");

/// Helpers and `now`, prepended to every script called by its digest.
const PRELUDE: &str = concat!(include_str!("tat.lua"), include_str!("prelude.lua"));

/// A Lua script, called by its SHA-1 with `EVALSHA` (see `Conn::invoke`).
pub(crate) struct Script {
    code: String,
    sha: String,
}

impl Script {
    /// The script made of the prelude and `body`.
    pub(crate) fn new(body: &str) -> Self {
        let code = format!("{PRELUDE}{body}");
        let sha = redis::Script::new(&code).get_hash().to_owned();
        Self { code, sha }
    }

    /// The script `code` as it is, without the prelude (`check_lean.lua`, which needs only
    /// [`TAT`], and prepends it itself).
    pub(crate) fn bare(code: &str) -> Self {
        let code = code.to_owned();
        let sha = redis::Script::new(&code).get_hash().to_owned();
        Self { code, sha }
    }

    /// The script made of the prelude and `body`, run under Redis 7's script `flags` (a
    /// server before Redis 7 refuses to load it).
    pub(crate) fn with_flags(flags: &str, body: &str) -> Self {
        let code = format!("#!lua flags={flags}\n{PRELUDE}{body}");
        let sha = redis::Script::new(&code).get_hash().to_owned();
        Self { code, sha }
    }

    /// An `EVALSHA` of this script with `keys` keys, with room for `args` keys and arguments
    /// of `bytes` bytes in all; the caller adds the keys, then the arguments.
    pub(crate) fn call(&self, keys: usize, args: usize, bytes: usize) -> redis::Cmd {
        let mut cmd = redis::Cmd::with_capacity(3 + args, 64 + bytes);
        cmd.arg("EVALSHA").arg(&self.sha).arg(keys);
        cmd
    }

    /// The script's SHA-1, as `EVALSHA` takes it.
    pub(crate) fn sha(&self) -> &str {
        &self.sha
    }

    /// `SCRIPT LOAD` of this script.
    pub(crate) fn load(&self) -> redis::Cmd {
        let mut cmd = redis::cmd("SCRIPT");
        cmd.arg("LOAD").arg(&self.code);
        cmd
    }
}

#[cfg(test)]
mod tests {
    /// `prelude.lua`'s cap on a sliding log's members is the in-memory backend's.
    #[test]
    fn a_log_keeps_at_most_twice_the_largest_quota() {
        let line = format!(
            "local LOG_ENTRIES = {}\n",
            2 * tollgate_engine::MAX_LOG_UNITS
        );
        assert!(super::PRELUDE.contains(&line));
    }
}
