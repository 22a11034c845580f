//! Where a script call's arguments are written: below the transport, which sends them, and
//! beside the codecs, which write them.

/// Where a script call's arguments go: a redis-rs command for the shared connection, or RESP
/// written in place for the `CHECK` calls' own connection (`direct`).
pub(crate) trait Args {
    fn bytes(&mut self, arg: &[u8]);
    fn number(&mut self, n: u64);
}

impl Args for redis::Cmd {
    fn bytes(&mut self, arg: &[u8]) {
        self.arg(arg);
    }

    fn number(&mut self, n: u64) {
        self.arg(n);
    }
}
