//! `renew.lua`: moves a concurrency slot's deadline.

use std::sync::LazyLock;

use tollgate_engine::Micros;

use crate::scripts::{slot_id, Script};

/// Moves each slot's deadline one lifetime past the server's `TIME`, if the slot is still held.
/// `KEYS[1]`: the slots key; `ARGV[2]`: the lifetime in microseconds; `ARGV[3]`: the slot id.
pub(crate) const RENEW: &str = include_str!("renew.lua");

/// The script: the prelude and [`RENEW`], loaded once per process.
pub(crate) fn script() -> &'static Script {
    static SCRIPT: LazyLock<Script> = LazyLock::new(|| Script::new(RENEW));
    &SCRIPT
}

/// The `EVALSHA` that renews slot `id` under `key` for `ttl` microseconds, at the server's
/// time.
pub(crate) fn call(key: &[u8], id: u128, ttl: Micros) -> redis::Cmd {
    let mut call = script().call(1, 4, key.len() + 40);
    call.arg(key).arg("").arg(ttl).arg(slot_id::member(id));
    call
}
